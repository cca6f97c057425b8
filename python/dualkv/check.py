"""Self-test in your own environment: ``python -m dualkv.check`` (see ``--help``).

Runs a causal LM both ways on one small random GRPO batch — the standard rows with a plain
attention implementation (``sdpa`` by default) and the packed batch with ``"dualkv"`` — and
compares the response log-probs, a GRPO loss and every parameter gradient. Use it on your own
model (``--model PATH``, or :func:`self_test` from Python) after an upgrade of torch,
transformers or DualKV, or before trusting a new model family: a wrong position, mask or
attention dispatch shows up as a difference far above the tolerance.

Tolerances are for the comparison of two exact implementations in the model's dtype: float32
and float64 models are checked tightly; for 16-bit models the bound is loose (bf16 rounding
alone reaches 1e-2), so check a float32 copy (``--dtype float32``) to catch small errors.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TextIO

import torch

from .losses import grpo_loss
from .packing import pack_rows, rows_from_lists

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["CheckReport", "main", "self_test"]

# (max |log-prob diff|, |loss diff|, max per-parameter gradient error / gradient scale)
TOLERANCES: dict[torch.dtype, tuple[float, float, float]] = {
    torch.float64: (1e-8, 1e-9, 1e-6),
    torch.float32: (1e-3, 1e-4, 1e-2),
    torch.bfloat16: (0.25, 0.05, 0.25),
    torch.float16: (0.1, 0.02, 0.1),
}


@dataclass
class CheckReport:
    """What :func:`self_test` measured (rows path vs packed DualKV path)."""

    dtype: torch.dtype
    tokens_rows: int
    tokens_packed: int
    max_logprob_diff: float
    loss_diff: float
    max_grad_error: float
    worst_parameter: str
    tolerances: tuple[float, float, float]
    lines: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """All three differences within their tolerances (and finite)."""
        got = (self.max_logprob_diff, self.loss_diff, self.max_grad_error)
        return all(g == g and g <= t for g, t in zip(got, self.tolerances))


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
    loss, _ = grpo_loss(logp, old, adv, mask)
    model.zero_grad(set_to_none=True)
    loss.backward()
    grads = {
        name: p.grad.detach().float().clone()
        for name, p in model.named_parameters()
        if p.grad is not None
    }
    model.zero_grad(set_to_none=True)
    return loss.detach().float(), grads


def self_test(
    model: PreTrainedModel,
    groups: int = 2,
    n: int = 3,
    prompt_len: int = 24,
    response_len: int = 8,
    seed: int = 0,
    reference: str = "sdpa",
    out: TextIO | None = sys.stdout,
) -> CheckReport:
    """Compare the packed DualKV path with the standard rows on one random batch.

    Args:
        model: a transformers causal LM (any attention implementation; it is switched to
            ``reference`` for the rows and to ``"dualkv"`` for the packed batch, then restored).
        groups, n, prompt_len, response_len: the batch: ``groups`` prompts of up to
            ``prompt_len`` tokens, ``n`` responses each of 1..``response_len`` tokens.
        seed: seed of the batch, advantages and old log-probs.
        reference: the attention implementation of the rows path (``"sdpa"`` or ``"eager"``).
        out: where the table is printed (None: nowhere).

    Returns:
        A :class:`CheckReport`; ``report.passed`` says whether every difference is within the
        dtype's tolerance (:data:`TOLERANCES`).
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
    previous = model.config._attn_implementation
    was_training = model.training
    model.eval()  # no dropout: both paths must compute the same function
    try:
        model.set_attn_implementation(reference)
        rows_lp = rows_response_logprobs(model, ids, mask, pw)
        assert isinstance(rows_lp, torch.Tensor)
        old = rows_lp.detach() + 0.05 * torch.randn(rows_lp.shape, generator=gen).to(device)
        rows_loss, rows_grads = _loss_and_grads(model, rows_lp, old, adv, resp_mask)
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        packed_lp = packed_response_logprobs(model, packed)
        assert isinstance(packed_lp, torch.Tensor)
        packed_loss, packed_grads = _loss_and_grads(model, packed_lp, old, adv, resp_mask)
    finally:
        model.set_attn_implementation(previous)
        model.train(was_training)

    keep = resp_mask
    diff = (packed_lp.detach().float() - rows_lp.detach().float()).abs()
    max_lp = float(torch.where(keep, diff, 0.0).max()) if bool(keep.any()) else 0.0
    loss_diff = float((packed_loss - rows_loss).abs())
    worst, worst_name = 0.0, "-"
    for name in sorted(rows_grads.keys() | packed_grads.keys()):
        g, h = rows_grads.get(name), packed_grads.get(name)
        if g is None or h is None:  # a gradient on one path only
            err = float("inf")
        else:
            scale = float(g.abs().max())
            err = float((h - g).abs().max())
            err = err / scale if scale != 0.0 else err
        # NaN sticks (a later finite error must not hide it)
        if not math.isnan(worst) and (math.isnan(err) or err > worst):
            worst, worst_name = err, name
    report = CheckReport(
        dtype=dtype,
        tokens_rows=int(mask.sum()),
        tokens_packed=packed.total_tokens,
        max_logprob_diff=max_lp,
        loss_diff=loss_diff,
        max_grad_error=worst,
        worst_parameter=worst_name,
        tolerances=TOLERANCES.get(dtype, TOLERANCES[torch.float32]),
    )
    tol = report.tolerances
    report.lines = [
        f"dualkv.check: {type(model).__name__}, {dtype}, {device}; rows path "
        f"attn_implementation={reference!r} vs packed 'dualkv'",
        f"  batch: {groups} groups x {n} responses, {report.tokens_rows} row tokens -> "
        f"{report.tokens_packed} packed",
        f"  max |log-prob diff|       {max_lp:.3e}  (tolerance {tol[0]:.0e})",
        f"  |loss diff|               {loss_diff:.3e}  (tolerance {tol[1]:.0e})",
        f"  max grad error / scale    {worst:.3e}  (tolerance {tol[2]:.0e}; {worst_name})",
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
    parser.add_argument("--reference", default="sdpa", choices=["sdpa", "eager"])
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--n", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=24)
    parser.add_argument("--response-len", type=int, default=8)
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
