"""The main job: one GRPO/DAPO policy-update step, standard rows vs DualKV packed, side by side.

    python -m dualkv.demo                           # tiny random Qwen3 on CPU, a few seconds
    python -m dualkv.demo --preset 1.7b --groups 1 --n 16 --prompt-len 8192 \\
        --response-len 1024 --grad-ckpt --steps 5   # Qwen3-1.7B shape on a GPU

Each step builds a random GRPO batch (G prompts x N sampled responses of uneven length, in the
trainer's row layout), then runs the policy update twice on the same weights:

* standard: N rows of ``[prompt | response_i]`` through the model with HF SDPA, full-vocabulary
  logits of the response positions, log-softmax, DAPO/GRPO loss, backward;
* dualkv: :func:`dualkv.pack` -> one packed stream ``[prompt | r_1 | ... | r_N]`` through the same
  model with ``attn_implementation="dualkv"``, chunked :func:`dualkv.response_logprobs`, the same
  loss on the same ``[B, R_max]`` log-probs, backward;

and prints the tokens of both layouts, the token reduction rho, step time and peak memory of both
paths, and how far apart their log-probs, losses and gradients are. Weights are random (no hub
download): the shapes, not the weights, set the cost.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..logprobs import logprobs_from_logits
from ..losses import dapo_loss, group_advantages, grpo_loss
from ..packing import PackedBatch, pack_rows, rows_from_lists

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = [
    "PRESETS",
    "StepResult",
    "build_model",
    "main",
    "make_batch",
    "run",
]

# Qwen3 shapes (random weights). "tiny" runs in seconds on a laptop CPU.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, vocab_size=4096, tie_word_embeddings=True,
    ),
    "0.6b": dict(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
    ),
    "1.7b": dict(
        hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
    ),
    "4b": dict(
        hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
    ),
    "8b": dict(
        hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False,
    ),
}  # fmt: skip


def build_model(
    preset: str = "tiny",
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    overrides: dict[str, Any] | None = None,
) -> PreTrainedModel:
    """A randomly initialised Qwen3 causal LM of a :data:`PRESETS` shape, built on ``device``.

    ``overrides`` replace config fields (e.g. ``num_hidden_layers``). Registers the ``"dualkv"``
    attention with transformers; the model starts with ``attn_implementation="sdpa"``.
    """
    from transformers import AutoModelForCausalLM, Qwen3Config

    from ..integrations import transformers as _register  # noqa: F401  (registers "dualkv")

    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    fields = dict(PRESETS[preset], max_position_embeddings=1 << 17, attention_dropout=0.0)
    fields.update(overrides or {})
    config = Qwen3Config(**fields)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    return model.to(device=device, dtype=dtype)


@dataclass
class Batch:
    """A random GRPO batch in the trainer's row layout plus its packed form."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    prompt_width: int
    group_ids: torch.Tensor
    advantages: torch.Tensor
    packed: PackedBatch

    @property
    def response_mask(self) -> torch.Tensor:
        """``[B, R_max]`` real response tokens."""
        return self.packed.response_mask

    @property
    def standard_tokens(self) -> int:
        """Tokens the standard layout computes (padded rows ``B x L``)."""
        return int(self.input_ids.numel())


def make_batch(
    groups: int,
    n: int,
    prompt_len: int,
    response_len: int,
    vocab: int,
    device: torch.device | str = "cpu",
    seed: int = 0,
    uneven: bool = True,
) -> Batch:
    """Random prompts and responses; with ``uneven`` prompts vary in [3/4 P, P] and responses
    in [R/2, R] tokens (the longest is always R). Rewards are random; advantages are GRPO's."""
    g = torch.Generator().manual_seed(seed)

    def length(hi: int, lo: int) -> int:
        return hi if not uneven or hi <= lo else int(torch.randint(lo, hi + 1, (1,), generator=g))

    prompts, responses = [], []
    for gi in range(groups):
        p = length(prompt_len, max(1, (3 * prompt_len) // 4)) if gi else prompt_len
        prompts.append(torch.randint(0, vocab, (p,), generator=g).tolist())
        rs = []
        for i in range(n):
            r = length(response_len, max(1, response_len // 2)) if (gi or i) else response_len
            rs.append(torch.randint(0, vocab, (r,), generator=g).tolist())
        responses.append(rs)
    ids, mask, pw, gid = rows_from_lists(prompts, responses, device=device)
    rewards = torch.rand(ids.shape[0], generator=g).to(device)
    adv = group_advantages(rewards, gid)
    return Batch(ids, mask, pw, gid, adv, pack_rows(ids, mask, pw, gid))


@dataclass
class PathResult:
    """One path's outcome for one step."""

    time_s: float = float("nan")
    peak_bytes: int | None = None
    logprobs: torch.Tensor | None = None
    loss: torch.Tensor | None = None
    grads: dict[str, torch.Tensor] | None = None
    error: str | None = None


@dataclass
class StepResult:
    """Both paths of one step and their differences."""

    standard: PathResult
    packed: PathResult
    max_logprob_diff: float | None = None
    loss_diff: float | None = None
    max_grad_rel_diff: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class _SavedBytes:
    """Bytes of the tensors autograd saves for backward while a block runs (parameters excluded,
    storages counted once): the activation memory of a step, measurable on CPU too."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.total = 0
        self._params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self._seen: set[int] = set()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # e.g. tensor subclasses without storage
            return t
        ptr = storage.data_ptr()
        if ptr not in self._params and ptr not in self._seen:
            self._seen.add(ptr)
            self.total += storage.nbytes()
        return t

    @contextlib.contextmanager
    def measure(self) -> Iterator[_SavedBytes]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield self


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _loss_fn(name: str) -> Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    losses: dict[str, Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]] = {
        "dapo": dapo_loss, "grpo": grpo_loss
    }  # fmt: skip
    return losses[name]


def _standard_logprobs(model: PreTrainedModel, batch: Batch, temperature: float) -> torch.Tensor:
    """What a trainer does without DualKV: rows through the model, full logits, log-softmax."""
    rw = batch.input_ids.shape[1] - batch.prompt_width
    mask = batch.attention_mask
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=batch.input_ids, attention_mask=mask, position_ids=pos,
                use_cache=False, logits_to_keep=rw + 1)  # fmt: skip
    logits = out.logits[:, -(rw + 1) : -1]
    labels = batch.input_ids[:, batch.prompt_width :]
    lp = logprobs_from_logits(logits, labels, batch.response_mask, temperature)
    assert isinstance(lp, torch.Tensor)  # no entropy asked for
    return lp


def _packed_logprobs(
    model: PreTrainedModel, batch: Batch, temperature: float, chunk_size: int | None
) -> torch.Tensor:
    from ..integrations.transformers import packed_response_logprobs

    lp = packed_response_logprobs(model, batch.packed, temperature, chunk_size=chunk_size)
    assert isinstance(lp, torch.Tensor)  # no entropy asked for
    return lp


def _run_path(
    model: PreTrainedModel,
    batch: Batch,
    old: torch.Tensor,
    packed: bool,
    args: argparse.Namespace,
    keep_grads: bool,
) -> PathResult:
    device = batch.input_ids.device
    model.set_attn_implementation("dualkv" if packed else "sdpa")
    model.zero_grad(set_to_none=True)
    res = PathResult()
    loss_fn = _loss_fn(args.loss)
    saved = _SavedBytes(model)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    ctx = saved.measure() if device.type == "cpu" else contextlib.nullcontext()
    try:
        with ctx:
            _sync(device)
            t0 = time.perf_counter()
            if packed:
                lp = _packed_logprobs(model, batch, args.temperature, args.chunk_size)
            else:
                lp = _standard_logprobs(model, batch, args.temperature)
            loss, _ = loss_fn(lp, old, batch.advantages, batch.response_mask)
            loss.backward()
            _sync(device)
            res.time_s = time.perf_counter() - t0
    except torch.OutOfMemoryError:  # the standard path at long shapes
        res.error = "out of memory"
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return res
    if device.type == "cuda":
        res.peak_bytes = torch.cuda.max_memory_allocated(device) - base
    else:
        res.peak_bytes = saved.total
    res.logprobs, res.loss = lp.detach(), loss.detach()
    if keep_grads:
        res.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
                     if p.grad is not None}  # fmt: skip
    return res


def _compare(std: PathResult, pk: PathResult, mask: torch.Tensor, out: StepResult) -> None:
    if std.logprobs is None or pk.logprobs is None:
        return
    out.max_logprob_diff = (
        (std.logprobs - pk.logprobs).abs()[mask].max().item() if mask.any() else 0.0
    )
    out.loss_diff = (std.loss - pk.loss).abs().item()  # type: ignore[operator]
    if std.grads is not None and pk.grads is not None:
        worst = 0.0
        for name, g in std.grads.items():
            scale = g.abs().max().item()
            diff = (pk.grads[name].float() - g.float()).abs().max().item()
            worst = max(worst, diff / scale if scale > 0 else diff)
        out.max_grad_rel_diff = worst


def _checkpointing(model: PreTrainedModel, args: argparse.Namespace, keep_attention: bool) -> None:
    """With --grad-ckpt: (re)enable checkpointing; the packed path keeps DualKV's attention
    outputs, the standard path gets plain checkpointing (the selective-checkpoint policy would
    only add its per-op dispatch overhead there)."""
    if args.grad_ckpt:
        from ..integrations.transformers import enable_gradient_checkpointing

        enable_gradient_checkpointing(model, keep_attention=keep_attention)


def run_step(model: PreTrainedModel, batch: Batch, args: argparse.Namespace) -> StepResult:
    """Both paths on one batch (the standard path first), then an SGD step on the packed grads."""
    with torch.no_grad():  # the rollout policy's log-probs: current ones, slightly perturbed
        model.set_attn_implementation("dualkv")
        old = _packed_logprobs(model, batch, args.temperature, args.chunk_size)
        noise = torch.randn(old.shape, generator=torch.Generator().manual_seed(args.seed))
        old = (old + 0.05 * noise.to(old.device)) * batch.response_mask
    compare = not args.no_compare
    std = PathResult(error="skipped")
    if not args.no_standard:
        _checkpointing(model, args, keep_attention=False)  # plain checkpointing for SDPA
        std = _run_path(model, batch, old, packed=False, args=args, keep_grads=compare)
    _checkpointing(model, args, keep_attention=True)
    pk = _run_path(model, batch, old, packed=True, args=args, keep_grads=False)
    result = StepResult(std, pk)
    if compare and std.error is None:
        pk.grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        _compare(std, pk, batch.response_mask, result)
    with torch.no_grad():  # the policy update itself (SGD on the packed path's gradients)
        for p in model.parameters():
            if p.grad is not None:
                p.add_(p.grad, alpha=-args.lr)
    model.zero_grad(set_to_none=True)
    std.grads = pk.grads = None
    return result


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    if n < 1 << 20:
        return f"{n / 1024:.0f} KiB"
    if n < 1 << 30:
        return f"{n / (1 << 20):.1f} MiB"
    return f"{n / (1 << 30):.2f} GiB"


def _fmt_time(t: float) -> str:
    return "n/a" if math.isnan(t) else (f"{t * 1e3:.1f} ms" if t < 10 else f"{t:.2f} s")


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m dualkv.demo",
        description="GRPO/DAPO policy-update step: standard rows (HF SDPA) vs DualKV packed.",
    )
    p.add_argument(
        "--preset",
        default="tiny",
        choices=sorted(PRESETS),
        help="Qwen3 shape with random weights (default tiny)",
    )
    p.add_argument("--layers", type=int, help="override the number of layers")
    p.add_argument("--vocab", type=int, help="override the vocabulary size")
    p.add_argument("--groups", type=int, default=2, help="prompts per micro-batch (G)")
    p.add_argument("--n", type=int, default=8, help="responses per prompt (N)")
    p.add_argument("--prompt-len", type=int, default=512, help="prompt tokens (P, the longest)")
    p.add_argument(
        "--response-len",
        type=int,
        default=128,
        help="response tokens (R, the longest; others uneven in [R/2, R])",
    )
    p.add_argument("--even", action="store_true", help="all prompts P and all responses R")
    p.add_argument("--steps", type=int, default=1, help="policy-update steps")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1 ... (auto: cuda if any)")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="auto: bfloat16 on GPU, float32 on CPU",
    )
    p.add_argument("--loss", default="dapo", choices=["dapo", "grpo"])
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=1e-5, help="SGD step size of the update")
    p.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing (both paths)")
    p.add_argument("--chunk-size", type=int, help="tokens per log-prob chunk (default auto)")
    p.add_argument("--no-standard", action="store_true", help="run the DualKV path only")
    p.add_argument(
        "--no-compare",
        action="store_true",
        help="skip the gradient comparison (saves a copy of the gradients)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)  # fmt: skip


def _progress(total: int, disable: bool) -> Any:
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm comes with transformers
        return None
    return tqdm(total=total, desc="GRPO steps", unit="step", disable=disable, file=sys.stderr)


def run(argv: Sequence[str] | None = None, out: Any = None) -> list[StepResult]:
    """Run the demo with command-line ``argv``; prints the report to ``out`` (stdout)."""
    args = _parse(argv)
    out = out or sys.stdout
    device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    )
    if args.dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        dtype = getattr(torch, args.dtype)
    overrides: dict[str, Any] = {}
    if args.layers:
        overrides["num_hidden_layers"] = args.layers
    if args.vocab:
        overrides["vocab_size"] = args.vocab
    model = build_model(args.preset, device, dtype, seed=args.seed, overrides=overrides)
    model.train()
    cfg = model.config
    params = sum(p.numel() for p in model.parameters())
    print(
        f"DualKV GRPO step | Qwen3 '{args.preset}' shape, random weights: {params / 1e6:.1f}M "
        f"params, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, heads "
        f"{cfg.num_attention_heads}/{cfg.num_key_value_heads}, vocab {cfg.vocab_size} | {device} "
        f"{str(dtype).replace('torch.', '')}{' | grad ckpt' if args.grad_ckpt else ''} | "
        f"{args.loss.upper()} loss",
        file=out,
    )
    results: list[StepResult] = []
    bar = _progress(args.steps, disable=args.quiet or args.steps <= 1)
    batch = None
    for step in range(args.steps):
        batch = make_batch(args.groups, args.n, args.prompt_len, args.response_len,
                           cfg.vocab_size, device, seed=args.seed + step,
                           uneven=not args.even)  # fmt: skip
        res = run_step(model, batch, args)
        results.append(res)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(std=_fmt_time(res.standard.time_s), dualkv=_fmt_time(res.packed.time_s))
    if bar is not None:
        bar.close()
    assert batch is not None
    _report(results, batch, args, dtype, out)
    return results


def _median_time(paths: list[PathResult]) -> float:
    times = [p.time_s for p in paths if p.error is None]
    if len(times) >= 3:  # the first step includes warm-up (allocator, kernels, compilation)
        times = times[1:]
    return statistics.median(times) if times else float("nan")


def _report(
    results: list[StepResult],
    batch: Batch,
    args: argparse.Namespace,
    dtype: torch.dtype,
    out: Any,
) -> None:
    pk = batch.packed
    lay = pk.layout
    resp = sum(sum(r) for r in lay.response_lens)
    print(
        f"batch    {lay.num_groups} prompts x {args.n} responses, P = {max(lay.prefix_lens)} "
        f"(max), R = {pk.max_response_len} (max){'' if args.even else ', uneven'}; "
        f"{resp} response tokens",
        file=out,
    )
    rows = lay.unshared_tokens
    print(
        f"tokens   standard {batch.standard_tokens} (rows {batch.input_ids.shape[0]} x "
        f"{batch.input_ids.shape[1]}, {rows} unpadded) | packed {pk.total_tokens} | "
        f"rho = {lay.token_reduction:.2f}x",
        file=out,
    )
    std_t = _median_time([r.standard for r in results])
    pk_t = _median_time([r.packed for r in results])
    std_m = max((r.standard.peak_bytes or 0 for r in results), default=0) or None
    pk_m = max((r.packed.peak_bytes or 0 for r in results), default=0) or None
    std_err = next((r.standard.error for r in results if r.standard.error), None)
    speed = f"  (speedup {std_t / pk_t:.2f}x)" if not math.isnan(std_t) and pk_t > 0 else ""
    label = "median" if len(results) > 1 else "time"
    print(f"{'':21}{'standard':>14}{'dualkv':>14}", file=out)
    print(
        f"{'step ' + label:21}{(std_err or _fmt_time(std_t)):>14}{_fmt_time(pk_t):>14}{speed}",
        file=out,
    )
    mem = "peak memory" if batch.input_ids.device.type == "cuda" else "saved activations"
    std_mem = std_err or _fmt_bytes(std_m)
    print(f"{mem:21}{std_mem:>14}{_fmt_bytes(pk_m):>14}", file=out)
    diffs = [r for r in results if r.max_logprob_diff is not None]
    if diffs:
        lp = max(r.max_logprob_diff for r in diffs)  # type: ignore[type-var]
        loss = max(r.loss_diff for r in diffs)  # type: ignore[type-var]
        grads = [r.max_grad_rel_diff for r in diffs if r.max_grad_rel_diff is not None]
        gtxt = f", max grad rel diff {max(grads):.2e}" if grads else ""
        print(
            f"match    max |logprob diff| {lp:.2e}, |loss diff| {loss:.2e}{gtxt} "
            f"({str(dtype).replace('torch.', '')}; both paths' own rounding)",
            file=out,
        )
    last = results[-1].packed
    if last.loss is not None:
        print(f"loss     {last.loss.item():.6f} (last step, dualkv)", file=out)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point (``python -m dualkv.demo``); returns the exit status."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        print(MISSING_TRANSFORMERS, file=sys.stderr)
        return 2
    run(argv)
    return 0


MISSING_TRANSFORMERS = (
    "python -m dualkv.demo runs a Hugging Face transformers model, and transformers is not "
    "installed: pip install 'dualkv[transformers]' (or pip install transformers), or run "
    "bash scripts/demo.sh, which installs it."
)


if __name__ == "__main__":
    sys.exit(main())
