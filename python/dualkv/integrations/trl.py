"""TRL integration: :class:`DualKVGRPOTrainer`, TRL's ``GRPOTrainer`` on packed prompt groups.

TRL 1.16's ``GRPOTrainer`` scores every completion as a row ``[left-padded prompt | right-padded
completion]``, so a prompt shared by ``num_generations`` completions goes through the model once
per completion. :class:`DualKVGRPOTrainer` is a drop-in subclass that changes three hooks and
nothing else:

* ``_get_per_token_logps_and_entropies`` (the old-policy and reference passes and the loss): the
  rows are packed with :func:`dualkv.pack` (rows with identical prompt tokens form a group; a row
  whose prompt no other row shares is a group of one), or as a prefix tree (below), the model
  runs once on the packed stream with ``attn_implementation="dualkv"``, and
  :func:`dualkv.response_logprobs` scores the completion tokens with the model's LM head, the
  sampling temperature and the final logit soft-cap. The
  per-token log-probs and entropies come back in TRL's ``[B, completion_len]`` layout (zeros on
  padding), so TRL's losses, KL term, clipping, entropy masks and metrics run unchanged. MoE
  load-balancing loss is computed on the packed router logits with each packed token weighted by
  the number of rows holding it, which is TRL's row-layout value.
* Multi-turn and tool-calling batches (TRL's ``tools`` loop, or a ``rollout_func`` returning an
  ``env_mask``): a completion holds the assistant turns and the tool outputs between them, and
  TRL's ``tool_mask`` keeps the tool outputs out of the loss; the log-probs come back for every
  completion token as in TRL, so its masking applies unchanged. Rows that share more than a
  prompt (a completion's first turns and tool outputs, a long system prompt with the tool
  descriptions across groups, a later turn trained as a row whose prompt holds the earlier ones)
  are packed as a prefix tree (:func:`dualkv.tree_packing.pack_rows_tree`) when the tree packs at
  least :data:`dualkv.tree_packing.TREE_MIN_SAVING` (10%) fewer tokens than prompt groups, chunk
  by chunk (the veRL engine's rule, :func:`dualkv.tree_packing.tree_saves`); prompt groups stay
  the default fast path otherwise.
  ``tree_packing=True`` / ``False`` forces either way, ``tree_min_shared`` (64) is the shortest
  prefix split off. On a tree a model that reads positions only through RoPE numbers each row
  from 0 (TRL's left-padded numbering shifted by a constant per row: the same outputs up to the
  rounding of the rotary angles), so rows share whatever their padding; other models (learned
  absolute positions) keep TRL's positions and share only tokens at equal positions.
* ``_prepare_inputs``: TRL shuffles the rows of a generation batch and cuts it into
  ``steps_per_generation`` micro-batches, which scatters a group over micro-batches. Here whole
  groups are shuffled and assigned to micro-batches of the same row count
  (:func:`group_microbatches`), so a micro-batch holds whole groups whenever
  ``per_device_train_batch_size`` is a multiple of the group size (otherwise the fewest groups
  are cut, each piece packed on its own; a warning says so). Groups whose prompts share a prefix
  (:func:`prefix_families`) go to one micro-batch where they fit, without cutting more groups.
* ``_generate``: generation runs with the model's ordinary attention (``"sdpa"`` unless given), the
  rest of the time the policy and reference models use ``"dualkv"``, so a gradient-checkpointed
  backward replays the packed layers with DualKV.

Usage::

    from dualkv.integrations.trl import DualKVGRPOTrainer
    trainer = DualKVGRPOTrainer(model=model, reward_funcs=reward, args=GRPOConfig(...),
                                train_dataset=dataset, processing_class=tokenizer)
    trainer.train()

Configurations it cannot run raise ``NotImplementedError`` naming the option (see
:data:`UNSUPPORTED_OPTIONS` and :meth:`DualKVGRPOTrainer._check_supported`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import trl
from trl import GRPOTrainer

from ..packing import PackedBatch, pack
from ..tree_packing import DEFAULT_MIN_SHARED, pack_rows_tree, row_forest, tree_saves
from . import transformers as dkt
from .trl_lm_head import PACKED_KWARG, add_packed_lm_head, tree_row_counts
from .trl_microbatches import (
    chunks_of_groups,
    group_microbatches,
    prefix_families,
    prompt_groups,
    select_rows,
)

__all__ = [
    "UNSUPPORTED_OPTIONS",
    "DualKVGRPOTrainer",
    "add_packed_lm_head",
    "group_microbatches",
    "prefix_families",
    "prompt_groups",
]

logger = logging.getLogger(__name__)

SUPPORTED_TRL = "1.16."  # the hooks below are GRPOTrainer's private methods of this release
if not str(trl.__version__).startswith(SUPPORTED_TRL):
    raise ImportError(
        f"dualkv.integrations.trl supports trl {SUPPORTED_TRL}x (it overrides GRPOTrainer's "
        f"internal hooks of that release); found trl {trl.__version__}: install trl==1.16.0"
    )

# GRPOConfig options whose paths DualKV does not run yet (option, the value that is unsupported,
# why). Checked before TRL builds anything.
UNSUPPORTED_OPTIONS: tuple[tuple[str, Any, str], ...] = (
    ("use_vllm", True, "generation by vLLM is not supported yet (generate with transformers)"),
    (
        "use_transformers_continuous_batching",
        True,
        "transformers continuous batching is not supported yet (use generate)",
    ),
    ("use_transformers_paged", True, "paged generation is not supported yet (use generate)"),
    ("use_liger_kernel", True, "Liger kernels are not supported yet"),
)


# Options of TRL's loss that are normalised per micro-batch (``bnpo``: by its token count; the
# entropy quantile mask and the entropy bonus: over its tokens), with the settings at which they
# are: their expected value depends on which rows share a micro-batch.
COMPOSITION_DEPENDENT_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("loss_type", lambda v: v == "bnpo"),
    ("top_entropy_quantile", lambda v: v < 1.0),
    ("entropy_coef", lambda v: v != 0),
    ("use_adaptive_entropy", lambda v: bool(v)),
)


# Text decoders whose forward numbers a row's tokens from its attention mask (cumsum - 1: left
# padding skipped) when it is given no positions, instead of 0..L-1 over the padded row.
MASK_POSITION_MODEL_TYPES = ("opt", "biogpt")


def _max_plus_one(t: torch.Tensor) -> int:
    return int(t.max()) + 1


def row_positions(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The positions TRL's padded rows ``ids`` (mask ``mask``) get from ``model`` by default.

    TRL calls the model without ``position_ids``: most decoders then number the padded row
    0..L-1 (left padding included: absolute embeddings such as GPT-2's see it), and OPT / BioGPT
    number the real tokens from 0 by the attention mask. The packed rows must see the same.
    """
    model_type = getattr(dkt.text_config_of(model), "model_type", None)
    if model_type in MASK_POSITION_MODEL_TYPES:
        return (mask.long().cumsum(1) - 1).clamp(min=0)
    return torch.arange(ids.shape[1], device=ids.device).expand_as(ids)


class DualKVGRPOTrainer(GRPOTrainer):
    """TRL's ``GRPOTrainer`` with log-probs, entropies and the loss on packed prompt groups.

    Takes GRPOTrainer's arguments, plus:

    Args:
        generation_attn_implementation: attention used for generation (``model.generate`` with a
            KV cache, which DualKV does not serve). Default: the model's own implementation
            when it is not ``"dualkv"``, else ``"sdpa"``.
        tree_packing: ``None`` (default): each micro-batch is packed as a prefix tree when the
            tree packs at least :data:`dualkv.tree_packing.TREE_MIN_SAVING` fewer tokens than
            prompt groups (rows sharing earlier turns, a long system prompt shared across
            groups), else by prompt groups; ``True``: always as a tree; ``False``: always by
            prompt groups.
        tree_min_shared: shared prefixes shorter than this many tokens are not split off in a
            tree (:func:`dualkv.pack`'s ``min_shared``).

    Raises:
        NotImplementedError: an option DualKV does not run yet (vLLM or continuous-batching
            generation, PEFT, DeepSpeed/FSDP, multimodal processors, Liger kernels, scaled
            logits), naming it.
    """

    def __init__(
        self,
        *args: Any,
        generation_attn_implementation: str | None = None,
        tree_packing: bool | None = None,
        tree_min_shared: int = DEFAULT_MIN_SHARED,
        **kwargs: Any,
    ) -> None:
        if tree_packing not in (None, True, False):
            raise ValueError(f"tree_packing must be None, True or False, got {tree_packing!r}")
        if isinstance(tree_min_shared, bool) or not isinstance(tree_min_shared, int):
            raise TypeError(f"tree_min_shared must be an int, got {tree_min_shared!r}")
        if tree_min_shared < 1:
            raise ValueError(f"tree_min_shared must be >= 1, got {tree_min_shared}")
        config = kwargs.get("args", args[2] if len(args) > 2 else None)
        if config is not None:
            self._check_options(config)
        if kwargs.get("peft_config") is not None:
            raise NotImplementedError("DualKVGRPOTrainer does not support peft_config yet")
        super().__init__(*args, **kwargs)
        self._check_options(self.args)
        self._check_supported()
        policy = self.accelerator.unwrap_model(self.model)
        own = policy.config._attn_implementation
        if generation_attn_implementation is None:
            generation_attn_implementation = own if own != dkt.ATTN_IMPLEMENTATION else "sdpa"
        if generation_attn_implementation == dkt.ATTN_IMPLEMENTATION:
            raise ValueError(
                "generation_attn_implementation cannot be 'dualkv' (generation uses a KV cache); "
                "use e.g. 'sdpa'"
            )
        self.generation_attn_implementation = generation_attn_implementation
        self.dualkv_groups_cut = 0  # groups cut over micro-batches so far (see group_microbatches)
        self.tree_packing = tree_packing
        self.tree_min_shared = tree_min_shared
        # A model that reads positions only through RoPE is numbered from 0 on each row of a tree
        # (TRL numbers the left-padded row: a constant shift per row, the same outputs up to the
        # rounding of the rotary angles), so rows share a prefix whatever their padding; other
        # models keep TRL's positions, and rows share tokens only at equal positions.
        self._tree_renumbers = dkt.relative_positions_only(policy)
        config_: Any = self.args
        fp32_head = bool(config_.cast_lm_head_to_fp32)
        add_packed_lm_head(policy, self.temperature, fp32_head)
        policy.set_attn_implementation(dkt.ATTN_IMPLEMENTATION)
        if self.ref_model is not None:
            ref = self.accelerator.unwrap_model(self.ref_model)
            add_packed_lm_head(ref, self.temperature, fp32_head)
            ref.set_attn_implementation(dkt.ATTN_IMPLEMENTATION)

    # --- configuration ---------------------------------------------------------------------------
    @staticmethod
    def _check_options(config: Any) -> None:
        for name, bad, why in UNSUPPORTED_OPTIONS:
            if getattr(config, name, None) == bad:
                raise NotImplementedError(f"DualKVGRPOTrainer: {name}={bad!r}: {why}")
        if getattr(config, "deepspeed", None):
            raise NotImplementedError(
                "DualKVGRPOTrainer does not support DeepSpeed (deepspeed) yet"
            )
        if getattr(config, "fsdp", None):
            raise NotImplementedError("DualKVGRPOTrainer does not support FSDP yet (fsdp)")
        # Whole-group micro-batches change what a per-micro-batch normalisation averages over
        # (TRL splits shuffled rows): refuse the loss terms whose expected value depends on it
        # when a generation batch is split at all.
        if (getattr(config, "steps_per_generation", 1) or 1) > 1:
            for name, differs in COMPOSITION_DEPENDENT_OPTIONS:
                value = getattr(config, name, None)
                if value is not None and differs(value):
                    raise NotImplementedError(
                        f"DualKVGRPOTrainer: {name}={value!r} with steps_per_generation="
                        f"{config.steps_per_generation}: this term is normalised per micro-batch, "
                        "and DualKV's micro-batches hold whole prompt groups where TRL's hold "
                        "shuffled rows, so the loss would differ in expectation; not supported "
                        "yet (use steps_per_generation=1, or loss_type 'dapo' / 'grpo' / "
                        "'dr_grpo' without entropy terms)"
                    )

    def _check_supported(self) -> None:
        from transformers import ProcessorMixin

        if isinstance(self.processing_class, ProcessorMixin):
            raise NotImplementedError(
                "DualKVGRPOTrainer packs text only: multimodal processors "
                f"({type(self.processing_class).__name__}) are not supported yet"
            )
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise NotImplementedError("DualKVGRPOTrainer does not support DeepSpeed or FSDP yet")
        from accelerate.utils import is_peft_model

        if is_peft_model(self.model):
            raise NotImplementedError("DualKVGRPOTrainer does not support PEFT models yet")
        steps = getattr(self.args, "steps_per_generation", 1) or 1
        if getattr(self, "aux_loss_enabled", False) and steps > 1:
            # the load-balancing loss is nonlinear in which tokens share a micro-batch: whole
            # groups (and families sharing a system prompt) route more alike than TRL's shuffled
            # rows, so its expected value is larger; said once, not refused (MoE users rely on it)
            logger.warning(
                "DualKVGRPOTrainer: the MoE load-balancing loss (router_aux_loss_coef=%s) is "
                "computed per micro-batch, and with steps_per_generation=%d DualKV's micro-batches "
                "hold whole prompt groups where TRL's hold shuffled rows: its value differs from "
                "TRL's in expectation (larger: a micro-batch's tokens route more alike). "
                "steps_per_generation=1 gives TRL's value exactly.",
                self.router_aux_loss_coef,
                steps,
            )

    @contextlib.contextmanager
    def _generation_attention(self) -> Iterator[None]:
        """The policy in ``generation_attn_implementation`` inside the block, then DualKV."""
        policy = self.accelerator.unwrap_model(self.model)
        policy.set_attn_implementation(self.generation_attn_implementation)
        try:
            yield
        finally:
            policy.set_attn_implementation(dkt.ATTN_IMPLEMENTATION)

    # --- hooks -----------------------------------------------------------------------------------
    def _generate(self, prompts: list) -> Any:
        with self._generation_attention():
            return super()._generate(prompts)

    def _prepare_inputs(self, generation_batch: Any) -> dict[str, Any]:
        # TRL's _prepare_inputs, with its row shuffle and equal split replaced by whole groups.
        model: Any = self.model
        if not model.training:
            return super()._prepare_inputs(generation_batch)
        args: Any = self.args
        steps = args.steps_per_generation
        generate_every = steps * self.num_iterations
        buffered: Any = getattr(self, "_buffered_inputs", None)
        if self._step % generate_every == 0 or buffered is None:
            batch = self._generate_and_score_completions(generation_batch)
            buffered = self.split_generation_batch(batch, steps)
            self._buffered_inputs = buffered
        return buffered[self._step % steps]  # type: ignore[no-any-return]

    def split_generation_batch(
        self, batch: dict[str, Any], num_chunks: int
    ) -> list[dict[str, Any]]:
        """Shuffle a generation batch by groups and split it into whole-group micro-batches
        (groups whose prompts share a prefix together where they fit: :func:`prefix_families`)."""
        for name in ("pixel_values", "num_images"):
            if batch.get(name) is not None:
                raise NotImplementedError(f"DualKVGRPOTrainer: multimodal input {name!r}")
        groups = prompt_groups(batch["prompt_ids"], batch["prompt_mask"])
        families = None
        if self.tree_packing is not False and num_chunks > 1:
            size = groups.numel() // num_chunks
            families = prefix_families(
                batch["prompt_ids"], batch["prompt_mask"], groups, size, self.tree_min_shared
            )
        chunks, cut = group_microbatches(groups, num_chunks, families=families)
        if cut:
            self.dualkv_groups_cut += cut
            logger.warning(
                "DualKV: %d prompt group(s) were cut over micro-batches of %d rows (make "
                "per_device_train_batch_size a multiple of num_generations to keep groups whole)",
                cut,
                groups.numel() // num_chunks,
            )
        return [{k: select_rows(v, idx) for k, v in batch.items()} for idx in chunks]

    def _get_per_token_logps_and_entropies(  # type: ignore[override]
        self,
        model: Any,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        batch_size: int | None = None,
        compute_entropy: bool = False,
        compute_aux_loss: bool = False,
        **multimodal: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        for name in multimodal:
            if name not in dkt.MULTIMODAL_ARGS:
                raise TypeError(f"unexpected argument {name!r}")
        dkt.refuse_multimodal(multimodal, "DualKVGRPOTrainer")
        num_rows, width = input_ids.shape
        prompt_width = width - int(logits_to_keep)
        prompt_mask = attention_mask[:, :prompt_width]
        empty = (prompt_mask.sum(1) == 0).nonzero().flatten().tolist()
        if empty:
            # TRL scores such a row's first completion token from a padding position; a packed
            # group with no prompt has no token before it (DualKV leaves it out): they differ
            raise NotImplementedError(
                f"rows {empty[:8]} have an empty prompt: not supported yet by DualKVGRPOTrainer"
            )
        groups = prompt_groups(input_ids[:, :prompt_width], prompt_mask)
        max_rows = batch_size or num_rows
        families = None
        if self.tree_packing is not False and max_rows < num_rows:
            families = prefix_families(
                input_ids[:, :prompt_width], prompt_mask, groups, max_rows, self.tree_min_shared
            )
        chunks = chunks_of_groups(groups, max_rows, families)
        logps: list[torch.Tensor] = []
        ents: list[torch.Tensor] = []
        auxes: list[torch.Tensor] = []
        trainee: Any = self.model
        mode = "train" if trainee.training else "eval"
        for idx in chunks:
            whole = idx.numel() == num_rows and bool((idx == torch.arange(num_rows)).all())
            dev_idx = idx.to(input_ids.device)
            ids = input_ids if whole else input_ids.index_select(0, dev_idx)
            mask = attention_mask if whole else attention_mask.index_select(0, dev_idx)
            policy = self.accelerator.unwrap_model(trainee)
            positions = row_positions(policy, ids, mask)
            # TRL's rows take a length-dependent RoPE's frequencies from the padded width
            dkt.check_rope_length(
                policy, functools.partial(_max_plus_one, positions), "TRL's padded rows"
            )
            packed, weights = self._pack_chunk(
                ids, mask, prompt_width, groups[idx], positions, mode
            )
            extra: dict[str, Any] = {}
            if compute_aux_loss:
                extra = {"output_router_logits": True, "dualkv_token_weights": weights}
            with self.accelerator.autocast():
                out = model(**{PACKED_KWARG: packed}, dualkv_entropy=compute_entropy, **extra)
            logps.append(out.log_probs)
            if compute_entropy:
                ents.append(out.entropy)
            if compute_aux_loss:
                auxes.append(out.aux_loss)
        logp = self._rows(logps, chunks, num_rows)
        ent = self._rows(ents, chunks, num_rows) if compute_entropy else None
        aux = torch.stack(auxes).mean() if compute_aux_loss else None
        return logp, ent, aux

    def _pack_chunk(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        prompt_width: int,
        groups: torch.Tensor,
        positions: torch.Tensor,
        mode: str,
    ) -> tuple[PackedBatch, torch.Tensor | None]:
        """TRL's rows of one chunk packed by prompt groups or as a prefix tree (see
        ``tree_packing``), with the rows each packed token stands for on a tree (for the MoE
        load-balancing loss; None on prompt groups, whose layout tells it). Logs the token
        reduction (the rows' real tokens over the packed ones) and whether a tree was used."""
        packed: PackedBatch | None = None
        weights = None
        reduction = 1.0
        if self.tree_packing is not False:
            tree_positions = None if self._tree_renumbers else positions
            forest = row_forest(ids, mask, prompt_width, tree_positions, self.tree_min_shared)
            lengths = (mask != 0).sum(1).to("cpu")
            use_tree = bool(self.tree_packing)
            if not use_tree:
                prompt_lens = (mask[:, :prompt_width] != 0).sum(1).to("cpu")
                codes = groups.to("cpu", torch.int64)
                per_group = torch.zeros(int(codes.max()) + 1, dtype=torch.int64)
                per_group.scatter_(0, codes, prompt_lens)  # (rows of a group: one prompt length)
                flat = int(per_group.sum() + lengths.sum() - prompt_lens.sum())
                use_tree = tree_saves(flat, forest.total_tokens)
            if use_tree:
                packed = pack_rows_tree(
                    ids, mask, prompt_width, tree_positions, self.tree_min_shared, forest=forest
                )
                weights = tree_row_counts(forest, lengths, packed.device)
                # (a tree layout's own token_reduction counts its root-to-leaf paths, not rows)
                reduction = int(lengths.sum()) / max(packed.total_tokens, 1)
        if packed is None:
            packed = pack(ids, mask, prompt_width, group_ids=groups, position_ids=positions)
            reduction = packed.token_reduction
        self._metrics[mode]["dualkv/token_reduction"].append(reduction)
        self._metrics[mode]["dualkv/tree"].append(float(packed.layout.is_tree))
        return packed, weights

    @staticmethod
    def _rows(
        parts: Sequence[torch.Tensor], chunks: Sequence[torch.Tensor], n: int
    ) -> torch.Tensor:
        """Per-chunk ``[b_i, C]`` results back to the batch's row order ``[n, C]``."""
        if len(parts) == 1 and parts[0].shape[0] == n:
            idx = chunks[0]
            if bool((idx == torch.arange(n)).all()):
                return parts[0]
        cat = torch.cat(list(parts), 0)
        index = torch.cat(list(chunks)).to(cat.device)
        return cat.new_zeros(cat.shape).index_copy(0, index, cat)
