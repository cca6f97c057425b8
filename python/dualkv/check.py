"""Self-test in your own environment: ``python -m dualkv.check`` (see ``--help``).

Runs a causal LM both ways on one small random GRPO batch — the standard rows with a plain
attention implementation (``sdpa`` by default) and the packed batch with ``"dualkv"`` — and
compares the response log-probs, a GRPO loss and every parameter gradient. Use it on your own
model (``--model PATH``, or :func:`self_test` from Python) after an upgrade of torch,
transformers or DualKV, or before trusting a new model family: a wrong position, mask or
attention dispatch shows up as a difference far above the tolerance.

float32 and float64 models are compared with the rows directly, at tight tolerances
(:data:`TOLERANCES`). A 16-bit model's log-probs and gradients are measured against a float32
copy of itself run on the rows (the yardstick): their error must stay within a small multiple of
the 16-bit rows' own (:data:`YARDSTICK`), as FlashAttention's tests judge a kernel against the
same-precision PyTorch computation; its loss keeps a fixed tolerance against the 16-bit rows.
The default batch (seed 0) has a prompt longer than one 128-token kernel tile, and a model's
sliding window is shrunk for the check (on both paths) so that the batch reaches it.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TextIO

import torch

from .losses import grpo_loss
from .packing import pack_rows, rows_from_lists

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["CheckReport", "main", "self_test"]

# (max |log-prob diff|, |loss diff|, max per-parameter gradient error / gradient scale) of the
# packed path against the rows in the model's dtype (16-bit models: the loss only; their
# log-probs and gradients are judged against a float32 copy, YARDSTICK)
TOLERANCES: dict[torch.dtype, tuple[float, float, float]] = {
    torch.float64: (1e-8, 1e-9, 1e-6),
    torch.float32: (1e-3, 1e-4, 1e-2),
    torch.bfloat16: (0.25, 0.05, 0.25),
    torch.float16: (0.1, 0.02, 0.1),
}
# 16-bit models against the float32 rows: (statistic, allowed multiple of the 16-bit rows' own
# value, floor). A tiny bf16 Qwen3 over 48 seeds: correct ratios <= 1.17 (RMS log-prob), 1.24
# (max), 1.71 (gradients); a 15% attention-scale error >= 2.77 / 2.32 / 1.67. The loss, one
# number, is too noisy for a ratio (correct up to 6.5): it keeps TOLERANCES. So is a 16-bit
# gradient's per-parameter maximum (0.25 against the bf16 rows: 1 false alarm in 48 seeds).
YARDSTICK = (
    ("rms log-prob error", 1.5, 1e-3),
    ("max log-prob error", 4.0, 1e-3),
    ("grad rel. L2 error", 3.0, 1e-3),
)


@dataclass
class CheckReport:
    """What :func:`self_test` measured: the packed DualKV path against the rows (for a 16-bit
    model, its log-probs and gradients against a float32 copy's rows, with tolerances from the
    16-bit rows' own error).

    ``measures``: ``(name, value, tolerance)`` of each statistic; ``worst_parameter``: the
    parameter with the largest gradient error relative to its scale."""

    dtype: torch.dtype
    tokens_rows: int
    tokens_packed: int
    measures: list[tuple[str, float, float]]
    worst_parameter: str
    lines: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """Every statistic within its tolerance (and finite)."""
        return all(v == v and v <= t for _, v, t in self.measures)

    def value(self, name: str) -> float:
        """The measured value of the statistic ``name``."""
        return next(v for n, v, _ in self.measures if n == name)


def _random_batch(
    vocab: int, groups: int, n: int, prompt_len: int, response_len: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """Rows of ``groups`` prompts (lengths up to ``prompt_len``) with ``n`` responses each of
    uneven lengths (1..``response_len``), left/right padded as trainers lay them out."""
    prompts: list[list[int]] = []
    responses: list[list[list[int]]] = []
    for _ in range(groups):
        p = int(torch.randint(max(prompt_len // 2, 1), prompt_len + 1, (1,), generator=gen))
        prompts.append(torch.randint(0, vocab, (p,), generator=gen).tolist())
        lengths = [int(torch.randint(1, response_len + 1, (1,), generator=gen)) for _ in range(n)]
        responses.append([torch.randint(0, vocab, (r,), generator=gen).tolist() for r in lengths])
    return rows_from_lists(prompts, responses)


def _loss_and_grads(
    model: PreTrainedModel,
    logp: torch.Tensor,
    old: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    # clip_eps 0.99: no token reaches the clip (|log-ratio| < 0.69 here). A clipped token's
    # gradient drops to 0, so 16-bit log-prob noise of a few 1e-2 at the default 0.2 boundary
    # moved the gradient far more than any path error (bf16: 50% vs 5% for the rows)
    loss, _ = grpo_loss(logp.float(), old, adv, mask, clip_eps=0.99)
    model.zero_grad(set_to_none=True)
    loss.backward()
    grads = {
        name: p.grad.detach().float().clone()
        for name, p in model.named_parameters()
        if p.grad is not None
    }
    model.zero_grad(set_to_none=True)
    return loss.detach().float(), grads


Result = tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]  # log-probs, loss, grads


def _differences(got: Result, want: Result, mask: torch.Tensor) -> tuple[dict[str, float], str]:
    """Statistics of ``got`` - ``want`` over the scored tokens and every parameter's gradient
    (a gradient on one side only counts as inf; NaN propagates), and the parameter with the
    largest gradient error relative to its scale."""
    diff = (got[0].detach().float() - want[0].detach().float())[mask]
    stats = {
        "max log-prob error": float(diff.abs().max()) if diff.numel() else 0.0,
        "rms log-prob error": float(diff.pow(2).mean().sqrt()) if diff.numel() else 0.0,
        "|loss error|": float((got[1] - want[1]).abs()),
    }
    worst, worst_name, num, den = 0.0, "-", 0.0, 0.0
    for name in sorted(got[2].keys() | want[2].keys()):
        h, g = got[2].get(name), want[2].get(name)
        if g is None or h is None:
            err = num = float("inf")
        else:
            scale = float(g.abs().max())
            err = float((h - g).abs().max())
            err = err / scale if scale != 0.0 else err
            num += float((h - g).pow(2).sum())
            den += float(g.pow(2).sum())
        # NaN sticks (a later finite error must not hide it)
        if not math.isnan(worst) and (math.isnan(err) or err > worst):
            worst, worst_name = err, name
    stats["max grad error / scale"] = worst
    stats["grad rel. L2 error"] = math.sqrt(num / den) if den > 0 else num
    return stats, worst_name


@contextlib.contextmanager
def _short_window(model: PreTrainedModel, window: int) -> Iterator[None]:
    """A sliding window longer than the check's batch changes nothing: shrink it (config and
    every attention module) for the check, on both paths; restored after."""
    config = model.config.get_text_config()
    old = getattr(config, "sliding_window", None)
    if not isinstance(old, int) or old <= window:
        yield
        return
    changed = [m for m in model.modules() if getattr(m, "sliding_window", None) == old]
    config.sliding_window = window
    for m in changed:
        setattr(m, "sliding_window", window)  # noqa: B010 (an int attribute of the module)
    try:
        yield
    finally:
        config.sliding_window = old
        for m in changed:
            setattr(m, "sliding_window", old)  # noqa: B010


def self_test(
    model: PreTrainedModel,
    groups: int = 2,
    n: int = 3,
    prompt_len: int = 160,
    response_len: int = 24,
    seed: int = 0,
    reference: str | None = None,
    out: TextIO | None = sys.stdout,
) -> CheckReport:
    """Compare the packed DualKV path with the standard rows on one random batch.

    Args:
        model: a transformers causal LM (any attention implementation; it is switched to
            ``reference`` for the rows and to ``"dualkv"`` for the packed batch, then restored).
        groups, n, prompt_len, response_len: the batch: ``groups`` prompts of
            ``prompt_len // 2..prompt_len`` tokens (the default reaches past one 128-token
            kernel tile), ``n`` responses each of 1..``response_len`` tokens. A sliding window
            longer than ``prompt_len // 3`` is shrunk to it for the check.
        seed: seed of the batch, advantages and old log-probs.
        reference: the attention implementation of the rows path (``"sdpa"`` or ``"eager"``;
            None: ``"eager"`` for models that soft-cap attention logits, which SDPA cannot,
            else ``"sdpa"``).
        out: where the table is printed (None: nowhere).

    Returns:
        A :class:`CheckReport`; ``report.passed`` says whether every statistic is within its
        tolerance: :data:`TOLERANCES` against the rows in the model's dtype; for 16-bit models
        the loss so, and :data:`YARDSTICK` for the log-probs and gradients (against a float32
        copy of the model, which the check makes: 4 bytes per parameter).
    """
    from .integrations.transformers import (
        ATTN_IMPLEMENTATION,
        packed_response_logprobs,
        rows_response_logprobs,
    )

    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    vocab = int(model.get_output_embeddings().weight.shape[0])
    gen = torch.Generator().manual_seed(seed)
    ids, mask, pw, gids = _random_batch(vocab, groups, n, prompt_len, response_len, gen)
    ids, mask, gids = ids.to(device), mask.to(device), gids.to(device)
    packed = pack_rows(ids, mask, pw, gids)
    resp_mask = packed.response_mask
    adv = torch.randn(ids.shape[0], generator=gen).to(device)
    if reference is None:  # SDPA cannot soft-cap attention logits (Gemma 2): eager can
        text = model.config.get_text_config()
        reference = "eager" if getattr(text, "attn_logit_softcapping", None) else "sdpa"
    window = max(2, prompt_len // 3)
    yardstick = dtype in (torch.bfloat16, torch.float16)
    previous = model.config._attn_implementation
    was_training = model.training
    model.eval()  # no dropout: both paths must compute the same function
    try:
        with _short_window(model, window):
            model.set_attn_implementation(reference)
            rows_lp = rows_response_logprobs(model, ids, mask, pw)
            assert isinstance(rows_lp, torch.Tensor)
            old = rows_lp.detach().float()
            old = old + 0.05 * torch.randn(old.shape, generator=gen).to(device)
            rows = _loss_and_grads(model, rows_lp, old, adv, resp_mask)
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
            packed_lp = packed_response_logprobs(model, packed)
            assert isinstance(packed_lp, torch.Tensor)
            got = _loss_and_grads(model, packed_lp, old, adv, resp_mask)
    finally:
        model.set_attn_implementation(previous)
        model.train(was_training)
    stats, worst_name = _differences((packed_lp, *got), (rows_lp, *rows), resp_mask)
    tol = TOLERANCES.get(dtype, TOLERANCES[torch.float32])
    names = ("max log-prob error", "|loss error|", "max grad error / scale")
    measures = [(k, stats[k], t) for k, t in zip(names, tol, strict=True)]
    if yardstick:  # the log-probs and gradients against a float32 copy's rows instead
        model32 = copy.deepcopy(model).float().eval()
        try:
            with _short_window(model32, window):
                model32.set_attn_implementation(reference)
                lp32 = rows_response_logprobs(model32, ids, mask, pw)
                assert isinstance(lp32, torch.Tensor)
                want = _loss_and_grads(model32, lp32, old, adv, resp_mask)
        finally:
            del model32
        base, _ = _differences((rows_lp, *rows), (lp32, *want), resp_mask)
        vs32, worst_name = _differences((packed_lp, *got), (lp32, *want), resp_mask)
        measures = [measures[1]] + [
            (f"{k} vs fp32", vs32[k], ratio * base[k] + floor) for k, ratio, floor in YARDSTICK
        ]
    report = CheckReport(
        dtype=dtype,
        tokens_rows=int(mask.sum()),
        tokens_packed=packed.total_tokens,
        measures=measures,
        worst_parameter=worst_name,
    )
    report.lines = [
        f"dualkv.check: {type(model).__name__}, {dtype}, {device}; packed 'dualkv' vs the rows "
        f"({reference!r})" + (", and vs a float32 copy's rows" if yardstick else ""),
        f"  batch: {groups} groups x {n} responses, {report.tokens_rows} row tokens -> "
        f"{report.tokens_packed} packed",
        *(f"  {k:<30}{v:.3e}  (tolerance {t:.1e})" for k, v, t in measures),
        f"  worst gradient: {worst_name}",
        "  PASSED" if report.passed else "  FAILED: the packed path differs from the rows",
    ]
    if out is not None:
        print("\n".join(report.lines), file=out)
    return report


def _tiny_qwen3(dtype: torch.dtype, device: str) -> PreTrainedModel:
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(  # head dim 64: the smallest the CUDA kernels are built for
        vocab_size=151, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).to(device)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; exit status 0 when the check passes, 1 when it fails."""
    parser = argparse.ArgumentParser(
        prog="python -m dualkv.check", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--model", help="a local model directory (from_pretrained); default: a "
                        "tiny random Qwen3")  # fmt: skip
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="default: float32 on CPU, bfloat16 on CUDA (whose kernels are "
                        "16-bit)")  # fmt: skip
    parser.add_argument("--reference", default=None, choices=["sdpa", "eager"],
                        help="the rows' attention (default: eager for models that soft-cap "
                        "attention logits, else sdpa)")  # fmt: skip
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--n", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=160)
    parser.add_argument("--response-len", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("python -m dualkv.check needs transformers: pip install 'dualkv[transformers]'",
              file=sys.stderr)  # fmt: skip
        return 2
    name = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    dtype = getattr(torch, name)
    model: Any
    if args.model:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(args.device)
    else:
        model = _tiny_qwen3(dtype, args.device)
    report = self_test(
        model, groups=args.groups, n=args.n, prompt_len=args.prompt_len,
        response_len=args.response_len, seed=args.seed, reference=args.reference,
    )  # fmt: skip
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
