"""LM-head log-prob benchmark on the GPU: dualkv.response_logprobs vs full logits.

One packed stream of ``--tokens`` tokens whose last ``--responses`` positions are scored (as in a
GRPO step: the hidden state before each response token predicts it), forward + backward through
the LM head (``--hidden`` x ``--vocab``, bf16):

  full     every scored position's logits at once, log_softmax in fp32 (what the standard rows
           and the flex path of bench/model_step.py do)
  chunked  dualkv's chunked computation (fused log-softmax statistics and gradient kernels on
           each chunk's logits), default chunk and the ``--chunks`` given

Reports the median time (host clock around synchronised calls) of the forward and of
forward+backward, the peak memory above the inputs, and the differences to ``full`` (log-probs:
max abs; gradients: relative Frobenius norm).

    python bench/logprobs.py                            # Qwen3-1.7B head, 16384 scored tokens
    python bench/logprobs.py --hidden 2560 --chunks 1024,4096
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

import dualkv
from dualkv.logprobs import logprobs_from_logits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", type=int, help="packed stream length T (default 24576)")
    ap.add_argument("--responses", type=int, help="scored (response) tokens (default 16384)")
    ap.add_argument("--hidden", type=int, help="default 2048")
    ap.add_argument("--vocab", type=int, help="default 151936")
    ap.add_argument("--chunks", default="", help="extra chunk sizes, comma-separated")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cuda",
                    help="cuda; cpu only for a smoke run (then a small default shape)")  # fmt: skip
    args = ap.parse_args()
    dev = torch.device(args.device)
    # The Qwen3-1.7B head on the GPU; a small shape for the CPU smoke run (the full one would
    # need tens of GiB of fp32 logits there).
    cuda = dev.type == "cuda"
    for name, gpu, cpu in (("tokens", 24576, 256), ("responses", 16384, 128),
                           ("hidden", 2048, 64), ("vocab", 151936, 1000)):  # fmt: skip
        if getattr(args, name) is None:
            setattr(args, name, gpu if cuda else cpu)
    if cuda and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU: bench/logprobs.py times the GPU (--device cpu: smoke run)")
    m, t = args.responses, args.tokens
    if not 0 < m < t:
        raise SystemExit(f"--responses must be in (0, --tokens), got {m} and {t}")
    gen = torch.Generator(device=dev).manual_seed(0)
    hidden = torch.randn(t, args.hidden, device=dev, generator=gen) * 0.5
    hidden = hidden.to(torch.bfloat16).requires_grad_()
    weight = torch.randn(args.vocab, args.hidden, device=dev, generator=gen) * 0.02
    weight = weight.to(torch.bfloat16).requires_grad_()
    # One group, one response of m tokens after a prompt of t - m: the packed batch's maps.
    packed = dualkv.pack(
        prompts=[list(range(t - m))],
        responses=[[torch.randint(0, args.vocab, (m,), generator=gen, device=dev).tolist()]],
        device=dev,
    )
    g = torch.randn(1, m, device=dev, generator=gen)

    def full() -> torch.Tensor:
        h = hidden.index_select(0, packed.token_sources)
        lp = logprobs_from_logits(torch.nn.functional.linear(h, weight), packed.token_labels)
        return lp.view(1, m)

    def chunked(chunk: int | None) -> Callable[[], torch.Tensor]:
        return lambda: dualkv.response_logprobs(hidden, weight, packed, chunk_size=chunk)

    variants: list[tuple[str, Callable[[], torch.Tensor]]] = [
        ("full", full),
        ("chunked, default", chunked(None)),
    ]
    variants += [(f"chunked, {c}", chunked(int(c))) for c in args.chunks.split(",") if c]

    results = {}
    for name, fn in variants:
        fwd, tot = [], []
        peak = 0.0
        for i in range(2 + args.repeats):
            hidden.grad = weight.grad = None
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated() if cuda else 0
            t0 = time.perf_counter()
            lp = fn()
            if cuda:
                torch.cuda.synchronize()
            t1 = time.perf_counter()
            (lp * g).sum().backward()
            if cuda:
                torch.cuda.synchronize()
            t2 = time.perf_counter()
            if i >= 2:
                fwd.append(1e3 * (t1 - t0))
                tot.append(1e3 * (t2 - t0))
                if cuda:
                    peak = max(peak, (torch.cuda.max_memory_allocated() - base) / 2**30)
        results[name] = (
            statistics.median(fwd),
            statistics.median(tot),
            peak,
            lp.detach(),
            hidden.grad.float(),
            weight.grad.float(),
        )

    ref = results["full"]
    gpu = torch.cuda.get_device_name() if cuda else "CPU"
    print(f"{gpu}, T={t}, scored {m}, hidden {args.hidden}, "
          f"vocab {args.vocab}, bf16")  # fmt: skip
    print("| variant | fwd ms | fwd+bwd ms | peak GiB | max dlogp | rel d(hidden) | rel d(head) |")
    print("|---|---|---|---|---|---|---|")
    for name, (f, tt, p, lp, gh, gw) in results.items():
        dlp = (lp - ref[3]).abs().max().item()
        dh = ((gh - ref[4]).norm() / ref[4].norm()).item()
        dw = ((gw - ref[5]).norm() / ref[5].norm()).item()
        print(f"| {name} | {f:.2f} | {tt:.2f} | {p:.2f} | {dlp:.1e} | {dh:.1e} | {dw:.1e} |")


if __name__ == "__main__":
    main()
