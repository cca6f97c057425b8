"""Model-level benchmark: one GRPO/DAPO policy-update step of a Qwen3 shape (random weights).

Paths, each on the same model and the same batch of one prompt group (N responses of R tokens
after a P-token prompt), gradient checkpointing on:

* standard       N rows of P+R tokens, HF SDPA (no padding: SDPA takes its fastest causal
                 kernel), full-vocabulary logits of the response positions + log-softmax;
* flex           the packed stream P+NR with FlexAttention and a shared-prefix BlockMask (what
                 mask-based shared-prefix trainers do), full logits of the response tokens;
* flex-chunked   as flex but with DualKV's chunked log-probs (isolates the attention kernel);
* dualkv         the packed stream with attn_implementation="dualkv" and chunked log-probs;
                 checkpointing keeps the attention outputs (no attention forward in the recompute);
* dualkv-recompute  as dualkv, but the checkpoint recompute runs the attention forward again.
* dualkv-sp      as dualkv, through the sequence-parallel code path (dualkv.parallel: sharded
                 batch, Ulysses attention, sharded log-probs, gradient all-reduce) over a process
                 group of size 1 that this script initialises (nccl on CUDA, gloo on CPU): what
                 the SP path costs when it does not split anything.

With ``--compile`` every decoder layer is compiled with ``torch.compile`` (regional compilation,
as trainers do) in every path, so the model's own elementwise code (RMSNorm, RoPE, SwiGLU,
residuals) is fused the same way around each attention.

Per path: median step time (pack + forward + log-probs + loss + backward), peak memory, and MFU
on the *useful* FLOPs of the packed layout (dense layers and LM head on the packed tokens, DualKV
attention FLOPs, x3 / x3.5 for forward+backward, recomputation not counted) over the GPU's dense
bf16 peak (--peak-tflops, 989 for H100/H200 SXM).

    python bench/model_step.py                                   # the issue's full table
    python bench/model_step.py --presets 1.7b --shapes 16,8192,1024 --paths flex,dualkv
    python bench/model_step.py --presets 1.7b --shapes 16,8192,1024 --paths flex,dualkv --compile
    python bench/model_step.py --presets 1.7b --shapes 16,8192,1024 --paths dualkv,dualkv-sp
    python bench/model_step.py --preset-tiny-cpu                 # a smoke run on CPU
    python bench/model_step.py ... --out bench/RESULTS.md        # append the table

OOM in a path is reported as such and the other paths go on.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import statistics
import sys
import time
import traceback
from typing import Any

import torch

import dualkv
from dualkv import parallel
from dualkv.grpo_demo import build_model
from dualkv.integrations.transformers import enable_gradient_checkpointing, packed_hidden_states
from dualkv.logprobs import logprobs_from_logits, response_logprobs
from dualkv.losses import dapo_loss, group_advantages
from dualkv.packing import pack_rows

ALL_PATHS = ("standard", "flex", "flex-chunked", "dualkv", "dualkv-recompute", "dualkv-sp")
DEFAULT_SHAPES = ("16,8192,1024", "32,4096,2048", "8,16384,2048")


def make_rows(n: int, p: int, r: int, vocab: int, device: torch.device, seed: int):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab, (p,), generator=g)
    resp = torch.randint(0, vocab, (n, r), generator=g)
    ids = torch.cat([prompt.expand(n, p), resp], dim=1).to(device)
    mask = torch.ones_like(ids)
    gid = torch.zeros(n, dtype=torch.int64, device=device)
    rewards = torch.rand(n, generator=g).to(device)
    return ids, mask, gid, group_advantages(rewards, gid)


def flex_block_mask(layout: dualkv.Layout, device: torch.device):
    """FlexAttention BlockMask of the shared-prompt layout (same rule as DualKV's)."""
    from torch.nn.attention.flex_attention import create_block_mask

    seg, grp = [], []
    s = 0
    for g, (p, rs) in enumerate(zip(layout.prefix_lens, layout.response_lens, strict=True)):
        seg.append(torch.full((p,), -1, dtype=torch.int32))
        grp.append(torch.full((p + sum(rs),), g, dtype=torch.int32))
        for r in rs:
            seg.append(torch.full((r,), s, dtype=torch.int32))
            s += 1
    seg_t = torch.cat(seg).to(device)
    grp_t = torch.cat(grp).to(device)

    def mask_mod(b, h, q, kv):
        same_group = grp_t[q] == grp_t[kv]
        kv_prompt = seg_t[kv] == -1
        q_prompt = seg_t[q] == -1
        causal = kv <= q
        own = (seg_t[q] == seg_t[kv]) & causal
        return same_group & ((kv_prompt & (~q_prompt | causal)) | (~q_prompt & own))

    t = layout.total_tokens
    return create_block_mask(mask_mod, 1, None, t, t, device=device)


def useful_flops(model: torch.nn.Module, layout: dualkv.Layout, resp_tokens: int) -> float:
    """fwd+bwd FLOPs of the useful work of a packed step (no recomputation)."""
    cfg = model.config
    t = layout.total_tokens
    dense = 0
    for layer in model.model.layers:
        for mod in layer.modules():
            if isinstance(mod, torch.nn.Linear):
                dense += mod.in_features * mod.out_features
    dense_flops = 6.0 * t * dense
    head_flops = 6.0 * resp_tokens * cfg.hidden_size * cfg.vocab_size
    attn = layout.flops(cfg.head_dim, cfg.num_attention_heads)
    attn_flops = 3.5 * attn * cfg.num_hidden_layers
    return dense_flops + head_flops + attn_flops


def compile_layers(model: torch.nn.Module) -> None:
    """``torch.compile`` each decoder layer in place (one graph per layer, reused by all layers)."""
    import torch._dynamo

    # One compiled graph per (path, shape): allow more than dynamo's default of 8.
    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    setattr(cfg, name, max(64, getattr(cfg, name)))
    for layer in model.model.layers:
        layer.compile()


def step(model, path: str, ids, mask, gid, adv, p: int, old: torch.Tensor) -> torch.Tensor:
    """One timed step of ``path``; returns the loss."""
    r = ids.shape[1] - p
    if path == "standard":
        model.set_attn_implementation("sdpa")
        out = model(input_ids=ids, use_cache=False, logits_to_keep=r + 1)
        logits = out.logits[:, -(r + 1) : -1]
        lp = logprobs_from_logits(logits, ids[:, p:])
        del out, logits
        resp_mask = mask[:, p:].bool()
    else:
        packed = pack_rows(ids, mask, p, gid)
        resp_mask = packed.response_mask
        head = model.get_output_embeddings().weight
        if path == "dualkv-sp":
            model.set_attn_implementation("dualkv")
            lp = parallel.sequence_parallel_logprobs(model, packed)
            loss, _ = dapo_loss(lp, old, adv, resp_mask)
            loss.backward()
            parallel.all_reduce_gradients(model.parameters())
            return loss.detach()
        if path.startswith("dualkv"):
            model.set_attn_implementation("dualkv")
            hidden = packed_hidden_states(model, packed)
        else:
            model.set_attn_implementation("flex_attention")
            block_mask = flex_block_mask(packed.layout, ids.device)
            out = model.model(input_ids=packed.input_ids, position_ids=packed.position_ids,
                              attention_mask=block_mask, use_cache=False)  # fmt: skip
            hidden = out.last_hidden_state
        if path == "flex":  # full logits of every response token at once
            h = hidden[0].index_select(0, packed.token_sources)
            logits = torch.nn.functional.linear(h, head)
            flat = logprobs_from_logits(logits, packed.token_labels)
            lp = packed.scatter_tokens(flat)
            del h, logits
        else:
            lp = response_logprobs(hidden, head, packed)
    loss, _ = dapo_loss(lp, old, adv, resp_mask)
    loss.backward()
    return loss.detach()


def init_group_of_one(device: torch.device) -> None:
    """The default process group with this process alone (for the dualkv-sp path)."""
    import socket

    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def checkpointing_for(model, path: str) -> None:
    """Gradient checkpointing as each path runs it: DualKV keeps its attention outputs (the
    selective policy would only add its per-op dispatch cost to the other paths)."""
    enable_gradient_checkpointing(model, keep_attention=path in ("dualkv", "dualkv-sp"))


def profiled_step(model, path, ids, mask, gid, adv, p, old):  # noqa: ANN201
    """One step of ``path`` under torch.profiler (CPU and CUDA); returns the profiler."""
    from torch.profiler import ProfilerActivity, profile

    model.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step(model, path, ids, mask, gid, adv, p, old)
        torch.cuda.synchronize()
    model.zero_grad(set_to_none=True)
    return prof


def profile_step(model, path, ids, mask, gid, adv, p, old, top: int) -> None:
    """One more step under torch.profiler: the GPU time per kernel, largest first."""
    prof = profiled_step(model, path, ids, mask, gid, adv, p, old)
    print(f"-- profile: {path} --")
    table = prof.key_averages().table(
        sort_by="self_device_time_total", row_limit=top, max_name_column_width=70
    )
    print(table)


def bench_path(model, path, ids, mask, gid, adv, p, old, warmup, repeats, device):
    times = []
    loss = None
    torch.cuda.empty_cache() if device.type == "cuda" else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    try:
        for i in range(warmup + repeats):
            model.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            loss = step(model, path, ids, mask, gid, adv, p, old)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    except torch.OutOfMemoryError:
        error = "OOM"
    except Exception as exc:  # report and go on with the other paths
        traceback.print_exc()
        error = f"error: {type(exc).__name__}"
    else:
        error = None
    if error is not None:
        model.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache() if device.type == "cuda" else None
        return {"path": path, "error": error}
    peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else None
    model.zero_grad(set_to_none=True)
    return {"path": path, "time": statistics.median(times), "peak": peak, "loss": float(loss)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--presets", default="1.7b,4b", help="Qwen3 shapes (dualkv.grpo_demo.PRESETS)")
    ap.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), help="N,P,R triples")
    ap.add_argument("--paths", default="standard,flex,dualkv", help=f"subset of {ALL_PATHS}")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-grad-ckpt", action="store_true")
    ap.add_argument("--compile", action="store_true", help="torch.compile each decoder layer")
    ap.add_argument("--layers", type=int, help="override the layer count (quick runs)")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the GPU")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset-tiny-cpu", action="store_true", help="smoke run: tiny shape on CPU")
    ap.add_argument("--out", help="append the markdown table to this file")
    ap.add_argument("--profile", type=int, default=0, metavar="K",
                    help="profile one more step per path: its top K GPU kernels")  # fmt: skip
    args = ap.parse_args(argv)
    if args.preset_tiny_cpu:
        args.presets, args.shapes, args.device = "tiny", ["4,64,16"], "cpu"
        args.paths, args.warmup, args.repeats = "standard,dualkv", 0, 1
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    paths = [x for x in args.paths.split(",") if x]
    for x in paths:
        if x not in ALL_PATHS:
            ap.error(f"unknown path {x!r}; choose from {ALL_PATHS}")
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    if "dualkv-sp" in paths:
        init_group_of_one(device)
    rows: list[dict[str, Any]] = []
    header = ("| model | N, P, R | rho | path | step time | peak memory | MFU | vs standard |\n"
              "|---|---|---|---|---|---|---|---|")  # fmt: skip
    print(header, flush=True)
    for preset in args.presets.split(","):
        overrides = {"num_hidden_layers": args.layers} if args.layers else None
        model = build_model(preset, device, dtype, overrides=overrides)
        model.train()
        if args.compile:
            compile_layers(model)
        for shape in args.shapes:
            n, p, r = (int(x) for x in shape.split(","))
            ids, mask, gid, adv = make_rows(
                n, p, r, model.config.vocab_size, device, seed=n + p + r
            )
            layout = dualkv.Layout([p], [[r] * n])
            flops = useful_flops(model, layout, n * r)
            old = torch.zeros(n, r, device=device)  # on-policy-ish: ratio = exp(logp)
            results = []
            for path in paths:
                if not args.no_grad_ckpt:
                    checkpointing_for(model, path)
                results.append(bench_path(model, path, ids, mask, gid, adv, p, old,
                                          args.warmup, args.repeats, device))  # fmt: skip
            if args.profile and device.type == "cuda":
                for res in results:
                    if "time" in res:
                        if not args.no_grad_ckpt:
                            checkpointing_for(model, res["path"])
                        try:
                            profile_step(model, res["path"], ids, mask, gid, adv, p, old,
                                         args.profile)  # fmt: skip
                        except Exception:  # the timings above still get printed
                            traceback.print_exc()
                            model.zero_grad(set_to_none=True)
            std = next((x for x in results if x["path"] == "standard" and "time" in x), None)
            for res in results:
                if "time" in res:
                    t = res["time"]
                    mfu = flops / t / (args.peak_tflops * 1e12)
                    peak = f"{res['peak'] / 2**30:.1f} GiB" if res["peak"] is not None else "n/a"
                    speed = f"{std['time'] / t:.2f}x" if std else "-"
                    cells = [f"{t:.3f} s", peak, f"{100 * mfu:.1f}%", speed]
                else:
                    cells = [res["error"], "-", "-", "-"]
                label = res["path"] + (" (compiled)" if args.compile else "")
                line = (f"| Qwen3-{preset} | {n}, {p}, {r} | {layout.token_reduction:.2f} | "
                        f"{label} | " + " | ".join(cells) + " |")  # fmt: skip
                print(line, flush=True)
                rows.append({"line": line, **res})
            del ids, mask, gid, adv
        del model
        gc.collect()
        torch.cuda.empty_cache() if device.type == "cuda" else None
    if args.out:
        cmd = "python bench/model_step.py " + " ".join(argv if argv is not None else sys.argv[1:])
        with open(args.out, "a") as f:
            f.write(f"\n## Model step (GRPO/DAPO policy update), {gpu}, "
                    f"{datetime.date.today().isoformat()}\n\n")  # fmt: skip
            f.write(f"Command: `{cmd}`; torch {torch.__version__}; bf16 weights and grads; "
                    f"gradient checkpointing {'off' if args.no_grad_ckpt else 'on'}; "
                    f"decoder layers {'compiled' if args.compile else 'eager'}; MFU on the "
                    "useful FLOPs of the packed layout over "
                    f"{args.peak_tflops:.0f} TFLOP/s.\n\n")  # fmt: skip
            f.write(header + "\n" + "\n".join(x["line"] for x in rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
