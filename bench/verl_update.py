"""veRL's engine update step: DualKV's engine vs veRL's own, same model and data (random weights).

Runs veRL 0.9.1's FSDP2 language-model engine exactly as its trainer's ``update_actor`` does per
mini-batch (``engine.train_batch``: micro-batches, forward, veRL's PPO loss, backward, optimizer
step) on a GRPO mini-batch of G prompt groups, each one prompt of P tokens with N responses of R
tokens, in veRL's no-padding layout. Two engines, built by veRL from the same saved model:

* verl    veRL's FSDPEngineWithLMHead with its defaults: ``flash_attention_2`` and
          ``use_remove_padding=True`` where flash-attn is installed; without flash-attn, SDPA on
          the padded rows (``use_remove_padding=False``: SDPA's flash kernel on [B, L] rows;
          packed SDPA would build a [T, T] mask); dynamic batch size counting N(P+R) row tokens;
* verl with ``--baseline-attn dualkv_rows``: the same engine with ``use_remove_padding=True``
          and a FlashAttention-class causal varlen kernel on the rows (DualKV's kernel with every
          row its own group and no shared prompt: what flash-attn's varlen function computes),
          the stand-in for veRL's flash_attention_2 default on a machine without flash-attn;
          with ``--baseline-logprobs fused`` also a fused log-softmax + gather over all of a
          micro-batch's logits (``torch.nn.functional.cross_entropy``), the stand-in for
          flash-attn's Triton cross-entropy: without flash-attn veRL 0.9.1 computes the
          log-probs with ``logprobs_from_logits_v2``, a Python loop over the logits' rows, which
          in the remove-padding layout is one loop step per token;
* dualkv  dualkv.integrations.verl's engine (``attn_implementation="dualkv"``): packed groups,
          dynamic batch size counting P+NR packed tokens.

``--shapes agentic``: the agentic multi-turn batch of bench/trees.py (issue 33), a group per task
(``--groups`` tasks): a 6K context, trajectories branching in two at turns 1-3 into 8, a 4th turn
each, turns of 300-900 tokens; every turn a training sample, so the rows are each turn's whole
prefix (prompt: everything before the turn, left-padded; response: the turn), 22 rows per task,
rho ~ 9 over the whole tree. DualKV's budgets count a task's packed tree tokens (1, 2, ... tasks
per micro-batch), veRL's the longest row (1, 2, 4, ... rows). The DualKV engine
(dualkv.integrations.verl) packs this batch as prefix trees (its rows share earlier turns: the
tree packs far fewer tokens than prompt groups) in micro-batches of whole tasks (a task's rows
sort next to each other), so each budget holds that many whole trees; DUALKV_VERL_PACKING=groups
measures the depth-two packing of the same rows (prompt groups of sibling turns, two rows each;
its budget of one tree's packed tokens then takes several micro-batches: the table's count).

Both with gradient checkpointing, bf16 mixed precision (fp32 master weights, AdamW). For each
engine the micro-batch budget (``max_token_len_per_gpu``) is raised step by step (responses per
micro-batch: 1, 2, 4, ... rows for verl; 1, 2, ... whole groups for dualkv) until it runs out of
memory or holds the whole mini-batch; per budget: median step time, peak memory, micro-batch
count. Printed as a table and as JSON lines; the loss of the first step of each engine at the
largest common budget is printed side by side (bf16: close, not equal).

    python bench/verl_update.py --device cuda                       # both shapes, 1.7B
    python bench/verl_update.py --device cuda --shapes 16,8192,1024 --groups 2 --steps 3
    python bench/verl_update.py --device cpu --preset tiny --shapes 4,32,8   # smoke run
    python bench/verl_update.py --device cuda --shapes agentic --groups 1 --steps 1 \
        --capacity-max-groups 0 --baseline-attn dualkv_rows --baseline-logprobs fused
    python bench/verl_update.py --device cpu --preset tiny --shapes agentic --groups 1 \
        --tree-scale 0.01 --capacity-max-groups 0 --steps 1 --warmup 0     # its smoke run

Needs veRL 0.9.1 importable next to dualkv (bench/verl_gpu_wheels.sh makes the wheels to carry to
the GPU machine and prints how to unpack them there; bench/RESULTS.md has the runs).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from typing import Any, NamedTuple

import torch
from trees import agentic


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def save_model(preset: str, path: str, device: str, seed: int) -> None:
    from transformers import AutoModelForCausalLM, Qwen3Config

    from dualkv.demos.grpo_step import PRESETS

    cfg = Qwen3Config(max_position_embeddings=40960, rms_norm_eps=1e-6, **PRESETS[preset])
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02 if "embed" not in name else 0.5)
    model.save_pretrained(path)
    del model


class Rows(NamedTuple):
    """A mini-batch's rows as token lists, one row per response, with what the budgets need."""

    prompts: list[list[int]]
    responses: list[list[int]]
    group_tokens: int  # packed tokens of the largest group (P + sum R; a tree: its segments)
    rows_per_group: int
    row_max: int  # tokens of the longest row

    @property
    def tokens(self) -> int:
        """Tokens of all the rows."""
        return sum(len(p) + len(r) for p, r in zip(self.prompts, self.responses))


def shape_rows(shape: str, groups: int, vocab: int, gen: torch.Generator, seed: int,
               scale: float = 1.0) -> Rows:  # fmt: skip
    """The rows of ``groups`` groups of ``shape``: ``N,P,R`` (one prompt, N responses) or
    ``agentic`` (bench/trees.py, its lengths times ``scale``: a task's per-turn rows, each turn's
    whole prefix, the turn its response; a group is a task)."""
    if shape == "agentic":
        tree = agentic(tasks=groups, seed=seed, scale=scale)
        prompts, responses, task = tree.token_rows(vocab, seed)
        longest = max(len(p) + len(r) for p, r in zip(prompts, responses))
        return Rows(prompts, responses, max(tree.tree_tokens()), len(prompts) // groups, longest)
    n, p, r = (int(x) for x in shape.split(","))
    prompts, responses = [], []
    for _ in range(groups):
        prompt = torch.randint(0, vocab, (p,), generator=gen).tolist()
        for _ in range(n):
            prompts.append(prompt)
            responses.append(torch.randint(0, vocab, (r,), generator=gen).tolist())
    return Rows(prompts, responses, p + n * r, n, p + r)


def make_batch(rows: Rows, vocab: int, gen: torch.Generator) -> Any:
    """veRL's rollout batch of ``rows`` (left-padded prompts, right-padded responses), in its
    no-padding layout."""
    from tensordict import TensorDict
    from verl.workers.utils.padding import left_right_2_no_padding

    from dualkv import rows_from_lists

    ids, mask, pw, _ = rows_from_lists(rows.prompts, [[r] for r in rows.responses])
    b, rw = ids.shape[0], ids.shape[1] - pw
    response_mask = mask[:, pw:].clone()
    td = TensorDict(
        {
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            "prompts": ids[:, :pw].clone(),
            "responses": ids[:, pw:].clone(),
            "response_mask": response_mask,
            "advantages": torch.randn(b, 1, generator=gen).expand(b, rw).clone(),
            # near the random model's log-probs (about -log V): ratios near 1, some clipped
            "old_log_probs": -torch.log(torch.tensor(float(vocab)))
            + 0.1 * torch.randn(b, rw, generator=gen),
        },
        batch_size=[b],
    )
    return left_right_2_no_padding(td)


ROWS_ATTN = "dualkv_rows"  # the baseline's varlen attention on veRL's remove-padding rows
_ROWS_LAYOUT: dict[str, Any] = {}


def rows_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: Any, scaling: float | None = None, dropout: float = 0.0,
                   position_ids: torch.Tensor | None = None,
                   **kwargs: Any) -> tuple[Any, None]:  # fmt: skip
    """Causal attention within each row of a remove-padding stream ``[1, T]`` (rows start where
    ``position_ids`` is 0), as flash-attn's varlen function: [1, H, T, D] -> [1, T, H, D]."""
    import dualkv

    if position_ids is None or query.shape[0] != 1:
        raise ValueError(f"{ROWS_ATTN} needs veRL's remove-padding stream with position_ids")
    # The model hands every layer the same position_ids tensor: its rows are found (one host
    # synchronisation) once per forward, not once per layer.
    cached = _ROWS_LAYOUT.get("key")
    if cached is None or cached[0] is not position_ids or cached[1] != position_ids._version:
        pos = position_ids.reshape(-1)
        starts = (pos == 0).nonzero().flatten().tolist() + [pos.numel()]
        lengths = [b - a for a, b in zip(starts[:-1], starts[1:], strict=True)]
        _ROWS_LAYOUT["key"] = (position_ids, position_ids._version)
        _ROWS_LAYOUT["layout"] = dualkv.Layout(lengths, [[] for _ in lengths], device=query.device)
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    out = dualkv.attention(q, k, v, _ROWS_LAYOUT["layout"], softmax_scale=scaling)
    assert isinstance(out, torch.Tensor)
    return out.unsqueeze(0), None


def fused_logprobs(logits: torch.Tensor, labels: torch.Tensor, inplace_backward: bool = True
                   ) -> torch.Tensor:  # fmt: skip
    """``log_softmax(logits)[labels]`` in one fused call (the ``--baseline-logprobs fused``
    stand-in for flash-attn's cross-entropy kernel, which veRL uses where flash-attn exists)."""
    flat = logits.reshape(-1, logits.shape[-1])
    out = torch.nn.functional.cross_entropy(flat, labels.reshape(-1), reduction="none")
    return -out.view(labels.shape)


def register_rows_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ROWS_ATTN, rows_attention)
    AttentionMaskInterface.register(ROWS_ATTN, lambda *a, **k: None)


def build_engine(kind: str, path: str, args: argparse.Namespace) -> Any:
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    from dualkv.integrations.verl import DualKVFSDPEngineWithLMHead

    cuda = args.device == "cuda"
    attn = "dualkv" if kind == "dualkv" else args.baseline_attn
    rmpad = True if kind == "dualkv" else args.baseline_remove_padding
    model_config = HFModelConfig(
        path=path, load_tokenizer=False, override_config={"attn_implementation": attn},
        use_remove_padding=rmpad, enable_gradient_checkpointing=True,
    )  # fmt: skip
    mp = None if cuda else {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    engine_config = FSDPEngineConfig(
        strategy=args.strategy, mixed_precision=mp, use_torch_compile=cuda, use_dynamic_bsz=True,
        max_token_len_per_gpu=1 << 20,
    )  # fmt: skip
    engine_config.use_remove_padding = rmpad
    optim = FSDPOptimizerConfig(lr=1e-6, total_training_steps=1000, clip_grad=1.0)
    cls = DualKVFSDPEngineWithLMHead if kind == "dualkv" else FSDPEngineWithLMHead
    engine = cls(model_config, engine_config, optim, CheckpointConfig())
    engine.initialize()
    return engine


def budgets(kind: str, g: int, rows: Rows) -> list[tuple[int, int]]:
    """(max_token_len_per_gpu, responses per micro-batch) candidates, ascending: DualKV whole
    groups (1, 2, ... of the largest group's packed tokens), veRL rows (1, 2, 4, ... longest
    rows, then all of them)."""
    out = []
    if kind == "dualkv":
        for groups in range(1, g + 1):
            out.append((groups * rows.group_tokens, groups * rows.rows_per_group))
    else:
        total = len(rows.prompts)
        k = 1
        while k <= total:
            out.append((k * rows.row_max, k))
            k *= 2
        if out[-1][1] != total:
            out.append((total * rows.row_max, total))
    return out


def step(engine: Any, batch: Any, budget: int, loss_fn: Any, args: argparse.Namespace) -> Any:
    from verl.utils import tensordict_utils as tu

    data = batch.clone()
    rmpad = bool(engine.engine_config.use_remove_padding)
    tu.assign_non_tensor(
        data, temperature=1.0, calculate_entropy=False, compute_loss=True, use_remove_padding=rmpad,
        use_dynamic_bsz=True, max_token_len_per_gpu=budget, global_batch_size=data.shape[0],
    )  # fmt: skip
    with engine.train_mode():
        out = engine.train_batch(data, loss_function=loss_fn)
    return out


def measure(engine: Any, batch: Any, budget: int, loss_fn: Any, steps: int, warmup: int,
            rec: dict[str, Any], args: argparse.Namespace) -> bool:  # fmt: skip
    """Time ``steps`` update steps (after ``warmup``) into ``rec``; False on out-of-memory."""
    cuda = args.device == "cuda"
    times, losses = [], []
    try:
        for i in range(warmup + steps):
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            out = step(engine, batch, budget, loss_fn, args)
            if cuda:
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            if i >= warmup:
                times.append(dt)
            losses.append(float(sum(out["loss"])))
            rec["micro_batches"] = len(out["loss"])
        rec["step_s"] = statistics.median(times)
        rec["loss_first_step"] = losses[0]
        if cuda:
            rec["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        ok = True
    except torch.OutOfMemoryError:
        rec["oom"] = True
        ok = False
    print(json.dumps(rec), flush=True)
    if cuda:
        gc.collect()
        torch.cuda.empty_cache()
    return ok


def run_engine(kind: str, path: str, shape: str, args: argparse.Namespace,
               vocab: int) -> list[dict[str, Any]]:  # fmt: skip
    """Timing on a mini-batch of ``--groups`` groups at rising micro-batch budgets, then the
    capacity probe: mini-batches of one micro-batch of 2G, 4G, ... groups (one step each) up to
    ``--capacity-max-groups``, while they fit."""
    from verl.workers.config import FSDPActorConfig
    from verl.workers.utils.losses import ppo_loss

    gen = torch.Generator().manual_seed(args.seed)
    rows = shape_rows(shape, args.groups, vocab, gen, args.seed, args.tree_scale)
    batch = make_batch(rows, vocab, gen)
    actor = FSDPActorConfig(strategy=args.strategy, rollout_n=rows.rows_per_group,
                            use_dynamic_bsz=True)  # fmt: skip

    def loss_fn(model_output: Any, data: Any, dp_group: Any = None) -> Any:
        return ppo_loss(actor, model_output, data, dp_group)

    engine = build_engine(kind, path, args)
    results = []
    fits = True
    for budget, per_mb in budgets(kind, args.groups, rows):
        rec: dict[str, Any] = dict(
            engine=kind, phase="time", shape=shape, groups=args.groups,
            max_token_len_per_gpu=budget, responses_per_micro_batch=per_mb,
        )  # fmt: skip
        fits = measure(engine, batch, budget, loss_fn, args.steps, args.warmup, rec, args)
        results.append(rec)
        if not fits:
            break
    g = args.groups * 2
    while fits and g <= args.capacity_max_groups:
        big_gen = torch.Generator().manual_seed(args.seed + g)
        big_rows = shape_rows(shape, g, vocab, big_gen, args.seed + g, args.tree_scale)
        big = make_batch(big_rows, vocab, big_gen)
        budget = g * big_rows.group_tokens if kind == "dualkv" else big_rows.tokens
        rec = dict(
            engine=kind, phase="capacity", shape=shape, groups=g, max_token_len_per_gpu=budget,
            responses_per_micro_batch=len(big_rows.prompts),
        )  # fmt: skip
        fits = measure(engine, big, budget, loss_fn, 1, 0, rec, args)
        results.append(rec)
        del big
        g *= 2
    del engine
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--preset", default="1.7b", help="Qwen3 shape (dualkv.demos.grpo_step.PRESETS)")
    ap.add_argument("--shapes", nargs="+", default=["16,8192,1024", "32,4096,2048"],
                    help="N,P,R per shape, or agentic (see above)")  # fmt: skip
    ap.add_argument("--groups", type=int, default=2,
                    help="prompt groups (agentic: tasks) per mini-batch")  # fmt: skip
    ap.add_argument("--tree-scale", type=float, default=1.0,
                    help="scale the agentic shape's lengths (smoke runs)")  # fmt: skip
    ap.add_argument("--engines", default="dualkv,verl")
    ap.add_argument("--baseline-attn", default=None,
                    help="veRL engine's attention (default: flash_attention_2 if flash_attn "
                         f"imports, else sdpa; {ROWS_ATTN}: see above)")  # fmt: skip
    ap.add_argument("--baseline-remove-padding", type=int, default=None,
                    help="veRL engine's use_remove_padding (default: 1 with flash_attention_2, "
                         "else 0)")  # fmt: skip
    ap.add_argument(
        "--baseline-logprobs",
        default="verl",
        choices=("verl", "fused"),
        help="veRL engine's log-probs: its own (verl) or one fused call (see above)",
    )
    ap.add_argument("--strategy", default="fsdp2", choices=("fsdp", "fsdp2"))
    cap_help = "capacity probe: micro-batches up to this many groups (0: off)"
    ap.add_argument("--capacity-max-groups", type=int, default=16, help=cap_help)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the records to this file")
    args = ap.parse_args(argv)
    for shape in args.shapes:
        if shape != "agentic" and not (
            len(shape.split(",")) == 3 and all(x.isdigit() for x in shape.split(","))
        ):
            ap.error(f"--shapes: {shape!r} is neither N,P,R nor agentic")

    if args.baseline_attn is None:
        try:
            import flash_attn  # noqa: F401

            args.baseline_attn = "flash_attention_2"
        except ImportError:
            args.baseline_attn = "sdpa"
    if args.baseline_remove_padding is None:
        args.baseline_remove_padding = int(args.baseline_attn in ("flash_attention_2", ROWS_ATTN))
    if args.baseline_attn == ROWS_ATTN:
        if not args.baseline_remove_padding:
            raise SystemExit(f"--baseline-attn {ROWS_ATTN} runs on remove-padding rows only")
        register_rows_attention()
    args.baseline_remove_padding = bool(args.baseline_remove_padding)
    if args.baseline_logprobs == "fused":
        import verl.workers.engine.fsdp.transformer_impl as verl_impl

        verl_impl.logprobs_from_logits = fused_logprobs  # the name the engine calls
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    import dualkv.integrations.verl as dkv_verl

    if args.device == "cpu":
        dkv_verl.use_cpu_platform()
    if not torch.distributed.is_initialized():
        backend = "nccl" if args.device == "cuda" else "gloo"
        torch.distributed.init_process_group(backend, rank=0, world_size=1)
    if args.device == "cuda":
        torch.cuda.set_device(0)
    from dualkv.demos.grpo_step import PRESETS

    vocab = int(PRESETS[args.preset]["vocab_size"])
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    head = (f"# veRL update step, preset {args.preset}, {args.strategy}, baseline attention "
            f"{args.baseline_attn} (use_remove_padding={args.baseline_remove_padding}), "
            f"baseline log-probs {args.baseline_logprobs}, "
            f"{args.groups} groups per mini-batch, {where}")  # fmt: skip
    print(head, flush=True)
    records: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as path:
        save_model(args.preset, path, args.device, args.seed)
        for shape in args.shapes:
            rows = shape_rows(shape, args.groups, vocab, torch.Generator(), args.seed,
                              args.tree_scale)  # fmt: skip
            print(f"# {shape}: {len(rows.prompts)} rows, {rows.tokens} row tokens, largest group "
                  f"{rows.group_tokens} packed tokens", flush=True)  # fmt: skip
            for kind in args.engines.split(","):
                records += run_engine(kind, path, shape, args, vocab)
    print("\n| engine | phase | N, P, R (or tree) | groups / mini-batch | responses / micro-batch "
          "| budget (tokens) | micro-batches | step (s) | peak (GiB) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for rec in records:
        shape = rec["shape"]
        if rec.get("oom"):
            step_s, peak, mbs = "OOM", "OOM", "-"
        else:
            step_s, mbs = f"{rec['step_s']:.3f}", str(rec["micro_batches"])
            peak = f"{rec['peak_gib']:.1f}" if "peak_gib" in rec else "-"
        print(f"| {rec['engine']} | {rec['phase']} | {shape} | {rec['groups']} | "
              f"{rec['responses_per_micro_batch']} | {rec['max_token_len_per_gpu']} | {mbs} | "
              f"{step_s} | {peak} |")  # fmt: skip
    for shape in args.shapes:
        ok = {}
        for rec in records:
            same = rec["shape"] == shape and rec["phase"] == "time"
            if same and not rec.get("oom"):
                key = rec["engine"]
                if key not in ok or rec["responses_per_micro_batch"] > ok[key][0]:
                    ok[key] = (
                        rec["responses_per_micro_batch"], rec["step_s"], rec["loss_first_step"]
                    )  # fmt: skip
        line = ", ".join(f"{k}: step {v[1]:.3f} s at {v[0]} responses / micro-batch, "
                         f"loss {v[2]:.6f}" for k, v in ok.items())  # fmt: skip
        cap = {}
        for rec in records:
            if rec["shape"] == shape and not rec.get("oom"):
                cap[rec["engine"]] = max(
                    cap.get(rec["engine"], 0), rec["responses_per_micro_batch"]
                )
        caps = ", ".join(f"{k} {v}" for k, v in cap.items())
        print(f"# ({shape}): {line}; largest micro-batch that ran (responses): {caps}")
    if args.json:
        with open(args.json, "w") as f:
            for rec in records:
                f.write(json.dumps(rec) + "\n")
    with contextlib.suppress(Exception):
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
