"""DualKV's veRL engine against veRL's own FSDP engine (real veRL 0.9.1, CPU, one process).

Runs in the veRL environment (scripts/setup_verl_env.sh; scripts/test.sh runs this file there)
and is skipped where verl is not installed. Both engines are built by veRL from the same saved
tiny random model (Qwen3, Qwen3-MoE); veRL's engine runs the rows with SDPA, DualKV's the packed
groups. Compared: log-probs and entropy of compute_log_prob in veRL's layout, the PPO loss,
every parameter's gradient, and the parameters after one optimizer step (fp32 tolerance); and
that micro-batches hold whole groups within the packed-token budget. FSDP2, and FSDP1 in one
2-process test (veRL's FSDP1 setup checks module states with a GPU-only call, skipped there).

veRL 0.9.1 has no CPU platform; the tests give it one through its own platform plugin API
(``dualkv.integrations.verl.use_cpu_platform``), with gloo as the process group backend.
"""

from __future__ import annotations

import functools
import os
import random
from typing import Any

import pytest
import torch

verl = pytest.importorskip("verl", reason="veRL is not installed here (scripts/setup_verl_env.sh)")


from tensordict import TensorDict  # noqa: E402
from verl.trainer.config import CheckpointConfig  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.config import (  # noqa: E402
    FSDPActorConfig,
    FSDPEngineConfig,
    FSDPOptimizerConfig,
    HFModelConfig,
)
from verl.workers.engine import EngineRegistry  # noqa: E402
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding  # noqa: E402

from dualkv.integrations.verl import (  # noqa: E402
    DualKVFSDPEngineWithLMHead,
    DualKVVerlError,
    partition_groups,
    prompt_groups,
    use_cpu_platform,
)
from dualkv.packing import pack_rows, rows_from_lists  # noqa: E402
from dualkv.tree_packing import pack_rows_tree, tree_saves  # noqa: E402
from gloo_ranks import free_port, spawn_ranks  # noqa: E402
from multi_turn_rows import agent_rows, grpo_groups_and_one_branching  # noqa: E402

use_cpu_platform()

VOCAB = 131


@pytest.fixture(scope="module", autouse=True)
def process_group():
    if not torch.distributed.is_initialized():
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(free_port())
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
        yield
        torch.distributed.destroy_process_group()
    else:
        yield


def _save_model(family: str, path: str, seed: int) -> None:
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_hidden_layers=2, max_position_embeddings=512, rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )  # fmt: skip
    if family == "qwen3":
        config = Qwen3Config(intermediate_size=96, **common)
    else:
        config = Qwen3MoeConfig(
            intermediate_size=96, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
            decoder_sparse_step=1, norm_topk_prob=True, **common,
        )  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08 if "embed" not in name else 0.5)
            else:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    dirs = {}
    for i, family in enumerate(("qwen3", "qwen3_moe")):
        path = str(tmp_path_factory.mktemp(family))
        _save_model(family, path, seed=1234 + i)
        dirs[family] = path
    return dirs


def _engine(
    cls: type,
    path: str,
    attn: str,
    strategy: str = "fsdp2",
    remove_padding: bool = True,
    grad_ckpt: bool = True,
    dynamic: bool = True,
    max_tokens: int = 96,
    micro_batch: int = 4,
    lr: float = 1.0,
    **engine_kw: Any,
) -> Any:
    model_config = HFModelConfig(
        path=path,
        load_tokenizer=False,
        override_config={"attn_implementation": attn},
        use_remove_padding=remove_padding,
        enable_gradient_checkpointing=grad_ckpt,
    )
    engine_config = FSDPEngineConfig(
        strategy=strategy,
        mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
        use_torch_compile=False,
        use_dynamic_bsz=dynamic,
        max_token_len_per_gpu=max_tokens,
        infer_max_token_len_per_gpu=max_tokens,
        micro_batch_size_per_gpu=micro_batch,
        infer_micro_batch_size_per_gpu=micro_batch,
        **engine_kw,
    )
    engine_config.use_remove_padding = remove_padding
    optim = FSDPOptimizerConfig(
        optimizer="SGD", lr=lr, weight_decay=0.0, total_training_steps=4, clip_grad=1e9
    )
    engine = cls(model_config, engine_config, optim, CheckpointConfig())
    engine.initialize()
    return engine


def _batch(rng: random.Random, groups: int, n_range=(2, 5), p_range=(3, 14), r_range=(1, 12)):
    """veRL's padded rollout batch (shuffled rows, random pad ids), before no-padding."""
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(*p_range))] for _ in range(groups)]
    responses = [
        [
            [rng.randrange(VOCAB) for _ in range(rng.randint(*r_range))]
            for _ in range(rng.randint(*n_range))
        ]
        for _ in range(groups)
    ]
    # a singleton group and one with a single-token response
    prompts.append([rng.randrange(VOCAB) for _ in range(5)])
    responses.append([[rng.randrange(VOCAB)]])
    ids, mask, pw, gid = rows_from_lists(prompts, responses)
    perm = list(range(ids.shape[0]))
    rng.shuffle(perm)
    ids, mask, gid = ids[perm], mask[perm], gid[perm]
    ids = torch.where(mask.bool(), ids, torch.randint(0, VOCAB, ids.shape))
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    response_mask = mask[:, pw:].clone()
    b, rw = response_mask.shape
    td = TensorDict(
        {
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": position_ids,
            "prompts": ids[:, :pw].clone(),
            "responses": ids[:, pw:].clone(),
            "response_mask": response_mask,
            "advantages": torch.randn(b, 1).expand(b, rw) * response_mask,
        },
        batch_size=[b],
    )
    return td, gid


def _prepare(td: TensorDict, **meta: Any) -> TensorDict:
    data = left_right_2_no_padding(td.clone())
    tu.assign_non_tensor(data, **meta)
    return data


def _infer(engine: Any, td: TensorDict, temperature: float = 1.0, **meta: Any):
    cfg = engine.engine_config
    data = _prepare(
        td, temperature=temperature, calculate_entropy=True, compute_loss=False,
        use_remove_padding=cfg.use_remove_padding, use_dynamic_bsz=cfg.use_dynamic_bsz,
        max_token_len_per_gpu=cfg.infer_max_token_len_per_gpu,
        micro_batch_size_per_gpu=cfg.infer_micro_batch_size_per_gpu, **meta,
    )  # fmt: skip
    with engine.eval_mode():
        out = engine.infer_batch(data, loss_function=None)
    logp = no_padding_2_padding(out["model_output"]["log_probs"], data)
    ent = no_padding_2_padding(out["model_output"]["entropy"], data)
    return logp, ent, out


def _actor_config(strategy: str, dynamic: bool, **kw: Any) -> Any:
    return FSDPActorConfig(
        strategy=strategy, rollout_n=1, use_dynamic_bsz=dynamic, ppo_micro_batch_size_per_gpu=4,
        loss_agg_mode=kw.pop("loss_agg_mode", "token-mean"), **kw,
    )  # fmt: skip


def _grads(engine: Any) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in engine.module.named_parameters():
        g = p.grad
        if g is None:
            continue
        g = g.full_tensor() if hasattr(g, "full_tensor") else g
        out[name.replace("_fsdp_wrapped_module.", "")] = g.detach().clone()
    return out


def _params(engine: Any) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in engine.module.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name.replace("_fsdp_wrapped_module.", "")] = t.detach().clone()
    return out


def _train(
    engine: Any,
    td: TensorDict,
    actor_config: Any,
    temperature: float = 1.0,
    global_batch_size: int | None = None,
):
    cfg = engine.engine_config
    data = _prepare(
        td, temperature=temperature, calculate_entropy=True, compute_loss=True,
        use_remove_padding=cfg.use_remove_padding, use_dynamic_bsz=cfg.use_dynamic_bsz,
        max_token_len_per_gpu=cfg.max_token_len_per_gpu,
        micro_batch_size_per_gpu=cfg.micro_batch_size_per_gpu,
        global_batch_size=td.shape[0] if global_batch_size is None else global_batch_size,
    )  # fmt: skip
    loss_fn = _loss(actor_config)
    with engine.train_mode():
        engine.optimizer_zero_grad()
        out = engine.forward_backward_batch(data, loss_fn, forward_only=False)
        grads = _grads(engine)
        engine.optimizer_step()
    return sum(out["loss"]), grads, _params(engine), out


def _loss(actor_config: Any):
    def loss_fn(model_output, data, dp_group=None):
        return ppo_loss(actor_config, model_output, data, dp_group)

    return loss_fn


def _close(a: torch.Tensor, b: torch.Tensor, what: str, rtol=2e-4, atol=2e-5) -> None:
    assert torch.isfinite(a).all(), what
    err = (a - b).abs().max().item()
    assert torch.allclose(a, b, rtol=rtol, atol=atol), f"{what}: max abs error {err:.3e}"


def _same_step(run: tuple, ref: tuple, what: str = "", start: dict | None = None) -> None:
    """Two updates (what _train returns) agree: loss, every gradient, the parameters after the
    step; with ``start`` (the parameters before), the step moved every parameter."""
    loss, g, p, _ = run
    loss_ref, g_ref, p_ref, _ = ref
    assert abs(loss - loss_ref) <= 1e-5 + 1e-4 * abs(loss_ref), (what, loss, loss_ref)
    assert g_ref.keys() == g.keys() and len(g) > 0, what
    for name in g_ref:
        scale = max(g_ref[name].abs().max().item(), 1.0)
        _close(g[name], g_ref[name], f"{what} grad {name}", rtol=1e-3, atol=2e-5 * scale)
    for name in p_ref:
        _close(p[name], p_ref[name], f"{what} param {name}", rtol=1e-4, atol=1e-5)
    if start is not None:
        moved = [n for n in p if (p[n] - start[n]).abs().max() > 1e-4]
        assert len(moved) == len(p), f"{what}: the step must move every parameter"


def _close_entropy(a: torch.Tensor, b: torch.Tensor, logp: torch.Tensor, what: str) -> None:
    """Entropy lse(z) - sum(p z) cancels two numbers of the logits' size, so its fp32 absolute error
    grows with the logits' spread (shown by the log-probs' size): a peaked tiny model (log-probs of
    -34, entropies of 1e-3) differed from veRL's by 2.3e-5 with every log-prob within 8e-6."""
    _close(a, b, what, atol=2e-5 + 2e-6 * logp.abs().max().item())


CASES = [
    # family, strategy, remove_padding, grad_ckpt, dynamic, temperature, loss_agg_mode
    ("qwen3", "fsdp2", True, True, True, 1.0, "token-mean"),
    ("qwen3", "fsdp2", False, False, False, 0.7, "seq-mean-token-mean"),
    ("qwen3_moe", "fsdp2", True, True, True, 1.0, "token-mean"),
    ("qwen3_moe", "fsdp2", True, False, False, 1.3, "seq-mean-token-sum"),
]


@pytest.mark.parametrize("family,strategy,remove_padding,grad_ckpt,dynamic,temperature,agg", CASES)
def test_engine_matches_verl(
    model_dirs, seed, family, strategy, remove_padding, grad_ckpt, dynamic, temperature, agg
):
    rng = random.Random(seed)
    td, _ = _batch(rng, groups=4)
    # veRL's fixed micro-batches must divide the batch; DualKV's hold whole groups of <= mbs rows
    mbs = max(d for d in range(1, 6) if td.shape[0] % d == 0)
    kw = dict(strategy=strategy, remove_padding=remove_padding, grad_ckpt=grad_ckpt,
              dynamic=dynamic, max_tokens=80, micro_batch=mbs)  # fmt: skip
    ref = _engine(FSDPEngineWithLMHead, model_dirs[family], "sdpa", **kw)
    dkv = _engine(DualKVFSDPEngineWithLMHead, model_dirs[family], "dualkv", **kw)
    assert dkv.dualkv and not getattr(ref, "dualkv", False)

    # compute_log_prob: log-probs and entropy in veRL's layout
    logp_ref, ent_ref, _ = _infer(ref, td, temperature)
    logp, ent, out = _infer(dkv, td, temperature)
    lens = td["attention_mask"].sum(1)
    assert [t.numel() for t in out["model_output"]["log_probs"].unbind()] == lens.tolist()
    mask = td["response_mask"].bool()
    assert mask.sum() > 0
    _close(logp * mask, logp_ref * mask, "log_probs")
    _close_entropy(ent * mask, ent_ref * mask, logp_ref * mask, "entropy")

    # the policy update: old log-probs near the current ones, so some ratios clip and some not
    td["old_log_probs"] = (logp_ref + 0.15 * torch.randn_like(logp_ref)) * mask
    actor = _actor_config(strategy, dynamic, loss_agg_mode=agg, clip_ratio=0.1)
    p_start = _params(ref)
    ref_run = _train(ref, td, actor, temperature)
    run = _train(dkv, td, _actor_config(strategy, dynamic, loss_agg_mode=agg, clip_ratio=0.1),
                 temperature)  # fmt: skip
    _same_step(run, ref_run, start=p_start)


def test_micro_batches_hold_whole_groups(model_dirs, seed):
    rng = random.Random(seed)
    # every multi-row group: N(P+R) >= 4 * 31 > budget, while P + sum R <= 40 + 5 * 8 <= budget
    td, gid = _batch(rng, groups=7, n_range=(4, 5), p_range=(30, 40), r_range=(1, 8))
    budget = 100
    dkv = _engine(DualKVFSDPEngineWithLMHead, model_dirs["qwen3"], "dualkv", max_tokens=budget)
    data = _prepare(td, use_dynamic_bsz=True, max_token_len_per_gpu=budget, temperature=1.0)
    group, plen, rlen = prompt_groups(td["prompts"], td["attention_mask"])
    # groups are exactly the rows' prompt groups (they were built from distinct random prompts)
    pairs = set(zip(group.tolist(), gid.tolist(), strict=True))
    assert len(pairs) == len(set(gid.tolist())) == len(set(group.tolist()))
    micro, indices = dkv.prepare_dualkv_micro_batches(data)
    assert len(micro) > 1
    seen = sorted(i for idx in indices for i in idx)
    assert seen == list(range(td.shape[0]))
    for idx, mb in zip(indices, micro, strict=True):
        assert mb.shape[0] == len(idx)
        assert torch.equal(mb["prompts"], td["prompts"][idx])
        members = set(group[idx].tolist())
        for g in members:  # whole groups only
            assert set((group == g).nonzero().flatten().tolist()) <= set(idx)
        packed = sum(int(plen[(group == g).nonzero()[0]]) + int(rlen[group == g].sum())
                     for g in members)  # fmt: skip
        assert packed <= budget
        if len(idx) > 1:  # the budget counted packed tokens, not the rows' N(P+R)
            assert int((plen[idx] + rlen[idx]).sum()) > budget

    # a group larger than the budget is refused, naming the setting
    small = _prepare(td, use_dynamic_bsz=True, max_token_len_per_gpu=30, temperature=1.0)
    with pytest.raises(DualKVVerlError, match="max_token_len_per_gpu"):
        dkv.prepare_dualkv_micro_batches(small)

    # fixed micro-batch size: whole groups of at most micro_batch_size_per_gpu rows (a larger
    # group alone)
    fixed = _prepare(td, use_dynamic_bsz=False, micro_batch_size_per_gpu=6, temperature=1.0)
    micro, indices = dkv.prepare_dualkv_micro_batches(fixed)
    for idx in indices:
        members = set(group[idx].tolist())
        assert sum(int((group == g).sum()) for g in members) == len(idx)
        assert len(idx) <= 6 or len(members) == 1


def _dp_rank(rank: int, world: int, groups: list[int], out_dir: str) -> None:
    """One data-parallel rank: micro-batch its own batch with the engine's method."""
    import types

    td, _ = _batch(random.Random(100 + rank), groups=groups[rank], n_range=(2, 4))
    data = _prepare(td, use_dynamic_bsz=True, max_token_len_per_gpu=60, temperature=1.0)
    # the method needs only the data-parallel group of its engine
    engine = types.SimpleNamespace(get_data_parallel_group=lambda: torch.distributed.group.WORLD)
    micro, indices = DualKVFSDPEngineWithLMHead.prepare_dualkv_micro_batches(engine, data)
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        f.write(f"{len(micro)} {sum(len(i) for i in indices)} {td.shape[0]}")


def test_micro_batch_count_agrees_across_dp_ranks(tmp_path):
    """Ranks with different batches run the same number of micro-batches (FSDP needs it)."""
    groups = [2, 6]
    spawn_ranks(_dp_rank, 2, groups, str(tmp_path))
    counts = []
    for rank in range(2):
        n, rows, total = (int(x) for x in (tmp_path / f"rank{rank}.txt").read_text().split())
        assert rows == total
        counts.append(n)
    assert counts[0] == counts[1] > 1


def test_partition_groups():
    # longest first onto the lightest bin: 5 -> A, 4 -> B, 3 -> B (4 < 5), 3 -> A (5 < 7)
    assert partition_groups([5, 4, 3, 3], budget=8, num_bins=2, allow_oversized=False) == [
        [0, 3],
        [1, 2],
    ]
    assert partition_groups([5, 4, 3, 3], budget=7, num_bins=2, allow_oversized=False) is None
    assert partition_groups([9, 1], budget=8, num_bins=2, allow_oversized=False) is None
    assert partition_groups([9, 1], budget=8, num_bins=2, allow_oversized=True) == [[0], [1]]
    assert partition_groups([1, 1], budget=8, num_bins=3, allow_oversized=False) is None


def test_registry_and_switch(model_dirs):
    # veRL's registry hands out the DualKV engine for its fsdp/fsdp2 language-model strategies
    assert EngineRegistry.get_engine_cls("language_model", "fsdp2") is DualKVFSDPEngineWithLMHead
    assert EngineRegistry.get_engine_cls("language_model", "fsdp") is DualKVFSDPEngineWithLMHead
    # as veRL's TrainingWorker builds it (keywords), with the switch on
    on = EngineRegistry.new(
        model_type="language_model",
        backend="fsdp2",
        model_config=HFModelConfig(
            path=model_dirs["qwen3"], load_tokenizer=False,
            override_config={"attn_implementation": "dualkv"},
        ),
        engine_config=FSDPEngineConfig(strategy="fsdp2", use_torch_compile=False),
        optimizer_config=FSDPOptimizerConfig(lr=1e-3, total_training_steps=1),
        checkpoint_config=CheckpointConfig(),
    )  # fmt: skip
    assert type(on) is DualKVFSDPEngineWithLMHead and on.dualkv
    # without the switch it is veRL's engine: the rows path, no packing
    plain = _engine(DualKVFSDPEngineWithLMHead, model_dirs["qwen3"], "sdpa")
    assert not plain.dualkv
    ref = _engine(FSDPEngineWithLMHead, model_dirs["qwen3"], "sdpa")
    td, _ = _batch(random.Random(7), groups=2)
    a, _, _ = _infer(plain, td)
    b, _, _ = _infer(ref, td)
    assert torch.equal(a, b)


def test_plugin_entry_point():
    """A fresh ``import verl`` loads dualkv's plugin: veRL's registry hands out DualKV's engine."""
    import subprocess
    import sys

    code = (
        "import verl\n"
        "from verl.workers.engine import EngineRegistry\n"
        "print(EngineRegistry.get_engine_cls('language_model', 'fsdp2').__name__)\n"
    )
    env = dict(os.environ, VERL_PLATFORM="nvidia", PYTHONWARNINGS="ignore")
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "DualKVFSDPEngineWithLMHead"


def test_unsupported_settings_raise(model_dirs, seed):
    path = model_dirs["qwen3"]
    with pytest.raises(DualKVVerlError, match="pad_to_length"):
        _engine(DualKVFSDPEngineWithLMHead, path, "dualkv", pad_to_length=True)
    dkv = _engine(DualKVFSDPEngineWithLMHead, path, "dualkv")
    td, _ = _batch(random.Random(seed), groups=2)
    temps = torch.linspace(0.5, 1.5, td.shape[0])
    with pytest.raises(DualKVVerlError, match="temperature"):
        _infer(dkv, td, temperature=temps)
    with pytest.raises(DualKVVerlError, match="calculate_sum_pi_squared"):
        _infer(dkv, td, calculate_sum_pi_squared=True)


@pytest.mark.parametrize("mode", ["geo_mean", "kl_cov", "clip_cov", "bypass_mode"])
def test_micro_batch_dependent_losses_raise(model_dirs, seed, mode):
    """Losses veRL normalises per micro-batch would change with DualKV's whole-group
    micro-batches (geo_mean: the gradient scaled by 0.5-1.5): refused, with the loss veRL's
    workers build (partial(ppo_loss, config=...))."""
    dkv = _engine(DualKVFSDPEngineWithLMHead, model_dirs["qwen3"], "dualkv")
    td, _ = _batch(random.Random(seed), groups=2)
    td["old_log_probs"] = torch.zeros(td["response_mask"].shape)
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.workers.config.actor import PolicyLossConfig

    correction = RolloutCorrectionConfig(rollout_is_batch_normalize=mode == "bypass_mode")
    policy = PolicyLossConfig(loss_mode=mode, rollout_correction=correction)
    actor = _actor_config("fsdp2", False, policy_loss=policy)
    data = _prepare(td, temperature=1.0, calculate_entropy=True, compute_loss=True,
                    global_batch_size=td.shape[0])  # fmt: skip
    with dkv.train_mode(), pytest.raises(DualKVVerlError, match=mode):
        dkv.forward_backward_batch(data, functools.partial(ppo_loss, config=actor), False)


# --- multi-turn agent rows: prefix trees ---------------------------------------------------------
def _agent_batch(rng: random.Random, tasks: int = 3, rollouts: int = 1) -> TensorDict:
    """veRL's padded batch of multi-turn rows (tests/python/multi_turn_rows.py): agent-loop rows
    whose responses hold tool outputs (response_mask 0 there, as veRL's agent loop sets it) and
    per-turn rows that share earlier turns, every task behind one system prompt; shuffled."""
    rows = agent_rows(rng, VOCAB, tasks=tasks, rollouts=rollouts)
    rng.shuffle(rows)
    ids, mask, pw, _ = rows_from_lists([r.prompt for r in rows], [[r.response] for r in rows])
    scored = torch.zeros(ids.shape[0], ids.shape[1] - pw, dtype=mask.dtype)
    for b, r in enumerate(rows):
        scored[b, : len(r.scored)] = torch.tensor(r.scored)
    return _padded_batch(ids, mask, pw, scored)


def _padded_batch(
    ids: torch.Tensor, mask: torch.Tensor, pw: int, scored: torch.Tensor | None = None
) -> TensorDict:
    """veRL's padded batch of these rows: random pad ids, veRL's position ids, the response mask
    times ``scored`` (0 on tool outputs, as veRL's agent loop sets it), random advantages."""
    ids = torch.where(mask.bool(), ids, torch.randint(0, VOCAB, ids.shape))
    response_mask = mask[:, pw:] * (1 if scored is None else scored)
    b, rw = response_mask.shape
    return TensorDict(
        {
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            "prompts": ids[:, :pw].clone(),
            "responses": ids[:, pw:].clone(),
            "response_mask": response_mask,
            "advantages": torch.randn(b, 1).expand(b, rw) * response_mask,
        },
        batch_size=[b],
    )


def _rows_of(micro_batch: Any) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """A no-padding micro-batch's rows in veRL's padded layout (read back from its mask)."""
    mask = micro_batch["attention_mask"]
    real = mask.bool()
    ids = torch.zeros(mask.shape, dtype=torch.int64)
    ids[real] = micro_batch["input_ids"].values()
    pos = torch.zeros(mask.shape, dtype=torch.int64)
    pos[real] = micro_batch["position_ids"].values()
    return ids, mask, micro_batch["prompts"].shape[1], pos


def _capture_packing(engine: Any) -> list[tuple[Any, int]]:
    """Record every packed micro-batch the engine runs: (PackedBatch, its depth-two tokens)."""
    seen: list[tuple[Any, int]] = []
    prepare = engine.prepare_model_inputs

    def wrapped(micro_batch: Any) -> Any:
        inputs, args = prepare(micro_batch)
        ids, mask, pw, pos = _rows_of(micro_batch)
        seen.append(
            (args["dualkv_packed"], pack_rows(ids, mask, pw, position_ids=pos).total_tokens)
        )
        return inputs, args

    engine.prepare_model_inputs = wrapped
    return seen


def _tree_budget(td: TensorDict) -> int:
    """About half the batch's prefix tree (several micro-batches), at least any prompt group's
    depth-two tokens (every group fits)."""
    ids, mask, pw = td["input_ids"], td["attention_mask"], td["prompts"].shape[1]
    pos = td["position_ids"]
    tree = pack_rows_tree(ids, mask, pw, pos).total_tokens
    group, plen, rlen = prompt_groups(td["prompts"], mask)
    largest = max(
        int(plen[group == g][0]) + int(rlen[group == g].sum()) for g in range(int(group.max()) + 1)
    )
    return max(tree // 2 + 1, largest)


AGENT_CASES = [
    # family, dynamic batch size, loss_agg_mode, gradient checkpointing
    ("qwen3", True, "token-mean", True),
    ("qwen3_moe", False, "seq-mean-token-mean", False),
]


@pytest.mark.parametrize("family,dynamic,agg,grad_ckpt", AGENT_CASES)
def test_multi_turn_trees_match_verl(model_dirs, seed, family, dynamic, agg, grad_ckpt):
    """Multi-turn agent rows (tool outputs masked out of the loss, per-turn rows sharing earlier
    turns, tasks sharing a system prompt): the engine packs each micro-batch as a prefix tree
    (fewer tokens than prompt groups, within the packed-token budget) and gives veRL's own
    engine's log-probs and entropy on every response token, its loss, gradients and step."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    td = _agent_batch(rng)
    b = td.shape[0]
    budget = _tree_budget(td)
    rows_per_task = b // 3  # fixed micro-batch size: one task per micro-batch (veRL: b % mbs == 0)
    kw = dict(grad_ckpt=grad_ckpt, dynamic=dynamic, max_tokens=budget, micro_batch=rows_per_task)
    ref = _engine(FSDPEngineWithLMHead, model_dirs[family], "sdpa", **kw)
    dkv = _engine(DualKVFSDPEngineWithLMHead, model_dirs[family], "dualkv", **kw)
    seen = _capture_packing(dkv)

    logp_ref, ent_ref, _ = _infer(ref, td)
    logp, ent, out = _infer(dkv, td)
    lens = td["attention_mask"].sum(1)
    assert [t.numel() for t in out["model_output"]["log_probs"].unbind()] == lens.tolist()
    pw = td["prompts"].shape[1]
    real = td["attention_mask"][:, pw:].bool()  # every response token, tool outputs included
    scored = td["response_mask"].bool()
    assert real.sum() > scored.sum() > 0
    _close(logp * real, logp_ref * real, "log_probs")
    _close_entropy(ent * real, ent_ref * real, logp_ref * real, "entropy")

    td["old_log_probs"] = (logp_ref + 0.15 * torch.randn_like(logp_ref)) * scored
    actor = _actor_config("fsdp2", dynamic, loss_agg_mode=agg, clip_ratio=0.1)
    p_start = _params(ref)
    ref_run = _train(ref, td, actor)
    run = _train(dkv, td, _actor_config("fsdp2", dynamic, loss_agg_mode=agg, clip_ratio=0.1))
    _same_step(run, ref_run, start=p_start)

    # the prefix tree ran, on several micro-batches (log-probs, then the update), each within the
    # budget in its packed tokens and clearly fewer than the prompt-group packing's
    assert len(seen) >= 4
    for packed, depth_two in seen:
        assert packed.layout.is_tree
        assert packed.total_tokens <= 0.9 * depth_two
        if dynamic:
            assert packed.total_tokens <= budget
        else:
            assert packed.num_rows <= rows_per_task


def test_packing_setting(model_dirs, seed, monkeypatch):
    """DUALKV_VERL_PACKING forces either packing (both exact); bad values and a forced tree with
    Ulysses are refused at init, naming the setting."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    path = model_dirs["qwen3"]
    agent = _agent_batch(rng, tasks=2)
    plain, _ = _batch(rng, groups=3)
    ref = _engine(FSDPEngineWithLMHead, path, "sdpa", max_tokens=2000)
    for mode, td, tree in (("groups", agent, False), ("tree", plain, True), ("", agent, True)):
        monkeypatch.setenv("DUALKV_VERL_PACKING", mode)
        dkv = _engine(DualKVFSDPEngineWithLMHead, path, "dualkv", max_tokens=2000)
        seen = _capture_packing(dkv)
        logp, ent, _ = _infer(dkv, td)
        logp_ref, ent_ref, _ = _infer(ref, td)
        real = td["attention_mask"][:, td["prompts"].shape[1] :].bool()
        _close(logp * real, logp_ref * real, f"{mode}: log_probs")
        _close_entropy(ent * real, ent_ref * real, logp_ref * real, f"{mode}: entropy")
        assert seen and all(packed.layout.is_tree == tree for packed, _ in seen), mode
    # an ordinary GRPO batch stays on the prompt-group packing by default
    monkeypatch.delenv("DUALKV_VERL_PACKING")
    dkv = _engine(DualKVFSDPEngineWithLMHead, path, "dualkv", max_tokens=2000)
    seen = _capture_packing(dkv)
    _infer(dkv, plain)
    assert seen and not any(packed.layout.is_tree for packed, _ in seen)

    monkeypatch.setenv("DUALKV_VERL_PACKING", "trees")
    with pytest.raises(DualKVVerlError, match="DUALKV_VERL_PACKING='trees'"):
        _engine(DualKVFSDPEngineWithLMHead, path, "dualkv")


def test_group_that_fits_only_as_a_tree_runs(model_dirs, seed, monkeypatch):
    """An ordinary GRPO batch (under 10% saved as a tree: the depth-two packing's batch) with one
    group of branching rollouts (responses sharing 40 tokens) over max_token_len_per_gpu as
    prompt groups but within it as a tree: the engine runs it (that group's micro-batch a tree,
    every micro-batch within the budget), exact against veRL's engine; with
    DUALKV_VERL_PACKING=groups it is refused, naming the budget and the group."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    prompts, responses, branching = grpo_groups_and_one_branching(rng, VOCAB)
    ids, mask, pw, gid = rows_from_lists(prompts, responses)
    perm = torch.randperm(ids.shape[0])
    ids, mask, gid = ids[perm], mask[perm], gid[perm]
    td = _padded_batch(ids, mask, pw)
    pos = td["position_ids"]
    assert not tree_saves(pack_rows(ids, mask, pw).total_tokens,
                          pack_rows_tree(ids, mask, pw, pos).total_tokens)  # fmt: skip
    flat, tree = [], []
    for g in range(len(prompts)):
        idx = (gid == g).nonzero().flatten()
        flat.append(pack_rows(ids[idx], mask[idx], pw).total_tokens)
        tree.append(pack_rows_tree(ids[idx], mask[idx], pw, pos[idx]).total_tokens)
    budget = max(tree[branching], max(f for g, f in enumerate(flat) if g != branching))
    assert tree[branching] <= budget < flat[branching]
    branch_rows = set((gid == branching).nonzero().flatten().tolist())

    kw = dict(max_tokens=budget)
    ref = _engine(FSDPEngineWithLMHead, model_dirs["qwen3"], "sdpa", **kw)
    dkv = _engine(DualKVFSDPEngineWithLMHead, model_dirs["qwen3"], "dualkv", **kw)
    data = _prepare(td, use_dynamic_bsz=True, max_token_len_per_gpu=budget, temperature=1.0)
    micro, indices = dkv.prepare_dualkv_micro_batches(data)
    assert sorted(i for idx in indices for i in idx) == list(range(td.shape[0]))
    for mb, idx in zip(micro, indices, strict=True):
        packed = tu.get_non_tensor_data(data=mb, key="dualkv_packed_tokens", default=None)
        assert packed <= budget
        if branch_rows & set(idx):
            assert branch_rows <= set(idx)
            assert tu.get_non_tensor_data(data=mb, key="dualkv_tree", default=None)
    seen = _capture_packing(dkv)
    logp_ref, ent_ref, _ = _infer(ref, td)
    logp, ent, _ = _infer(dkv, td)
    real = td["response_mask"].bool()
    _close(logp * real, logp_ref * real, "log_probs")
    _close_entropy(ent * real, ent_ref * real, logp_ref * real, "entropy")
    td["old_log_probs"] = (logp_ref + 0.15 * torch.randn_like(logp_ref)) * real
    p_start = _params(ref)
    ref_run = _train(ref, td, _actor_config("fsdp2", True, clip_ratio=0.1))
    run = _train(dkv, td, _actor_config("fsdp2", True, clip_ratio=0.1))
    _same_step(run, ref_run, start=p_start)
    assert seen and all(packed.total_tokens <= budget for packed, _ in seen)
    assert any(packed.layout.is_tree for packed, _ in seen)
    # a budget under every packing of some group: refused with the fewer tokens it could pack to
    small = _prepare(td, use_dynamic_bsz=True, max_token_len_per_gpu=budget - 1, temperature=1.0)
    with pytest.raises(DualKVVerlError, match=rf"packs to {budget} tokens \(the fewer of its"):
        dkv.prepare_dualkv_micro_batches(small)

    monkeypatch.setenv("DUALKV_VERL_PACKING", "groups")
    groups_only = _engine(DualKVFSDPEngineWithLMHead, model_dirs["qwen3"], "dualkv", **kw)
    shown = ", ".join(map(str, sorted(branch_rows)))
    want = (
        rf"the prompt group of rows \[{shown}\] \(4 responses to a 70-token prompt; as a prefix "
        rf"tree it packs to {tree[branching]} tokens.*packs to {flat[branching]} tokens.*"
        rf"max_token_len_per_gpu={budget}"
    )
    with pytest.raises(DualKVVerlError, match=want):
        groups_only.prepare_dualkv_micro_batches(data)


def _tree_dp_rank(rank: int, world: int, out_dir: str) -> None:
    """One data-parallel rank: rank 0 an ordinary GRPO batch, rank 1 multi-turn rows."""
    import types

    rng = random.Random(200 + rank)
    td = _batch(rng, groups=6)[0] if rank == 0 else _agent_batch(rng, tasks=3)
    budget = 700
    data = _prepare(td, use_dynamic_bsz=True, max_token_len_per_gpu=budget, temperature=1.0)
    engine = types.SimpleNamespace(get_data_parallel_group=lambda: torch.distributed.group.WORLD)
    micro, indices = DualKVFSDPEngineWithLMHead.prepare_dualkv_micro_batches(engine, data)
    tokens = []
    for mb in micro:
        ids, mask, pw, pos = _rows_of(mb)
        tree = tu.get_non_tensor_data(data=mb, key="dualkv_tree", default=None)
        pack = pack_rows_tree if tree else pack_rows
        tokens.append(pack(ids, mask, pw, position_ids=pos).total_tokens)
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        f.write(f"{len(micro)} {sum(len(i) for i in indices)} {td.shape[0]} {max(tokens)}")


def test_tree_micro_batch_count_agrees_across_dp_ranks(tmp_path):
    """Ranks with an ordinary and a multi-turn batch cut as many micro-batches (every row once,
    each micro-batch within the budget in the tokens of its own packing)."""
    spawn_ranks(_tree_dp_rank, 2, str(tmp_path))
    counts = []
    for rank in range(2):
        n, rows, total, largest = (
            int(x) for x in (tmp_path / f"rank{rank}.txt").read_text().split()
        )
        assert rows == total and largest <= 700
        counts.append(n)
    assert counts[0] == counts[1] > 1


# --- Ulysses sequence parallelism: 2 processes on gloo ----------------------------------------
SP_CASES = [
    # kv heads, tied embeddings, dynamic batch size, gradient checkpointing, temperature, loss
    dict(hkv=2, tied=True, dynamic=True, grad_ckpt=True, temperature=1.0, agg="token-mean"),
    dict(hkv=1, tied=False, dynamic=False, grad_ckpt=False, temperature=0.7,
         agg="seq-mean-token-mean"),
]  # fmt: skip


SP_BUDGET = 64  # max_token_len_per_gpu: sp=1 micro-batches of <= 64 packed tokens, sp=2 <= 128


def _sp_batch(seed: int) -> TensorDict:
    """A batch whose packed stream has an odd length of more than one sp=1 budget and at most one
    sp=2 budget: with dynamic batch size the sp=2 engine runs it as one micro-batch whose second
    shard ends in a pad token, the sp=1 engines as several."""
    for attempt in range(100):
        td, _ = _batch(random.Random(seed + attempt), groups=3, n_range=(2, 4))
        group, plen, rlen = prompt_groups(td["prompts"], td["attention_mask"])
        firsts = [int((group == g).nonzero()[0]) for g in range(int(group.max()) + 1)]
        total = int(plen[firsts].sum()) + int(rlen.sum())
        if total % 2 == 1 and SP_BUDGET < total <= 2 * SP_BUDGET:
            return td
    raise AssertionError("no odd-length batch drawn")


def _sp_rank(rank: int, world: int, dirs: list[str], seed: int) -> None:
    """One rank of a 2-process group: DualKV with ulysses_sequence_parallel_size=2 (dp=1) against
    DualKV and veRL's own SDPA engine with sp=1 (dp=2, both ranks holding the same batch, so
    veRL's data-parallel mean is the single batch's gradient)."""
    for path, case in zip(dirs, SP_CASES, strict=True):
        torch.manual_seed(seed)  # the batch's pad ids and advantages: the same on both ranks
        td = _sp_batch(seed)
        b = td.shape[0]
        mbs = max(d for d in range(1, 6) if b % d == 0)
        kw = dict(grad_ckpt=case["grad_ckpt"], dynamic=case["dynamic"], max_tokens=SP_BUDGET,
                  micro_batch=mbs)  # fmt: skip
        sp = _engine(DualKVFSDPEngineWithLMHead, path, "dualkv",
                     ulysses_sequence_parallel_size=2, **kw)  # fmt: skip
        one = _engine(DualKVFSDPEngineWithLMHead, path, "dualkv", **kw)
        ref = _engine(FSDPEngineWithLMHead, path, "sdpa", **kw)
        assert sp.dualkv and sp.get_data_parallel_size() == 1
        assert one.get_data_parallel_size() == 2
        what = f"rank {rank} case {case}"
        if case["dynamic"]:  # one micro-batch of an odd length (see _sp_batch)
            data = _prepare(td, use_dynamic_bsz=True, max_token_len_per_gpu=SP_BUDGET)
            assert len(sp.prepare_dualkv_micro_batches(data)[0]) == 1
            assert len(one.prepare_dualkv_micro_batches(data)[0]) > 1

        t = case["temperature"]
        logp_sp, ent_sp, out = _infer(sp, td, t)
        logp_one, ent_one, _ = _infer(one, td, t)
        logp_ref, ent_ref, _ = _infer(ref, td, t)
        lens = td["attention_mask"].sum(1)
        assert [x.numel() for x in out["model_output"]["log_probs"].unbind()] == lens.tolist()
        mask = td["response_mask"].bool()
        _close(logp_sp * mask, logp_one * mask, f"{what}: log_probs")
        _close(logp_sp * mask, logp_ref * mask, f"{what}: log_probs (veRL)")
        _close_entropy(ent_sp * mask, ent_one * mask, logp_one * mask, f"{what}: entropy")
        _close_entropy(ent_sp * mask, ent_ref * mask, logp_ref * mask,
                       f"{what}: entropy (veRL)")  # fmt: skip

        td["old_log_probs"] = (logp_ref + 0.15 * torch.randn_like(logp_ref)) * mask
        torch.distributed.broadcast(td["old_log_probs"], src=0)  # the same batch on both
        # (an entropy bonus: its gradient also crosses the ranks' log-prob sum)
        actor = _actor_config("fsdp2", case["dynamic"], loss_agg_mode=case["agg"],
                              clip_ratio=0.1, entropy_coeff=0.05)  # fmt: skip
        p_start = _params(sp)
        runs = {
            "sp": _train(sp, td, actor, t, global_batch_size=b),
            "one": _train(one, td, actor, t, global_batch_size=2 * b),
            "veRL": _train(ref, td, actor, t, global_batch_size=2 * b),
        }
        assert len(runs["sp"][1]) == len(runs["sp"][2])
        for other in ("one", "veRL"):
            _same_step(runs["sp"], runs[other], f"{what} vs {other}:", start=p_start)

    # ranks of one sp group given different rows: refused on every rank, not sharded as one
    other = _sp_batch(seed + 1000 * (rank + 1))
    data = _prepare(other, use_dynamic_bsz=True, max_token_len_per_gpu=SP_BUDGET)
    with pytest.raises(DualKVVerlError, match="different batches"):
        sp.prepare_dualkv_micro_batches(data)


def test_ulysses_sequence_parallel_matches_sp1(tmp_path, seed):
    """ulysses_sequence_parallel_size=2 on 2 gloo processes: log-probs, entropy (veRL's layout),
    loss, every gradient and the parameters after one step equal the sp=1 engines'."""
    from hf_helpers import tiny_config, tiny_model

    dirs = []
    for i, case in enumerate(SP_CASES):
        config = tiny_config("qwen3")
        config.num_key_value_heads = case["hkv"]
        config.tie_word_embeddings = case["tied"]
        path = str(tmp_path / f"qwen3_{i}")
        tiny_model("qwen3", torch.float32, seed=seed % 1000 + i, config=config).save_pretrained(
            path
        )
        dirs.append(path)
    spawn_ranks(_sp_rank, 2, dirs, seed)


def _sp_guard_rank(rank: int, world: int, path: str, seed: int) -> None:
    torch.manual_seed(seed)  # the same batch on both ranks
    td, _ = _batch(random.Random(seed), groups=2, p_range=(8, 12), r_range=(4, 8))
    kw = dict(grad_ckpt=False, dynamic=True, max_tokens=200, micro_batch=2)
    for sp in (1, 2):
        engine = _engine(DualKVFSDPEngineWithLMHead, path, "dualkv",
                         ulysses_sequence_parallel_size=sp, **kw)  # fmt: skip
        with pytest.raises(NotImplementedError, match="'dynamic' RoPE scaling"):
            _infer(engine, td)


def test_ulysses_runs_the_packed_model_guards(tmp_path, seed):
    """The Ulysses path runs the guards of every packed forward (here: a 'dynamic' RoPE whose
    frequencies follow the batch's largest position, past its threshold). They were skipped with
    ulysses_sequence_parallel_size=2: sp=1 refused the batch, sp=2 ran it, log-probs 0.016 off
    veRL's own engine on the same batch."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_hidden_layers=2, intermediate_size=96, max_position_embeddings=12,
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    )  # fmt: skip
    torch.manual_seed(seed % 1000)
    path = str(tmp_path / "qwen3_dynamic_rope")
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    spawn_ranks(_sp_guard_rank, 2, path, seed)


def _sp_tree_rank(rank: int, world: int, path: str, seed: int) -> None:
    torch.manual_seed(seed)  # the same batch on both ranks
    td = _agent_batch(random.Random(seed), tasks=2)
    kw = dict(grad_ckpt=False, dynamic=True, max_tokens=2000, micro_batch=4)
    sp = _engine(DualKVFSDPEngineWithLMHead, path, "dualkv",
                 ulysses_sequence_parallel_size=2, **kw)  # fmt: skip
    one = _engine(DualKVFSDPEngineWithLMHead, path, "dualkv", **kw)
    seen_sp, seen_one = _capture_packing(sp), _capture_packing(one)
    logp_sp, ent_sp, _ = _infer(sp, td)
    logp_one, ent_one, _ = _infer(one, td)
    real = td["attention_mask"][:, td["prompts"].shape[1] :].bool()
    _close(logp_sp * real, logp_one * real, f"rank {rank}: log_probs")
    _close_entropy(ent_sp * real, ent_one * real, logp_one * real, f"rank {rank}: entropy")
    assert seen_one and all(packed.layout.is_tree for packed, _ in seen_one)
    assert seen_sp and all(packed.layout.is_tree for packed, _ in seen_sp)

    mask = td["response_mask"].bool()
    td["old_log_probs"] = (logp_one + 0.15 * torch.randn_like(logp_one)) * mask
    torch.distributed.broadcast(td["old_log_probs"], src=0)  # the same batch on both ranks
    actor = _actor_config("fsdp2", True, loss_agg_mode="token-mean", clip_ratio=0.1,
                          entropy_coeff=0.05)  # fmt: skip
    b = td.shape[0]
    run_sp = _train(sp, td, actor, global_batch_size=b)
    _same_step(run_sp, _train(one, td, actor, global_batch_size=2 * b), f"rank {rank}:")


def test_ulysses_shards_tree_batches(tmp_path, seed):
    """Ulysses shards prefix trees (dualkv.parallel.shard_batch): with sp = 2 a multi-turn batch
    runs as the same trees as with sp = 1, with its log-probs, entropy, loss, gradients and
    parameters after a step."""
    path = str(tmp_path / "qwen3")
    _save_model("qwen3", path, seed % 1000)
    spawn_ranks(_sp_tree_rank, 2, path, seed)


def test_ulysses_heads_must_split(model_dirs):
    """Heads that cannot be split over the sp ranks are refused, naming the setting."""
    with pytest.raises(DualKVVerlError, match="ulysses_sequence_parallel_size=3"):
        _engine(DualKVFSDPEngineWithLMHead, model_dirs["qwen3"], "dualkv",
                ulysses_sequence_parallel_size=3)  # fmt: skip


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_aggregate_is_verls_agg_loss(mode, seed):
    """dualkv.losses.aggregate against veRL's own agg_loss on one rank (a mask with holes and a
    fully masked row, which veRL leaves out of the seq-mean modes)."""
    from verl.trainer.ppo.core_algos import agg_loss

    from dualkv.losses import aggregate

    g = torch.Generator().manual_seed(seed)
    values = torch.randn(5, 7, generator=g, dtype=torch.float64)
    mask = torch.rand(5, 7, generator=g) < 0.6
    mask[0] = True
    mask[2] = False
    want = agg_loss(values, mask.to(values.dtype), mode, batch_num_tokens=int(mask.sum()))
    # (veRL divides a row by its token count + 1e-8: a relative 1e-8 at most)
    torch.testing.assert_close(aggregate(values, mask, mode), want, rtol=1e-7, atol=1e-12)


def _fsdp1_rank(rank: int, world: int, path: str, seed: int) -> None:
    """One rank of FSDP1 with a size-based wrap policy (the LM head an FSDP unit of its own)."""
    import torch.distributed.fsdp._init_utils as init_utils

    # veRL's FSDP1 setup runs sync_module_states, whose check needs a GPU; the CPU test skips
    # only that check (and the CUDA cache flush)
    init_utils._check_module_states_for_sync_module_states = lambda *a, **k: None
    torch.cpu.empty_cache = lambda: None  # type: ignore[attr-defined]
    td, _ = _batch(random.Random(seed + rank), groups=3)
    mask = td["response_mask"].bool()
    wrap = {"wrap_policy": {"min_num_params": 1000}}
    ref = _engine(FSDPEngineWithLMHead, path, "sdpa", strategy="fsdp", **wrap)
    dkv = _engine(DualKVFSDPEngineWithLMHead, path, "dualkv", strategy="fsdp", **wrap)
    assert type(dkv.module.lm_head).__name__ == "FullyShardedDataParallel"
    logp_ref, ent_ref, _ = _infer(ref, td)
    logp, ent, _ = _infer(dkv, td)
    _close(logp * mask, logp_ref * mask, f"rank {rank}: log_probs")
    _close_entropy(ent * mask, ent_ref * mask, logp_ref * mask, f"rank {rank}: entropy")
    torch.manual_seed(seed + rank)
    td["old_log_probs"] = (logp_ref + 0.15 * torch.randn_like(logp_ref)) * mask
    actor = _actor_config("fsdp", True, clip_ratio=0.1)
    gbs = world * td.shape[0]
    loss_r, g_r, _, _ = _train(ref, td, actor, global_batch_size=gbs)
    loss_d, g_d, _, _ = _train(dkv, td, actor, global_batch_size=gbs)
    assert abs(loss_d - loss_r) <= 1e-5 + 1e-4 * abs(loss_r), (loss_d, loss_r)
    assert g_d.keys() == g_r.keys() and g_r
    for name in g_r:
        scale = max(g_r[name].abs().max().item(), 1.0)
        _close(g_d[name], g_r[name], f"rank {rank}: grad {name}", rtol=1e-3, atol=2e-5 * scale)


def test_fsdp1_lm_head_wrapped_alone(tmp_path, seed):
    """FSDP1 (strategy fsdp) with wrap_policy.min_num_params, 2 gloo processes: the packed path
    calls the LM head through its own FSDP1 unit (it called the inner module, installed before
    wrapping: a storage error, or a 2x head gradient with fsdp_size=1)."""
    path = str(tmp_path / "qwen3")
    _save_model("qwen3", path, seed % 1000)
    spawn_ranks(_fsdp1_rank, 2, path, seed)
