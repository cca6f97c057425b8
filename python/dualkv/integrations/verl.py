"""veRL 0.9.1 integration: the FSDP engine path on packed prompt groups.

Turn it on with one setting, the model's attention implementation::

    actor_rollout_ref.model.override_config.attn_implementation=dualkv

With dualkv installed, ``import verl`` loads this module (the ``verl.plugins`` entry point of
dualkv's package metadata; ``VERL_USE_EXTERNAL_MODULES=dualkv.integrations.verl`` or
``actor_rollout_ref.model.external_lib=dualkv.integrations.verl`` do the same where plugin
discovery is off). It registers :class:`DualKVFSDPEngineWithLMHead` as veRL's language-model
engine of the ``fsdp`` and ``fsdp2`` strategies (through veRL's ``EngineRegistry``, for the
``("cuda", "nvidia")`` key, which veRL looks up before its own ``"cuda"`` entry, and for
``"cpu"``). The engine is veRL's ``FSDPEngineWithLMHead`` unchanged unless the model's
``attn_implementation`` is ``"dualkv"``; then the actor's ``compute_log_prob`` (old log-probs),
the reference model's ``compute_ref_log_prob`` (it shares the model config) and the policy
update run on packed groups (or prefix trees):

* group-aware micro-batching: the rows of one prompt (rows whose real prompt tokens are
  identical; a prompt seen once is a singleton group) always land in the same micro-batch. With
  dynamic batch size a micro-batch holds at most ``max_token_len_per_gpu`` *packed* tokens
  (``P + sum_i R_i`` per group, not ``N (P + R)``), so it holds rho times more responses; with a
  fixed micro-batch size it holds whole groups of at most ``micro_batch_size_per_gpu`` rows (a
  larger group is a micro-batch of its own). Every data-parallel rank runs the same number of
  micro-batches (the count is agreed with an all-reduce, as veRL does).
* prefix trees: rows that share more than their prompt (a system prompt with tool descriptions
  across the groups of veRL's multi-turn agent-loop rows; per-turn samples, each turn's row the
  whole earlier conversation; branching rollouts) are packed as a prefix tree
  (:func:`dualkv.tree_packing.pack_rows_tree`: each shared prefix computed once) when that packs
  at least ``TREE_MIN_SAVING`` (10%) fewer tokens than the prompt groups; otherwise the depth-two
  prompt-group packing runs, the measured fast path, unless only the tree fits the budget. When
  the whole batch's prefix forest saves that much, or when a prompt group exceeds the packed-token
  budget as prompt groups but not as a tree (rows sharing long prefixes beyond their prompt),
  micro-batches are contiguous runs of groups in the sorted order of their rows (neighbours share
  prefixes), each within the budget in the packed tokens of the packing it runs
  (:func:`.verl_grouping.use_sharing_partition`); ordinary GRPO batches keep the balanced
  prompt-group partition.
  ``DUALKV_VERL_PACKING=tree`` or ``=groups`` (an environment variable of the training
  processes) forces either packing. Response and loss masks with zeros inside the response (the
  agent loop's tool outputs) need nothing: every real response token gets its log-prob, and
  veRL's loss applies its ``response_mask``. Under Ulysses (below) the same choice is made on
  the sp group's micro-batch, and :mod:`dualkv.parallel` shards the tree as it does prompt groups.
* the model runs on one packed stream per micro-batch (``attn_implementation="dualkv"``), and the
  response log-probs (and entropy) come from :func:`dualkv.response_logprobs` (chunked over the
  tokens, no full-vocabulary logits of the whole micro-batch), computed inside the FSDP forward of
  the LM head so FSDP1/FSDP2 gather and reduce its weight as usual;
* the outputs are returned in veRL's own layout, nested ``[B, P_b + R_b]`` per row with the value
  predicting token ``t + 1`` at position ``t``, so veRL's ``no_padding_2_padding`` and its PPO/GRPO
  loss run unchanged. Positions that do not predict a response token (the prompt's, the last) are
  0: nothing in veRL's RL path reads them.

Ulysses sequence parallelism (``ulysses_sequence_parallel_size = sp > 1``; veRL builds its
``(dp, sp)`` device mesh and sp process group, and hands every rank of an sp group the same rows):
every rank builds the same packed micro-batch (the budget is ``max_token_len_per_gpu * sp``
packed tokens, as veRL's own Ulysses micro-batching), :func:`dualkv.parallel.shard_batch` gives it
its token shard (``ceil(T / sp)`` tokens, the stream padded at its end), the decoder runs on the
shard with Ulysses all-to-all attention (:func:`dualkv.parallel.ulysses_attention` on the global
layout, KV heads replicated when ``num_key_value_heads < sp``), and
:func:`dualkv.parallel.response_logprobs` scores each rank's predicting positions and sums the
disjoint parts, so every rank returns the whole micro-batch's log-probs/entropy in veRL's layout.
Its backward hands each rank ``sp`` times its share of the gradient (``grad_scale=sp``, as veRL's
``gather_outputs_and_unpad`` does), which veRL's FSDP mesh over all ``dp * sp`` ranks then
averages to the gradient of the ``dp`` batches. Tested on CPU (gloo, 2 processes): equal to the
``sp = 1`` DualKV engine and to veRL's own SDPA engine. The heads must split:
``num_attention_heads % sp == 0`` (else :class:`DualKVVerlError`); veRL itself requires
``use_remove_padding=True`` and ``num_key_value_heads`` and ``sp`` dividing one another. Ranks of
an sp group holding different rows are refused (one small all-reduce per batch checks it).

Works with ``use_remove_padding`` on or off (the packed stream replaces both; on with Ulysses),
dynamic batch size, gradient checkpointing, FSDP2 (tested on CPU against veRL's own engine) and
FSDP1 (the same code; not tested: veRL's FSDP1 setup needs a GPU), one temperature per
micro-batch. Anything that cannot be packed raises :class:`DualKVVerlError` naming the setting:
fused kernels, ``pad_to_length``, LoRA, multi-modal inputs or 3-D (mRoPE) position ids, top-k
distillation, ``calculate_sum_pi_squared``, per-sample temperatures that differ, SFT-style loss
masks over the whole sequence, empty prompts, attention heads that ``sp`` does not divide.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

from .. import parallel as _sp
from ..packing import PackedBatch, pack_rows
from ..tree_packing import DEFAULT_MIN_SHARED, pack_rows_tree, sorted_trainer_rows
from . import transformers as _hf  # registers attn_implementation="dualkv"
from .verl_cpu_platform import use_cpu_platform
from .verl_errors import DualKVVerlError, unsupported
from .verl_grouping import (
    PACKING_ENV,
    GroupCosts,
    packing_mode,
    partition_groups,
    prompt_groups,
    use_sharing_partition,
)
from .verl_microbatches import all_reduce_int, group_partition, padded_rows, sharing_partition
from .verl_packed_model import (
    ENTROPY_KW,
    GRAD_SCALE_KW,
    PACKED_KW,
    TEMP_KW,
    install_packed_forward,
)

try:
    from verl.utils import tensordict_utils as tu
    from verl.utils.dataset.dataset_utils import DatasetPadMode
    from verl.utils.device import get_device_id, get_device_name
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    from verl.workers.engine.utils import postprocess_batch_func
except ImportError as exc:  # pragma: no cover - exercised only without verl
    raise ImportError(
        "dualkv.integrations.verl needs veRL 0.9.1 (pip install verl==0.9.1; see "
        f"scripts/setup_verl_env.sh): {exc}"
    ) from exc

__all__ = [
    "ATTN_IMPLEMENTATION",
    "DualKVFSDPEngineWithLMHead",
    "DualKVVerlError",
    "PACKING_ENV",
    "partition_groups",
    "prompt_groups",
    "use_cpu_platform",
]

ATTN_IMPLEMENTATION = _hf.ATTN_IMPLEMENTATION
_TREE_KW = "dualkv_tree"  # a micro-batch's packing (non-tensor data, set by the partition)
_TOKENS_KW = "dualkv_packed_tokens"  # and its packed token count


# veRL policy losses normalised over each micro-batch's own rows or tokens instead of the global
# batch info (core_algos: geo_mean's mean over rows; kl_cov / clip_cov's per-micro-batch
# covariance and token count), and bypass_mode's importance weights normalised per micro-batch
# (rollout_is_batch_normalize): DualKV's micro-batches hold whole prompt groups, not veRL's rows,
# so these would change the loss (geo_mean: the gradient scaled by 0.5-1.5 on a tiny Qwen3).
_MICRO_BATCH_LOSS_MODES = ("geo_mean", "kl_cov", "clip_cov")


def _option(config: Any, name: str, default: Any = None) -> Any:
    get = getattr(config, "get", None)
    return get(name, default) if callable(get) else getattr(config, name, default)


def check_loss_split_invariant(loss_function: Callable[..., Any]) -> None:
    """Raise :class:`DualKVVerlError` for a veRL loss (``partial(ppo_loss, config=...)``, as
    veRL's workers build it) whose value depends on how a mini-batch is cut into micro-batches."""
    keywords = loss_function.keywords if isinstance(loss_function, functools.partial) else {}
    config = keywords.get("config")
    policy = _option(config, "policy_loss") if config is not None else None
    if policy is None:
        return
    mode = _option(policy, "loss_mode", "vanilla")
    if mode in _MICRO_BATCH_LOSS_MODES:
        raise unsupported(
            f"policy_loss.loss_mode={mode!r} (it normalises over each micro-batch, and DualKV's "
            "micro-batches hold whole prompt groups where veRL's hold consecutive rows)"
        )
    correction = _option(policy, "rollout_correction")
    if mode == "bypass_mode" and correction is not None:
        if _option(correction, "rollout_is_batch_normalize", False):
            raise unsupported(
                "policy_loss.rollout_correction.rollout_is_batch_normalize=True with "
                "loss_mode='bypass_mode' (the importance weights are normalised per micro-batch, "
                "and DualKV's micro-batches are not veRL's)"
            )


def _packing_mode(engine: Any) -> str:
    """The packing mode of an engine's batches (:data:`PACKING_ENV`, read at its init)."""
    return str(getattr(engine, "dualkv_packing", "auto"))


def _check_sequence_parallel(text_config: Any, sp: int) -> None:
    """Refuse a model whose heads cannot be split over ``sp`` Ulysses ranks (naming the config)."""
    hq = getattr(text_config, "num_attention_heads", None)
    hkv = getattr(text_config, "num_key_value_heads", None) or hq
    if not isinstance(hq, int) or not isinstance(hkv, int):
        raise unsupported(
            "Ulysses sequence parallelism (ulysses_sequence_parallel_size="
            f"{sp}) on a model config without num_attention_heads / num_key_value_heads"
        )
    try:
        _sp.kv_replication(hq, hkv, sp)
    except ValueError as exc:
        raise DualKVVerlError(
            f"DualKV engine: ulysses_sequence_parallel_size={sp} cannot split the model's "
            f"attention heads (num_attention_heads={hq}, num_key_value_heads={hkv}): {exc}"
        ) from exc


# --- the engine ---------------------------------------------------------------------------------


class DualKVFSDPEngineWithLMHead(FSDPEngineWithLMHead):
    """veRL's FSDP language-model engine, on packed prompt groups when the model's attention is
    ``"dualkv"`` (``actor_rollout_ref.model.override_config.attn_implementation=dualkv``);
    otherwise exactly veRL's ``FSDPEngineWithLMHead``."""

    def __init__(self, model_config: Any, engine_config: Any, *args: Any, **kwargs: Any) -> None:
        hf_config = getattr(model_config, "hf_config", None)
        text_config = hf_config.get_text_config() if hf_config is not None else None
        impl = getattr(text_config, "_attn_implementation", None)
        self.dualkv = impl == ATTN_IMPLEMENTATION
        if self.dualkv:
            try:
                self.dualkv_packing = packing_mode(os.environ.get(PACKING_ENV))
            except ValueError as exc:
                raise DualKVVerlError(f"DualKV engine: {exc}") from exc
            sp = engine_config.ulysses_sequence_parallel_size
            if sp > 1:
                _check_sequence_parallel(text_config, sp)
            if getattr(model_config, "use_fused_kernels", False):
                raise unsupported("use_fused_kernels=True")
            if getattr(engine_config, "pad_to_length", False):
                raise unsupported("pad_to_length=True")
            if getattr(model_config, "lora_rank", 0) > 0:
                raise unsupported(f"LoRA (lora_rank={model_config.lora_rank})")
            if getattr(model_config, "model_type", "language_model") != "language_model":
                raise unsupported(f"model_type={model_config.model_type!r}")
        super().__init__(model_config, engine_config, *args, **kwargs)

    # model construction: the packed forward is installed before FSDP wraps the model
    def _build_module(self) -> torch.nn.Module:
        module = super()._build_module()
        if self.dualkv:
            install_packed_forward(module)
        return module

    # micro-batching ---------------------------------------------------------------------------
    def prepare_dualkv_micro_batches(self, data: Any) -> tuple[list[Any], list[list[int]]]:
        """Split a (mini-)batch into micro-batches of whole prompt groups, and pick each one's
        packing (prompt groups or prefix tree; see the module docstring).

        Returns:
            ``(micro_batches, indices)``: each micro-batch a TensorDict of rows, ``indices[i]``
            their row indices in ``data`` (increasing). Each micro-batch carries its packing and
            packed token count as non-tensor data for :meth:`prepare_model_inputs`.
        """
        if "prompts" not in data.keys() or "attention_mask" not in data.keys():
            raise unsupported(
                "a batch without veRL's padded 'prompts' and 'attention_mask' (the DualKV engine "
                "reads each row's prompt from them)"
            )
        if data["prompts"].is_nested:
            raise unsupported("nested 'prompts'")
        group, plen, rlen = prompt_groups(data["prompts"], data["attention_mask"])
        num_groups = int(group.max()) + 1 if group.numel() else 0
        rows_of: list[list[int]] = [[] for _ in range(num_groups)]
        for b, g in enumerate(group.tolist()):
            rows_of[g].append(b)
        use_dynamic_bsz = tu.get_non_tensor_data(data=data, key="use_dynamic_bsz", default=True)
        sp = int(getattr(self, "ulysses_sequence_parallel_size", 1) or 1)
        if sp > 1:
            self._check_same_data_in_sp_group(data, plen, rlen)
        flat = [int(plen[r[0]]) + int(rlen[r].sum()) for r in rows_of]
        if use_dynamic_bsz:
            # as veRL: with Ulysses a micro-batch is split over the sp ranks, so it may hold sp
            # times the per-GPU budget (each rank then holds ceil(T / sp) <= the budget tokens)
            budget = int(data["max_token_len_per_gpu"]) * sp
            costs = flat
            name = (
                "max_token_len_per_gpu" if sp == 1
                else f"max_token_len_per_gpu * ulysses_sequence_parallel_size ({sp})"
            )  # fmt: skip
        else:
            budget = int(data["micro_batch_size_per_gpu"])
            costs = [len(r) for r in rows_of]
            name = "micro_batch_size_per_gpu"
        token_budget = budget if use_dynamic_bsz else None
        dp_group = self.get_data_parallel_group()
        mode = _packing_mode(self)

        def group_costs() -> GroupCosts:
            """The batch's groups priced in both packings (sorts the rows: host work)."""
            rows, mask, pw, pos = padded_rows(data)
            return GroupCosts(sorted_trainer_rows(rows, mask, pw, pos), rows_of, flat, mode)

        prices: GroupCosts | None = None
        shares = False
        if mode != "groups":
            prices = group_costs()
            shares = use_sharing_partition(prices, token_budget)

        def describe(g: int) -> str:
            """A prompt group, for an error naming it (in ``"groups"`` mode with the tree that
            would fit)."""
            rows_g = rows_of[g]
            shown = ", ".join(map(str, rows_g[:8])) + (", ..." if len(rows_g) > 8 else "")
            about = f"{len(rows_g)} responses to a {int(plen[rows_g[0]])}-token prompt"
            if mode == "groups" and token_budget is not None:
                tree = group_costs().tree([g])
                if tree < flat[g] and tree <= token_budget:
                    about += (
                        f"; as a prefix tree it packs to {tree} tokens, within the budget, but "
                        f"{PACKING_ENV}=groups rules trees out: with {PACKING_ENV}=auto, the "
                        "default, the engine runs it as a tree"
                    )
            return f"the prompt group of rows [{shown}] ({about})"

        # one partition on every data-parallel rank (they run the same collectives)
        if all_reduce_int(int(shares), torch.distributed.ReduceOp.MAX, dp_group):
            assert prices is not None  # (every rank is in the same mode)
            bins = sharing_partition(
                prices, rows_of, budget, token_budget, name, dp_group, describe
            )
        else:
            bins = group_partition(costs, budget, use_dynamic_bsz, name, dp_group, describe)
        indices = [sorted(b for g in groups for b in rows_of[g]) for groups in bins]
        micro_batches = []
        for groups, idx in zip(bins, indices, strict=True):
            tree, tokens = (
                prices.choice(groups, token_budget) if prices is not None
                else (False, sum(flat[g] for g in groups))
            )  # fmt: skip
            if use_dynamic_bsz and tokens > budget:  # (the partitions priced exactly this)
                raise RuntimeError(
                    f"DualKV engine: a micro-batch of {tokens} packed tokens exceeds {name}="
                    f"{budget}; please report this with the batch's shapes"
                )
            micro = tu.index_select_tensor_dict(data, idx)
            tu.assign_non_tensor(micro, **{_TREE_KW: tree, _TOKENS_KW: tokens})
            micro_batches.append(micro)
        return micro_batches, indices

    def _check_same_data_in_sp_group(
        self, data: Any, plen: torch.Tensor, rlen: torch.Tensor
    ) -> None:
        """The ranks of a Ulysses group must hold the same rows (veRL dispatches them so); a
        mismatch would shard different streams as one, so it is refused (one small all-reduce).
        """
        ids = data["input_ids"]
        values = ids.values() if ids.is_nested else ids
        fingerprint = torch.stack([
            torch.tensor(plen.numel()), plen.sum(), rlen.sum(), _sp.weighted_sum(values.cpu()),
        ]).to(torch.int64)  # fmt: skip
        if not _sp.same_on_ranks(fingerprint.to(get_device_name()), self.ulysses_parallel_group):
            raise DualKVVerlError(
                "DualKV engine: the ranks of a Ulysses sequence-parallel group "
                f"(ulysses_sequence_parallel_size={self.ulysses_sequence_parallel_size}) hold "
                "different batches; every rank of the group must be given the same rows"
            )

    def forward_backward_batch(
        self, data: Any, loss_function: Callable[..., Any], forward_only: bool = False
    ) -> Any:
        if not self.dualkv:
            return super().forward_backward_batch(data, loss_function, forward_only)
        if not forward_only:
            check_loss_split_invariant(loss_function)
        tu.assign_non_tensor(data, sp_size=self.ulysses_sequence_parallel_size)
        return_model_output = tu.get_non_tensor_data(
            data=data, key="return_model_output", default=False
        )
        if data["loss_mask"].is_nested:
            raise unsupported(
                "a loss mask over whole sequences (SFT-style nested loss_mask; the DualKV engine "
                "scores response tokens only)"
            )
        batch_num_tokens = data["loss_mask"].sum().to(get_device_id())
        torch.distributed.all_reduce(
            batch_num_tokens, op=torch.distributed.ReduceOp.SUM,
            group=self.get_data_parallel_group(),
        )  # fmt: skip
        tu.assign_non_tensor(data, batch_num_tokens=batch_num_tokens.item())
        tu.assign_non_tensor(data, dp_size=self.get_data_parallel_size())

        micro_batches, indices = self.prepare_dualkv_micro_batches(data)
        ctx = torch.no_grad() if forward_only else nullcontext()
        scaler = getattr(self, "scaler", None)
        output_lst = []
        for i, micro_batch in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            sync_ctx = (
                nullcontext() if forward_only
                else self._gradient_sync_context(is_last_micro_batch=last)
            )  # fmt: skip
            with ctx, sync_ctx, torch.profiler.record_function(f"dualkv_micro_batch{i}"):
                loss, meta_info = self.forward_step(
                    micro_batch, loss_function=loss_function, forward_only=forward_only
                )
                if not forward_only:
                    (scaler.scale(loss) if scaler is not None else loss).backward()
                    if not return_model_output:
                        meta_info.pop("model_output", None)
            output_lst.append(meta_info)
        # veRL's own post-processing; the row order is restored as after its dynamic batching
        view = tu.get_tensordict(
            tensor_dict={},
            non_tensor_dict={"use_dynamic_bsz": True, "pad_mode": DatasetPadMode.NO_PADDING},
        )
        return postprocess_batch_func(output_lst=output_lst, indices=indices, data=view)

    # model inputs and outputs -------------------------------------------------------------------
    def prepare_model_inputs(self, micro_batch: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """veRL's hook: the model's keyword arguments for a micro-batch. With DualKV on, the
        micro-batch's rows packed (prompt groups or a prefix tree, as the partition chose) into
        one stream with its layout and positions; settings it cannot run packed raise
        :class:`DualKVVerlError` naming them. Otherwise veRL's own."""
        if not self.dualkv:
            return super().prepare_model_inputs(micro_batch)
        get = tu.get_non_tensor_data
        pad_mode = get(data=micro_batch, key="pad_mode", default=DatasetPadMode.NO_PADDING)
        if pad_mode != DatasetPadMode.NO_PADDING:
            raise unsupported(f"pad_mode={pad_mode}")
        if get(data=micro_batch, key="use_fused_kernels", default=False):
            raise unsupported("use_fused_kernels=True")
        if get(data=micro_batch, key="distillation_use_topk", default=False):
            raise unsupported("top-k distillation (distillation_use_topk)")
        if get(data=micro_batch, key="calculate_sum_pi_squared", default=False):
            raise unsupported("calculate_sum_pi_squared=True (it needs the full logits)")
        if len(micro_batch.get("multi_modal_inputs", [])) > 0:
            raise unsupported("multi-modal inputs")
        input_ids = micro_batch["input_ids"]
        rows, mask, pw, pos = padded_rows(micro_batch)
        plen = (mask[:, :pw] != 0).sum(1)
        if bool((plen == 0).any()):
            raise unsupported("an empty prompt (veRL's layout needs P >= 1)")
        tree = get(data=micro_batch, key=_TREE_KW, default=None)
        if tree is None:  # (a micro-batch not cut by prepare_dualkv_micro_batches)
            tree = _packing_mode(self) == "tree"
        packed = (
            pack_rows_tree(rows, mask, pw, pos, DEFAULT_MIN_SHARED) if tree
            else pack_rows(rows, mask, pw, None, position_ids=pos)
        )  # fmt: skip
        tokens = get(data=micro_batch, key=_TOKENS_KW, default=None)
        if tokens is not None and packed.total_tokens != tokens:
            raise RuntimeError(
                f"DualKV engine: the micro-batch packed to {packed.total_tokens} tokens where its "
                f"partition priced {tokens}; please report this with the batch's shapes"
            )
        # Ulysses: every rank of the sp group built the same packed micro-batch; the model runs on
        # this rank's token shard (veRL's flat FSDP mesh averages the gradients over the sp ranks
        # too, so the backward hands each rank sp times its share, as veRL's Ulysses gather does)
        sp_group = getattr(self, "ulysses_parallel_group", None)
        model_batch: PackedBatch | _sp.ShardedBatch = packed
        grad_scale = 1.0
        if self.ulysses_sequence_parallel_size > 1:
            model_batch = _sp.shard_batch(packed, sp_group)
            grad_scale = float(self.ulysses_sequence_parallel_size)

        temperature = micro_batch["temperature"]
        if isinstance(temperature, torch.Tensor):
            flat = temperature.detach().reshape(-1).to("cpu", torch.float64)
            if flat.numel() and bool((flat != flat[0]).any()):
                raise unsupported("per-sample temperatures that differ within a micro-batch")
            temperature = float(flat[0]) if flat.numel() else 1.0
        calculate_entropy = get(data=micro_batch, key="calculate_entropy", default=False)
        model_inputs = {
            "input_ids": model_batch.input_ids,
            "position_ids": model_batch.position_ids,
            PACKED_KW: model_batch,
            TEMP_KW: float(temperature),
            ENTROPY_KW: bool(calculate_entropy),
            GRAD_SCALE_KW: grad_scale,
        }
        offsets = input_ids.offsets()
        row_start = offsets[:-1].to(rows.device)
        output_args = {
            "dualkv_packed": packed,
            "offsets": offsets,
            # position (in the nested values) of the value scoring response token 0 of each row
            "response_start": row_start + plen - 1,
            "calculate_entropy": bool(calculate_entropy),
        }
        return model_inputs, output_args

    def prepare_model_outputs(
        self,
        output: Any,
        output_args: dict[str, Any],
        micro_batch: Any,
        logits_processor_func: Any,
    ) -> dict[str, Any]:
        """veRL's hook: the model's outputs in veRL's layout. With DualKV on, the packed
        response log-probs (and entropy) scattered back to each row's response tokens, as the
        jagged tensors veRL's no-padding path returns. Otherwise veRL's own."""
        if not self.dualkv:
            return super().prepare_model_outputs(
                output, output_args, micro_batch, logits_processor_func
            )
        packed: PackedBatch = output_args["dualkv_packed"]
        offsets = output_args["offsets"]
        total = int(offsets[-1])
        valid = packed.response_mask
        cols = torch.arange(valid.shape[1], device=valid.device)
        dest = (output_args["response_start"][:, None] + cols[None, :])[valid]

        def to_rows(x: torch.Tensor) -> torch.Tensor:
            flat = x.new_zeros(total).index_copy(0, dest, x[valid])
            return torch.nested.nested_tensor_from_jagged(flat, offsets.to(flat.device))

        model_output = {"log_probs": to_rows(output[0])}
        if output_args["calculate_entropy"]:
            model_output["entropy"] = to_rows(output[1])
        return model_output


def _register() -> None:
    """Register the engine for veRL's fsdp/fsdp2 language-model strategies (idempotent)."""
    engines = EngineRegistry._engines.get("language_model", {})
    for key in (("cuda", "nvidia"), "cpu"):
        taken = [
            engines.get(b, {}).get(key) for b in ("fsdp", "fsdp2") if key in engines.get(b, {})
        ]
        if any(cls is DualKVFSDPEngineWithLMHead for cls in taken):
            continue
        if taken:
            raise RuntimeError(
                f"dualkv: veRL already has a language-model engine registered for {key!r} "
                f"({taken[0].__name__}); DualKV's engine cannot be registered beside it"
            )
        device, vendor = key if isinstance(key, tuple) else (key, None)
        EngineRegistry.register(
            model_type="language_model", backend=["fsdp", "fsdp2"], device=device, vendor=vendor
        )(DualKVFSDPEngineWithLMHead)


_register()
