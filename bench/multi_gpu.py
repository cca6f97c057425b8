"""Multi-GPU run (issue 18): Ulysses sequence parallelism (``dualkv.parallel``) with FSDP2.

One script, launched with ``torchrun --nproc-per-node K`` (backend nccl on GPUs, gloo on CPU for
a dry run; a plain ``python`` start is a group of one). Parts (``--parts``, default all):

* ``exact``  exactness on the backend, SP = world size against SP = 1 on the same inputs (every
  rank computes the SP = 1 reference itself on the full batch):
  - DualKV attention on several groups with uneven R (and a 0- and a 1-token response), GQA with
    and without KV-head replication, window + softcap, lse: outputs, lse, dq, dk, dv;
  - a packed GRPO/DAPO step of a small Qwen3 (and of a small Gemma 4 text stack: sliding and full
    layers, head dims as the run's config), log-probs, entropy, loss (DAPO + entropy bonus) and
    every parameter gradient, three ways: SP with replicated weights and
    ``all_reduce_gradients``; SP + FSDP2 (``fully_shard`` over the group, ``grad_scale = sp``,
    gradient checkpointing keeping the attention outputs: the path ``qwen``/``gemma`` time);
  max abs and max relative (to the reference's max |x|) differences, and pass/fail against the
  dtype's noise, FlashAttention-style: the tolerance is ``k x noise + u x scale`` (k = 2 for
  outputs, lse, log-probs, loss; 3 for gradients; u the dtype's unit roundoff), where *noise* is
  the error of a plain implementation in the run's dtype against a high-precision oracle on the
  same inputs (attention: the unshared rows in plain PyTorch vs the same in float64; model: the
  SP = 1 packed step vs the unshared rows with SDPA on a float64 (CPU) / float32 (GPU) copy of the
  model). In float32 on CPU that is tight (~1e-6 of the scale); in bf16 it is bf16's noise.
* ``comm``   the all-to-alls of one decoder layer (forward: q, k, v in and the output back;
  backward: the output gradient in and dq, dk, dv back), timed for the Qwen3 preset's layer (and
  Gemma 4's sliding and full layers) at the first shape's packed length, next to the formula of
  docs/trainers.md ``(sp-1)/sp^2 * T * D * b * (2 Hq + 2 Hkv')`` bytes sent per rank and direction.
* ``qwen``   a Qwen3-shaped model (``--preset``, default 8b: real widths, ``--layers`` cut) on one
  prompt group per step (N responses of R after a P-token prompt, ``--shapes``) with SP = world
  size (``--sp`` < world: dp = world/sp data-parallel replicas, each its own group) + FSDP2
  (``fully_shard`` of every decoder layer and of the root over *all* ranks, as veRL's FSDP mesh;
  it averages the gradients, hence ``grad_scale = sp``), bf16 weights and gradients (no mixed
  precision policy), gradient checkpointing; step time (forward + log-probs + loss + backward with
  FSDP's reduce-scatter, no optimizer) and peak memory per GPU for
  - ``dualkv``  the packed stream ``P + N R`` through ``dualkv.parallel`` (checkpointing keeps the
    attention outputs);
  - ``verl``    veRL-style Ulysses on the N rows: the rows in veRL's remove-padding layout (one
    stream of rows ``P + R`` each) in micro-batches of ``--rows-tokens-per-gpu x sp`` tokens
    (veRL's ``max_token_len_per_gpu`` with dynamic batch size), the stream sharded by tokens, the
    all-to-all of the rows' heads, and DualKV's kernel as plain causal varlen attention per row
    (every row its own group, no shared prompt: what flash-attn's varlen kernel computes;
    flash-attn is not installed on the GPU machine), as ``bench/model_step.py``'s verl path and
    ``bench/verl_update.py``'s ``dualkv_rows``; full recompute under checkpointing as veRL's
    (``--rows-keep-attention`` keeps the attention outputs instead); the log-probs of the response
    tokens only, with DualKV's chunked log-prob op (favourable to the baseline);
* ``gemma``  the Gemma-4-31B-shaped stack (``bench/model_step.py``'s ``gemma4-31b`` preset,
  ``--gemma-layers`` cut, 5 sliding : 1 full, last full) at ``--gemma-shapes`` (default
  16,65536,2048) with SP = world size, the same step (``--gemma-paths dualkv`` default; ``verl``
  as above, the kernel as windowed/full causal varlen attention per row).

Every result is printed as a markdown table and appended as a JSON line to ``--json`` (with world
size, sp, dp, GPU, date, command). ``--summarize FILE`` (no launch) reads the JSON lines of runs
at 1, 2, 4 GPUs and prints the scaling table: speed-up ``t1 / tK`` and strong-scaling efficiency
``t1 / (K tK)`` per path and shape.

GPU machines (nvidia-h200-x2 / -x4; torchrun is ``python3 -m torch.distributed.run`` there):
NVLink multicast must stay off (the device notes): export ``NCCL_NVLS_ENABLE=0
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1`` (the script also sets these three in
its own environment before the process group exists)::

    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    R="python3 -m torch.distributed.run --standalone"
    $R --nproc-per-node 4 bench/multi_gpu.py --json $OUT/multi_gpu.jsonl   # x4 (x2: 2)
    $R --nproc-per-node 2 bench/multi_gpu.py --parts qwen,gemma --json $OUT/multi_gpu.jsonl
    $R --nproc-per-node 1 bench/multi_gpu.py --parts qwen,gemma --json $OUT/multi_gpu.jsonl
    python3 bench/multi_gpu.py --summarize $OUT/multi_gpu.jsonl           # scaling table

(``bash scripts/gpu_check.sh build multigpu`` builds the package and runs exactly these.) A part
that fails is reported and the next one runs; a rank left waiting in a collective ends after
``DUALKV_PG_TIMEOUT`` seconds (default 300). CPU
dry run (gloo, tiny shapes)::

    torchrun --standalone --nproc-per-node 2 bench/multi_gpu.py --device cpu --preset tiny \
        --gemma-preset gemma4-tiny --layers 2 --shapes 4,64,16 --gemma-shapes 4,64,16 \
        --warmup 0 --repeats 1 --rows-tokens-per-gpu 80
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
import functools
import json
import math
import os
import random
import socket
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

# NVLink multicast off (device notes: it can put a shared host's GPUs out of service); set before
# torch.distributed creates a communicator, for this process and what it starts
SAFE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
for _k, _v in SAFE_ENV.items():
    os.environ[_k] = _v

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import dualkv  # noqa: E402
from dualkv import parallel  # noqa: E402
from dualkv.integrations import transformers as dkt  # noqa: E402
from dualkv.losses import aggregate, dapo_loss  # noqa: E402
from dualkv.packing import PackedBatch, pack_rows, rows_from_lists  # noqa: E402
from dualkv.reference import unshared_attention  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model_step import (  # noqa: E402
    GEMMA4_PRESETS,
    _layer_attention,
    build_any,
    make_rows,
    useful_flops,
)

PARTS = ("exact", "comm", "qwen", "gemma")
TEMPERATURE = 0.9
ENTROPY_COEF = 0.01

# part 1's models: "tiny" for CPU dry runs (any head dim), "small" for GPUs (the kernel's head
# dims 128 / 256 / 512); Hq a multiple of 8 (SP up to 8), Hkv smaller than 4 somewhere (KV-head
# replication at SP = 4)
EXACT_QWEN: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=True),
    "small": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=128, vocab_size=32768,
                  tie_word_embeddings=False),
}  # fmt: skip
EXACT_GEMMA: dict[str, dict[str, Any]] = {
    "tiny": dict(GEMMA4_PRESETS["gemma4-tiny"], num_attention_heads=8, num_key_value_heads=4,
                 num_global_key_value_heads=2),
    "small": dict(GEMMA4_PRESETS["gemma4-tiny"], hidden_size=512, intermediate_size=1024,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=256, global_head_dim=512,
                  num_global_key_value_heads=2, sliding_window=96, vocab_size=8192),
}  # fmt: skip
# (Hq, Hkv, D, options) of the attention cases
EXACT_HEADS: dict[str, list[tuple[int, int, int, dict[str, Any]]]] = {
    "tiny": [(8, 2, 16, {}), (8, 1, 32, {"window": 9, "softcap": 3.0}), (8, 8, 16, {}),
             (16, 4, 8, {})],
    "small": [(32, 8, 128, {}), (16, 2, 128, {}), (32, 16, 256, {"window": 200, "softcap": 20.0}),
              (32, 4, 512, {}), (8, 1, 64, {})],
}  # fmt: skip
# (prompt range, responses per group, response range) of the random layouts
EXACT_LENGTHS = {"tiny": ((4, 40), (2, 4), (2, 24)), "small": ((256, 1024), (2, 5), (16, 384))}


# --- the process group --------------------------------------------------------------------------
@dataclasses.dataclass
class Ctx:
    rank: int
    world: int
    device: torch.device
    dtype: torch.dtype
    gpu: str
    json_path: str | None
    command: str
    records: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def init(device_arg: str, dtype_arg: str | None, json_path: str | None) -> Ctx:
    """The default process group: torchrun's environment, or a group of one (plain python)."""
    cuda = device_arg == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (use --device cpu for a dry run)")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    backend = "nccl" if cuda else "gloo"
    timeout = datetime.timedelta(seconds=int(os.environ.get("DUALKV_PG_TIMEOUT", "300")))
    kwargs: dict[str, Any] = {"timeout": timeout}
    if cuda:
        kwargs["device_id"] = device
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, **kwargs)
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1, **kwargs)  # fmt: skip
    if not cuda:
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    name = dtype_arg or ("bfloat16" if cuda else "float32")
    gpu = torch.cuda.get_device_name(device) if cuda else "CPU"
    cmd = f"torchrun --nproc-per-node {dist.get_world_size()} bench/multi_gpu.py "
    return Ctx(dist.get_rank(), dist.get_world_size(), device, getattr(torch, name), gpu,
               json_path, cmd + " ".join(sys.argv[1:]))  # fmt: skip


def say(ctx: Ctx, *lines: str) -> None:
    if ctx.rank == 0:
        for line in lines:
            print(line, flush=True)


def emit(ctx: Ctx, record: dict[str, Any]) -> None:
    """Keep a result and append it (rank 0) as one JSON line to --json."""
    record = {
        "world": ctx.world, "gpu": ctx.gpu, "dtype": str(ctx.dtype).removeprefix("torch."),
        "date": datetime.date.today().isoformat(), "torch": torch.__version__,
        "command": ctx.command, **record,
    }  # fmt: skip
    ctx.records.append(record)
    if ctx.rank == 0 and ctx.json_path:
        with open(ctx.json_path, "a") as f:
            f.write(json.dumps(record) + "\n")


def sync(ctx: Ctx) -> None:
    if ctx.cuda:
        torch.cuda.synchronize(ctx.device)


def all_max(ctx: Ctx, values: list[float], group: Any = None) -> list[float]:
    """Element-wise max over the group (one collective)."""
    t = torch.tensor(values, dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return out + ["| " + " | ".join(r) + " |" for r in rows]


def section(header: list[str], rows: list[list[str]]) -> list[str]:
    """A blank line and the markdown table of ``rows``; nothing when there are none."""
    return ["", *table(header, rows)] if rows else []


# --- part 1: exactness --------------------------------------------------------------------------
UNIT_ROUNDOFF = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8,
                 torch.float16: 2.0**-11}  # fmt: skip


@dataclasses.dataclass
class Check:
    """One compared quantity: SP = world vs SP = 1 (``diff``), the run dtype's noise against the
    oracle (``noise``), the reference's scale (max |x|) and the factor k of the tolerance."""

    case: str
    what: str
    diff: float
    noise: float
    scale: float
    k: float
    u: float
    extra_ok: bool = True  # e.g. padding rows exactly zero

    @property
    def tol(self) -> float:
        return self.k * self.noise + self.u * self.scale

    @property
    def ok(self) -> bool:
        return self.extra_ok and math.isfinite(self.diff) and self.diff <= self.tol

    def row(self) -> list[str]:
        rel = self.diff / self.scale if self.scale > 0 else 0.0
        return [self.case, self.what, f"{self.diff:.2e}", f"{rel:.2e}", f"{self.noise:.2e}",
                f"{self.tol:.2e}", "pass" if self.ok else "FAIL"]  # fmt: skip


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    d = (a.double() - b.double()).abs().max().item()
    return d if math.isfinite(d) else float("inf")


def _scale(x: torch.Tensor) -> float:
    return x.double().abs().max().item() if x.numel() else 0.0


def random_layout(rng: random.Random, config: str, world: int) -> tuple[list[int], list[list[int]]]:
    (p_lo, p_hi), (n_lo, n_hi), (r_lo, r_hi) = EXACT_LENGTHS[config]
    prefix = [rng.randint(p_lo, p_hi) for _ in range(3)]
    responses = [[rng.randint(r_lo, r_hi) for _ in range(rng.randint(n_lo, n_hi))]
                 for _ in range(3)]  # fmt: skip
    responses[1][0], responses[2][-1] = 0, 1  # an empty and a one-token response
    if (sum(prefix) + sum(map(sum, responses))) % world == 0:  # padding on the last rank
        prefix[0] += 1
    return prefix, responses


def _attend(fn: Callable[..., Any], xs: tuple[torch.Tensor, ...], d_out: torch.Tensor,
            d_lse: torch.Tensor) -> list[torch.Tensor]:  # fmt: skip
    """``[out, lse, dq, dk, dv]`` of ``fn(q, k, v)`` (backward of ``<out, d_out> + <lse, d_lse>``
    in float64)."""
    leaves = [x.detach().clone().requires_grad_() for x in xs]
    out, lse = fn(*leaves)
    ((out.double() * d_out.double()).sum() + (lse.double() * d_lse.double()).sum()).backward()
    grads = [x.grad for x in leaves]
    assert all(g is not None for g in grads)
    return [out.detach(), lse.detach(), *grads]  # type: ignore[list-item]


def exact_attention(ctx: Ctx, config: str, seed: int) -> list[Check]:
    """DualKV attention: SP over the default group vs the single-device call on every rank."""
    rng = random.Random(seed)
    checks: list[Check] = []
    u = UNIT_ROUNDOFF[ctx.dtype]
    for n, (hq, hkv, d, opts) in enumerate(EXACT_HEADS[config]):
        if hq % ctx.world:
            say(ctx, f"(attention case Hq={hq}: not a multiple of SP={ctx.world}, skipped)")
            continue
        prefix, responses = random_layout(rng, config, ctx.world)
        layout = dualkv.Layout(prefix, responses, device=ctx.device)
        t = layout.total_tokens
        g = torch.Generator().manual_seed(seed + n)
        q, k, v = (torch.randn(t, h, d, generator=g).to(ctx.device, ctx.dtype)
                   for h in (hq, hkv, hkv))  # fmt: skip
        d_out = torch.randn(t, hq, d, generator=g).to(ctx.device, ctx.dtype)
        d_lse = torch.randn(hq, t, generator=g).to(ctx.device)
        scale = 1.0 / math.sqrt(d)
        m = parallel.kv_replication(hq, hkv, ctx.world)
        name = (f"attn {len(prefix)} groups T={t} Hq/Hkv/D={hq}/{hkv}/{d}"
                + (f" (KV x{m})" if m > 1 else "")
                + "".join(f" {k_}={v_}" for k_, v_ in opts.items()))  # fmt: skip

        # SP = 1 on the full stream (every rank), DualKV's kernel
        fn: Callable[..., Any] = functools.partial(
            dualkv.attention, layout=layout, softmax_scale=scale, return_lse=True, **opts
        )
        ref = _attend(fn, (q, k, v), d_out, d_lse)
        # the noise: plain PyTorch on the unshared rows in the run dtype vs in float64
        fn = functools.partial(
            unshared_attention,
            prefix_lens=list(layout.prefix_lens),
            response_lens=[list(r) for r in layout.response_lens],
            scale=scale,
            window=opts.get("window"),
            softcap=float(opts.get("softcap", 0.0)),
        )
        plain = _attend(fn, (q, k, v), d_out, d_lse)
        oracle = _attend(fn, (q.double(), k.double(), v.double()), d_out, d_lse)
        # SP = world: this rank's shard, NaN on the padding (must never reach the kernel)
        sl = parallel.ShardedLayout(layout)
        shards = tuple(sl.shard(x, pad_value=float("nan")) for x in (q, k, v))
        fn = functools.partial(
            parallel.ulysses_attention, layout=sl, softmax_scale=scale, return_lse=True, **opts
        )
        got = _attend(fn, shards, sl.shard(d_out), sl.shard(d_lse, dim=1))
        s0, real = sl.start, sl.real_tokens
        mine = [ref[0][s0 : s0 + real], ref[1][:, s0 : s0 + real]] + [
            x[s0 : s0 + real] for x in ref[2:]
        ]
        gots = [got[0][:real], got[1][:, :real]] + [x[:real] for x in got[2:]]
        pads = [got[0][real:], got[1][:, real:]] + [x[real:] for x in got[2:]]
        diffs = [_maxdiff(a, b) for a, b in zip(gots, mine)]
        pad_bad = [float(not bool((p == 0).all())) for p in pads]
        red = all_max(ctx, diffs + pad_bad)
        for i, what in enumerate(("out", "lse", "dq", "dk", "dv")):
            noise = _maxdiff(plain[i], oracle[i])
            checks.append(Check(name, what, red[i], noise, _scale(ref[i]), 2.0 if i < 2 else 3.0,
                                u, extra_ok=red[5 + i] == 0.0))  # fmt: skip
    return checks


def init_weights(model: torch.nn.Module, seed: int) -> None:
    """Random weights that keep activations and logits near unit scale (not flat log-probs):
    every matrix N(0, 1/fan_in) (embeddings N(0, 1/H): Gemma scales them by sqrt(H))."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                w = torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1])
                p.copy_(w.to(p.dtype))


class Policy(torch.nn.Module):
    """The SP policy forward as one module call (the FSDP2 root): the decoder on this rank's
    shard and the sharded log-probs, so FSDP gathers the embeddings, final norm and LM head
    around it."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, packed: PackedBatch, group: Any, grad_scale: float,
                temperature: float = TEMPERATURE, return_entropy: bool = False) -> Any:  # fmt: skip
        out = dkt.sequence_parallel_logprobs(
            self.model, packed, group, temperature, return_entropy=return_entropy,
            grad_scale=grad_scale,
        )  # fmt: skip
        # fresh tensors, not views, for FSDP2's output hooks
        return tuple(t.clone() for t in out) if isinstance(out, tuple) else out.clone()


def shard_fsdp(model: torch.nn.Module, mesh: Any) -> Policy:
    """FSDP2: every decoder layer its own unit, the root (embeddings, norm, head) one more."""
    from torch.distributed.fsdp import fully_shard

    policy = Policy(model)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(policy, mesh=mesh)
    return policy


def _loss(lp: torch.Tensor, ent: torch.Tensor | None, old: torch.Tensor, adv: torch.Tensor,
          mask: torch.Tensor, num_tokens: float | None = None) -> torch.Tensor:  # fmt: skip
    loss = dapo_loss(lp, old, adv, mask, num_tokens=num_tokens)[0]
    if ent is not None:
        loss = loss - ENTROPY_COEF * aggregate(ent, mask, num_tokens=num_tokens)
    return loss


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad
            out[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return out


def exact_model(ctx: Ctx, family: str, config: str, seed: int) -> list[Check]:
    """A packed GRPO/DAPO step: SP = world (replicated weights; FSDP2) vs SP = 1, with the
    unshared rows in higher precision as the noise oracle."""
    from transformers import AutoModelForCausalLM, Gemma4TextConfig, Qwen3Config

    fields = EXACT_QWEN[config] if family == "qwen3" else EXACT_GEMMA[config]
    hq = fields["num_attention_heads"]
    if hq % ctx.world:
        say(ctx, f"({family}: Hq={hq} not a multiple of SP={ctx.world}, skipped)")
        return []
    cfg_cls = Qwen3Config if family == "qwen3" else Gemma4TextConfig
    cfg = cfg_cls(**dict(fields, attention_dropout=0.0, max_position_embeddings=8192))
    with torch.device(ctx.device):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="dualkv",
                                                 dtype=ctx.dtype)  # fmt: skip
    init_weights(model, seed)
    model.train()

    rng = random.Random(seed)
    prefix, resp_lens = random_layout(rng, config, ctx.world)
    vocab = fields["vocab_size"]
    prompts = [[rng.randrange(vocab) for _ in range(p)] for p in prefix]
    responses = [[[rng.randrange(vocab) for _ in range(r)] for r in rs] for rs in resp_lens]
    packed = dualkv.pack(prompts=prompts, responses=responses, device=ctx.device)
    mask = packed.response_mask
    g = torch.Generator().manual_seed(seed)
    gid = torch.tensor([i for i, rs in enumerate(responses) for _ in rs])
    adv = dualkv.group_advantages(torch.rand(len(gid), generator=g), gid).to(ctx.device)
    with torch.no_grad():
        lp0 = dkt.packed_response_logprobs(model, packed, temperature=TEMPERATURE)
    noise_old = 0.3 * torch.randn(lp0.shape, generator=g).to(ctx.device)
    old = ((lp0.float() + noise_old) * mask).detach()  # ratio near 1: both clip sides active
    fresh = copy.deepcopy(model)  # untouched copy for the FSDP2 run

    def step(m: torch.nn.Module, fn: Callable[..., Any], *fargs: Any, sum_grads: bool = False
             ) -> tuple[torch.Tensor, ...] | Any:  # fmt: skip
        m.zero_grad(set_to_none=True)
        lp, ent = fn(*fargs, temperature=TEMPERATURE, return_entropy=True)
        loss = _loss(lp, ent, old.to(lp), adv.to(lp), mask)
        loss.backward()
        if sum_grads:
            parallel.all_reduce_gradients(m.parameters())
        return lp.detach(), ent.detach(), loss.detach(), _grads(m)

    ref = step(model, dkt.packed_response_logprobs, model, packed)
    sp = step(model, dkt.sequence_parallel_logprobs, model, packed, None, sum_grads=True)

    from torch.distributed.device_mesh import init_device_mesh

    dkt.enable_gradient_checkpointing(fresh, keep_attention=True)
    policy = shard_fsdp(fresh, init_device_mesh(ctx.device.type, (ctx.world,)))
    fsdp = step(fresh, policy, packed, None, float(ctx.world))

    # the oracle: unshared rows, HF SDPA, the same weights in float64 (CPU) / float32 (GPU)
    hi = torch.float64 if not ctx.cuda else torch.float32
    oracle_model = copy.deepcopy(model).to(hi)
    oracle_model.set_attn_implementation("sdpa")
    ids, amask, pw, _ = rows_from_lists(prompts, responses, device=ctx.device)
    oracle = step(oracle_model, dkt.rows_response_logprobs, oracle_model, ids, amask, pw)

    u = UNIT_ROUNDOFF[ctx.dtype]
    checks: list[Check] = []
    name0 = (f"{family} {cfg.num_hidden_layers}L T={packed.total_tokens} "
             f"rows={packed.num_rows} Hq/Hkv={hq}/{fields['num_key_value_heads']}")  # fmt: skip
    for label, got in (("SP", sp), ("SP+FSDP2+ckpt", fsdp)):
        name = f"{name0} {label}"
        for i, what in enumerate(("log-probs", "entropy", "loss")):
            a, b, o = got[i], ref[i], oracle[i]
            if i < 2:
                a, b, o = a[mask], b[mask], o[mask]
            checks.append(Check(name, what, _maxdiff(a, b), _maxdiff(o, b), _scale(b), 2.0, u))
        # gradients: one check per parameter; the worst (largest diff / tolerance) is reported
        assert got[3].keys() == ref[3].keys() == oracle[3].keys(), "parameter sets differ"
        per = [Check(name, f"grad {p}", _maxdiff(got[3][p], gr), _maxdiff(oracle[3][p], gr),
                     _scale(gr), 3.0, u) for p, gr in ref[3].items()]  # fmt: skip
        worst = max(per, key=lambda c: c.diff / max(c.tol, 1e-300))
        worst.what = f"grads ({len(per)} params; worst: {worst.what.removeprefix('grad ')})"
        worst.extra_ok = all(c.ok for c in per)
        checks.append(worst)
    # every rank holds the same numbers: report the worst rank
    red = all_max(ctx, [c.diff for c in checks])
    flags = all_max(ctx, [0.0 if c.ok else 1.0 for c in checks])
    for c, d, f in zip(checks, red, flags):
        c.diff = d
        c.extra_ok = c.extra_ok and f == 0.0
    return checks


def part_exact(ctx: Ctx, args: argparse.Namespace) -> bool:
    say(ctx, f"\n## Exactness: SP = {ctx.world} vs SP = 1, {ctx.dtype}, {ctx.gpu} "
        f"({'nccl' if ctx.cuda else 'gloo'})\n")  # fmt: skip
    checks = exact_attention(ctx, args.config, args.seed)
    checks += exact_model(ctx, "qwen3", args.config, args.seed + 1)
    gemma_ok = True
    try:
        checks += exact_model(ctx, "gemma4", args.config, args.seed + 2)
    except NotImplementedError as e:  # a clear "not supported yet" from the package
        gemma_ok = False
        say(ctx, f"Gemma 4 under SP: not supported yet ({e})")
    dt = str(ctx.dtype).removeprefix("torch.")
    hi = "float32" if ctx.cuda else "float64"
    noise = (f"attention: plain PyTorch rows in {dt} vs float64; model: SP = 1 vs the unshared "
             f"rows with SDPA in {hi}")  # fmt: skip
    header = ["case", "quantity", "max abs diff", "max rel diff", f"noise ({noise})",
              "tolerance", "result"]  # fmt: skip
    say(ctx, *table(header, [c.row() for c in checks]))
    ok = all(c.ok for c in checks)
    say(ctx, f"\nexactness: {'PASS' if ok else 'FAIL'} ({sum(c.ok for c in checks)}/{len(checks)}"
        " checks within tolerance)")  # fmt: skip
    for c in checks:
        emit(ctx, {"part": "exact", "sp": ctx.world, "case": c.case, "quantity": c.what,
                   "max_abs_diff": c.diff, "max_rel_diff": c.diff / c.scale if c.scale else 0.0,
                   "noise": c.noise, "tolerance": c.tol, "pass": c.ok})  # fmt: skip
    emit(ctx, {"part": "exact-summary", "sp": ctx.world, "pass": ok, "checks": len(checks),
               "gemma_supported": gemma_ok, "seed": args.seed, "config": args.config})  # fmt: skip
    return ok


# --- part: per-layer communication ---------------------------------------------------------------
def layer_shapes(ctx: Ctx, args: argparse.Namespace) -> list[tuple[str, int, int, int, int]]:
    """(name, Hq, Hkv, D, T) of the layers to time: the Qwen3 preset's, Gemma 4's two kinds."""
    from dualkv.demos.grpo_step import PRESETS

    c = PRESETS[args.preset]
    n, p, r = args.shapes[0]
    out = [(f"Qwen3-{args.preset} full", c["num_attention_heads"], c["num_key_value_heads"],
            c["head_dim"], p + n * r)]  # fmt: skip
    if args.gemma_preset in GEMMA4_PRESETS:
        c = GEMMA4_PRESETS[args.gemma_preset]
        n, p, r = args.gemma_shapes[0]
        hq = c["num_attention_heads"]
        out.append((f"{args.gemma_preset} sliding", hq, c["num_key_value_heads"], c["head_dim"],
                    p + n * r))  # fmt: skip
        out.append((f"{args.gemma_preset} full", hq, c["num_global_key_value_heads"],
                    c["global_head_dim"], p + n * r))  # fmt: skip
    return out


def _mb(x: float) -> str:
    return f"{x / 1e6:.1f} MB" if x >= 1e5 else f"{x / 1e3:.1f} kB"


def part_comm(ctx: Ctx, args: argparse.Namespace) -> None:
    sp = ctx.world
    say(ctx, f"\n## Per-layer all-to-all communication, SP = {sp}, {ctx.dtype}, {ctx.gpu}\n")
    if sp == 1:
        say(ctx, "SP = 1: no collective in the path (nothing to time).")
        return
    rows = []
    b = torch.finfo(ctx.dtype).bits // 8
    for name, hq, hkv, d, t in layer_shapes(ctx, args):
        if hq % sp:
            say(ctx, f"({name}: Hq={hq} not a multiple of SP={sp}, skipped)")
            continue
        m = parallel.kv_replication(hq, hkv, sp)
        hkv2 = hkv * m
        s = -(-t // sp)
        q = torch.randn(s, hq, d, device=ctx.device, dtype=ctx.dtype)
        kv = torch.randn(s, hkv2, d, device=ctx.device, dtype=ctx.dtype)
        og = torch.randn(sp * s, hq // sp, d, device=ctx.device, dtype=ctx.dtype)
        kvg = torch.randn(sp * s, hkv2 // sp, d, device=ctx.device, dtype=ctx.dtype)

        # forward: q, k, v tokens -> heads, the output heads -> tokens; backward: d_out
        # tokens -> heads, dq, dk, dv heads -> tokens (the same sizes)
        sets = {"fwd": [(q, 1, 0), (kv, 1, 0), (kv, 1, 0), (og, 0, 1)],
                "bwd": [(q, 1, 0), (og, 0, 1), (kvg, 0, 1), (kvg, 0, 1)]}  # fmt: skip
        times = {}
        with torch.no_grad():
            for label, calls in sets.items():
                ts = []
                for i in range(args.comm_warmup + args.comm_repeats):
                    sync(ctx)
                    dist.barrier()
                    t0 = time.perf_counter()
                    for x, scatter, gather in calls:
                        parallel.all_to_all(x, scatter, gather)
                    sync(ctx)
                    dt = all_max(ctx, [time.perf_counter() - t0])[0]
                    if i >= args.comm_warmup:
                        ts.append(dt)
                times[label] = statistics.median(ts)
        formula = (sp - 1) / sp**2 * t * d * b * (2 * hq + 2 * hkv2)
        sent = (sp - 1) / sp * b * (2 * q.numel() + 2 * kv.numel())  # what left this rank
        bw = sent / times["fwd"] / 1e9
        rows.append([name, str(t), f"{hq}/{hkv2}/{d}", _mb(formula), _mb(sent),
                     f"{1e3 * times['fwd']:.2f} ms", f"{1e3 * times['bwd']:.2f} ms",
                     f"{bw:.3g} GB/s"])  # fmt: skip
        emit(ctx, {"part": "comm", "sp": sp, "layer": name, "T": t, "Hq": hq, "Hkv_sent": hkv2,
                   "D": d, "formula_bytes": formula, "sent_bytes": sent,
                   "fwd_s": times["fwd"], "bwd_s": times["bwd"], "fwd_GBps": bw})  # fmt: skip
    header = [
        "layer",
        "T",
        "Hq/Hkv'/D",
        "formula (sent per rank, each direction)",
        "sent (shapes, with padding)",
        "forward a2a",
        "backward a2a",
        "per-rank send rate",
    ]
    say(ctx, *table(header, rows))
    say(ctx, "(a checkpointed layer runs the forward all-to-alls twice: per step and layer "
        "about 2 x forward + backward)")  # fmt: skip


# --- parts 2 and 3: the step --------------------------------------------------------------------
def rows_packed(ids: torch.Tensor, mask: torch.Tensor, p: int) -> PackedBatch:
    """veRL's remove-padding rows as one stream: every row ``[prompt | response]`` its own
    causal sequence (a layout of all-prompt groups: plain causal varlen attention per row)."""
    n, width = ids.shape
    packed = pack_rows(ids, mask, p, torch.arange(n, device=ids.device))  # no row shares
    plain = dualkv.Layout([width] * n, [[] for _ in range(n)], device=ids.device)
    return dataclasses.replace(packed, layout=plain)


def bench_model(ctx: Ctx, args: argparse.Namespace, part: str, preset: str, layers: int,
                shapes: list[tuple[int, int, int]], paths: list[str]) -> None:  # fmt: skip
    from torch.distributed.device_mesh import init_device_mesh

    sp = args.sp or ctx.world
    if ctx.world % sp:
        raise SystemExit(f"--sp {sp} must divide the world size {ctx.world}")
    dp = ctx.world // sp
    mesh = init_device_mesh(ctx.device.type, (dp, sp), mesh_dim_names=("dp", "sp"))
    group = mesh.get_group("sp")
    dp_rank = mesh.get_local_rank("dp")
    scale = float(sp)  # FSDP2 over all dp x sp ranks averages: see dualkv.parallel
    model = build_any(preset, ctx.device, ctx.dtype, overrides={"num_hidden_layers": layers})
    name = preset if preset in GEMMA4_PRESETS else f"Qwen3-{preset}"
    hq = model.config.num_attention_heads
    if hq % sp:
        say(ctx, f"{name}: Hq={hq} is not a multiple of SP={sp}: not supported (Ulysses splits "
            "the heads)")  # fmt: skip
        return
    model.train()
    flops = {s: useful_flops(model, dualkv.Layout([s[1]], [[s[2]] * s[0]]), s[0] * s[2])
             for s in shapes}  # fmt: skip
    kinds = [("sliding" if w else "full") for _, w in _layer_attention(model)]
    layer_kinds = {k: kinds.count(k) for k in sorted(set(kinds))}
    vocab = model.config.vocab_size
    model.set_attn_implementation("dualkv")
    policy = shard_fsdp(model, init_device_mesh(ctx.device.type, (ctx.world,)))
    say(ctx, f"\n## {name}, {layers} layers: SP = {sp}, dp = {dp}, FSDP2 over {ctx.world} "
        f"rank(s), {ctx.dtype}, {ctx.gpu}\n")  # fmt: skip
    header = [
        "model",
        "N, P, R",
        "GPUs",
        "path",
        "step time",
        "peak memory / GPU (max)",
        "MFU / GPU",
        "loss",
    ]
    say(ctx, *table(header, []))
    for n, p, r in shapes:
        ids, mask, gid, adv = make_rows(n, p, r, vocab, ctx.device, seed=n + p + r + dp_rank)
        old = torch.zeros(n, r, device=ctx.device)
        for path in paths:
            mb = n
            if path == "verl":
                mb = args.rows_micro_batch or max(1, args.rows_tokens_per_gpu * sp // (p + r))
                mb = min(n, mb)
                check = rows_packed(ids[:1], mask[:1], p)
                assert torch.equal(check.input_ids[0], ids[0]), "rows stream is not the row"
            dkt.enable_gradient_checkpointing(
                model, keep_attention=path == "dualkv" or args.rows_keep_attention
            )

            rows_mb = mb if path == "verl" else 0
            step = functools.partial(train_step, policy, group, scale, ids, mask, p, gid, old,
                                     adv, rows_mb)  # fmt: skip
            warmup, repeats, warm = args.warmup, args.repeats, None
            if path == "verl":  # a long step: warm up on its first micro-batch only
                warmup, repeats = 0, args.rows_repeats
                warm = functools.partial(train_step, policy, group, scale, ids[:mb], mask[:mb],
                                         p, gid[:mb], old[:mb], adv[:mb], rows_mb)  # fmt: skip
            label = path if path == "dualkv" else f"verl-ulysses rows (micro-batch {mb})"
            try:
                res = time_step(ctx, policy, step, warmup, repeats, warm)
            except torch.OutOfMemoryError:
                if ctx.world > 1:  # the other ranks wait in a collective: end the launch
                    raise
                policy.zero_grad(set_to_none=True)
                say(ctx, "| " + " | ".join([name, f"{n}, {p}, {r}", str(ctx.world), label,
                                            "OOM", "-", "-", "-"]) + " |")  # fmt: skip
                emit(ctx, {"part": part, "model": name, "layers": layers, "N": n, "P": p,
                           "R": r, "sp": sp, "dp": dp, "path": path, "error": "OOM"})  # fmt: skip
                continue
            t = res["time"]
            mfu = flops[(n, p, r)] * dp / t / (args.peak_tflops * 1e12 * ctx.world)
            peak = res["peak"]
            mem = f"{max(peak) / 2**30:.1f} GiB" if peak else "n/a"
            mfu_cell = f"{100 * mfu:.1f}%" if ctx.cuda else "-"
            say(ctx, "| " + " | ".join([name, f"{n}, {p}, {r}", str(ctx.world), label,
                                        f"{t:.3f} s", mem, mfu_cell,
                                        f"{res['loss']:.6g}"]) + " |")  # fmt: skip
            emit(ctx, {"part": part, "model": name, "layers": layers, "N": n, "P": p, "R": r,
                       "sp": sp, "dp": dp, "path": path, "micro_batch": mb, "time_s": t,
                       "times_s": res["times"], "peak_bytes": peak, "mfu": mfu,
                       "loss": res["loss"], "layer_kinds": layer_kinds,
                       "rows_keep_attention": bool(args.rows_keep_attention)})  # fmt: skip


def train_step(policy: Policy, group: Any, grad_scale: float, ids: torch.Tensor,
               mask: torch.Tensor, p: int, gid: torch.Tensor, old: torch.Tensor,
               adv: torch.Tensor, rows_micro_batch: int) -> float:  # fmt: skip
    """One step: the packed group (``rows_micro_batch`` 0), or the rows in micro-batches
    (gradient accumulation; the token-mean over the whole batch's response tokens)."""
    if not rows_micro_batch:
        packed = pack_rows(ids, mask, p, gid)
        loss = _loss(policy(packed, group, grad_scale), None, old, adv, packed.response_mask)
        loss.backward()
        return float(loss.detach())
    n, mb = ids.shape[0], rows_micro_batch
    n_tok = float(mask[:, p:].sum())
    total = torch.zeros((), device=ids.device)
    for s in range(0, n, mb):
        packed = rows_packed(ids[s : s + mb], mask[s : s + mb], p)
        loss = _loss(policy(packed, group, grad_scale), None, old[s : s + mb], adv[s : s + mb],
                     packed.response_mask, num_tokens=n_tok)  # fmt: skip
        loss.backward()
        total += loss.detach()
    return float(total)


def time_step(ctx: Ctx, policy: torch.nn.Module, step: Callable[[], float], warmup: int,
              repeats: int, warm: Callable[[], float] | None = None) -> dict[str, Any]:  # fmt: skip
    """Median step time (the slowest rank's) after ``warmup`` steps (and one call of ``warm``),
    peak memory per rank, the last loss."""
    if ctx.cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(ctx.device)
    times, loss = [], float("nan")
    if warm is not None:
        policy.zero_grad(set_to_none=True)
        warm()
    for i in range(warmup + repeats):
        policy.zero_grad(set_to_none=True)
        sync(ctx)
        dist.barrier()
        t0 = time.perf_counter()
        loss = step()
        sync(ctx)
        dt = all_max(ctx, [time.perf_counter() - t0])[0]
        if i >= warmup:
            times.append(dt)
    policy.zero_grad(set_to_none=True)
    peak = None
    if ctx.cuda:
        mine = torch.tensor([torch.cuda.max_memory_allocated(ctx.device)], device=ctx.device)
        every = [torch.zeros_like(mine) for _ in range(ctx.world)]
        dist.all_gather(every, mine)
        peak = [int(x.item()) for x in every]
    return {"time": statistics.median(times), "times": times, "peak": peak, "loss": loss}


# --- summary over launches ----------------------------------------------------------------------
def summarize(path: str) -> list[str]:
    """The scaling table from the JSON lines of launches at several GPU counts."""
    recs = [json.loads(line) for line in open(path) if line.strip()]
    steps = [r for r in recs if r.get("part") in ("qwen", "gemma") and "time_s" in r
             and r.get("dp", 1) == 1]  # fmt: skip
    out = []
    keys: dict[tuple[Any, ...], dict[int, dict[str, Any]]] = {}
    for r in steps:  # the last run of each (model, shape, path, GPUs) counts
        key = (r["model"], r["layers"], r["N"], r["P"], r["R"], r["path"])
        keys.setdefault(key, {})[r["world"]] = r
    rows = []
    for key, by_world in keys.items():
        model, layers, n, p, r, pth = key
        base = by_world.get(1)
        for w in sorted(by_world):
            x = by_world[w]
            peak = f"{max(x['peak_bytes']) / 2**30:.1f} GiB" if x.get("peak_bytes") else "n/a"
            speed = eff = "-"
            if base:
                speed = f"{base['time_s'] / x['time_s']:.2f}x"
                eff = f"{100 * base['time_s'] / (w * x['time_s']):.0f}%"
            rows.append([f"{model} ({layers} layers)", f"{n}, {p}, {r}", pth, str(w),
                         f"{x['time_s']:.3f} s", peak, speed, eff])  # fmt: skip
    out += table(["model", "N, P, R", "path", "GPUs (SP)", "step time", "peak memory / GPU",
                  "speed-up vs 1 GPU", "scaling efficiency t1/(K tK)"], rows)  # fmt: skip
    # DualKV vs the rows baseline at each GPU count
    vs = []
    for (model, layers, n, p, r, pth), by_world in keys.items():
        if pth != "dualkv":
            continue
        other = keys.get((model, layers, n, p, r, "verl"), {})
        for w, x in sorted(by_world.items()):
            if w in other:
                vs.append([f"{model} ({layers} layers)", f"{n}, {p}, {r}", str(w),
                           f"{other[w]['time_s'] / x['time_s']:.2f}x"])  # fmt: skip
    out += section(["model", "N, P, R", "GPUs", "DualKV SP vs veRL-style Ulysses rows"], vs)
    # per-layer all-to-alls: measured vs the formula, and their share of the packed step
    comm = {(r["layer"], r["T"], r["world"]): r for r in recs if r.get("part") == "comm"}
    crow = []
    for (layer, t, w), c in comm.items():
        crow.append([layer, str(t), str(w), _mb(c["formula_bytes"]), _mb(c["sent_bytes"]),
                     f"{1e3 * c['fwd_s']:.2f} ms", f"{1e3 * c['bwd_s']:.2f} ms",
                     f"{c['fwd_GBps']:.3g} GB/s"])  # fmt: skip
    out += section(["layer", "T", "GPUs", "formula bytes / rank / direction", "sent (shapes)",
                     "forward", "backward", "send rate"], crow)  # fmt: skip
    share = []
    for (model, layers, n, p, r, pth), by_world in keys.items():
        for w, x in sorted(by_world.items()):
            kinds = x.get("layer_kinds") or {}
            cs = [(k, cnt, comm.get((f"{model} {k}", p + n * r, w))) for k, cnt in kinds.items()]
            if pth != "dualkv" or w == 1 or not cs or any(c is None for _, _, c in cs):
                continue
            est = sum(cnt * (2 * c["fwd_s"] + c["bwd_s"]) for _, cnt, c in cs if c)
            share.append([f"{model} ({layers} layers)", f"{n}, {p}, {r}", str(w),
                          f"{1e3 * est:.1f} ms", f"{x['time_s']:.3f} s",
                          f"{100 * est / x['time_s']:.1f}%"])  # fmt: skip
    out += section(["model", "N, P, R", "GPUs",
                     "all-to-alls per step (layers x (2 fwd + bwd), measured alone)", "step time",
                     "share"], share)  # fmt: skip
    exact = [r for r in recs if r.get("part") == "exact-summary"]
    for r in exact:
        out.append(f"\nexactness at SP = {r['sp']} ({r['gpu']}, {r['dtype']}): "
                   f"{'PASS' if r['pass'] else 'FAIL'} ({r['checks']} checks)")  # fmt: skip
    return out


# --- main ---------------------------------------------------------------------------------------
def _shape(s: str) -> tuple[int, int, int]:
    n, p, r = (int(x) for x in s.split(","))
    return n, p, r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--parts", default=",".join(PARTS), help=f"subset of {PARTS}")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"],
                    help="default: bfloat16 on cuda, float32 on cpu")  # fmt: skip
    ap.add_argument("--config", choices=sorted(EXACT_QWEN),
                    help="part 1's sizes (default: small on cuda, tiny on cpu)")  # fmt: skip
    ap.add_argument(
        "--seed",
        type=int,
        default=int.from_bytes(os.urandom(3), "little"),
        help="the inputs' seed (default: fresh, the largest of the ranks' draws)",
    )
    ap.add_argument("--preset", default="8b", help="Qwen3 preset (dualkv.demos.grpo_step.PRESETS)")
    ap.add_argument("--layers", type=int, default=4, help="Qwen3 decoder layers (cut)")
    ap.add_argument("--shapes", nargs="+", type=_shape,
                    default=[(16, 32768, 2048), (16, 65536, 2048)], help="N,P,R")  # fmt: skip
    ap.add_argument("--paths", default="dualkv,verl", help="qwen part: dualkv, verl")
    ap.add_argument("--gemma-preset", default="gemma4-31b", help=f"{sorted(GEMMA4_PRESETS)}")
    ap.add_argument("--gemma-layers", type=int, default=6)
    ap.add_argument("--gemma-shapes", nargs="+", type=_shape, default=[(16, 65536, 2048)])
    ap.add_argument("--gemma-paths", default="dualkv")
    ap.add_argument("--sp", type=int, default=0, help="SP group size (default: world size)")
    ap.add_argument(
        "--rows-tokens-per-gpu",
        type=int,
        default=262_144,
        help="verl path: veRL's max_token_len_per_gpu (micro-batch x sp tokens)",
    )
    ap.add_argument("--rows-micro-batch", type=int, default=0, help="verl path: rows (overrides)")
    ap.add_argument("--rows-keep-attention", action="store_true",
                    help="verl path: checkpointing keeps the attention outputs (default: veRL's "
                    "full recompute)")  # fmt: skip
    ap.add_argument("--warmup", type=int, default=1, help="warm-up steps (dualkv path)")
    ap.add_argument("--repeats", type=int, default=2, help="timed steps (dualkv path)")
    ap.add_argument(
        "--rows-repeats",
        type=int,
        default=1,
        help="verl path: timed steps (after a warm-up on one micro-batch)",
    )
    ap.add_argument("--comm-warmup", type=int, default=3)
    ap.add_argument("--comm-repeats", type=int, default=10)
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak per GPU")
    ap.add_argument("--json", help="append the results as JSON lines to this file")
    ap.add_argument("--summarize", metavar="JSONL", help="print the scaling table and exit")
    args = ap.parse_args(argv)
    if args.summarize:
        print("\n".join(summarize(args.summarize)))
        return 0
    args.parts = [x for x in args.parts.split(",") if x]
    for x in args.parts:
        if x not in PARTS:
            ap.error(f"unknown part {x!r}; choose from {PARTS}")
    ctx = init(args.device, args.dtype, args.json)
    args.config = args.config or ("small" if ctx.cuda else "tiny")
    # one seed for the whole group (every rank draws the same global inputs)
    args.seed = int(all_max(ctx, [float(args.seed)])[0])
    say(ctx, f"multi_gpu: world {ctx.world}, {ctx.gpu}, torch {torch.__version__}, seed "
        f"{args.seed}, parts {','.join(args.parts)}; "
        + " ".join(f"{k}={os.environ.get(k)}" for k in SAFE_ENV))  # fmt: skip
    runs: dict[str, Callable[[], Any]] = {
        "exact": lambda: part_exact(ctx, args),
        "comm": lambda: part_comm(ctx, args),
        "qwen": lambda: bench_model(ctx, args, "qwen", args.preset, args.layers, args.shapes,
                                    [x for x in args.paths.split(",") if x]),
        "gemma": lambda: bench_model(ctx, args, "gemma", args.gemma_preset, args.gemma_layers,
                                     args.gemma_shapes,
                                     [x for x in args.gemma_paths.split(",") if x]),
    }  # fmt: skip
    ok = True
    try:
        for part in args.parts:
            # a failing part is reported and the next one runs (a failure on some ranks only
            # leaves the others in a collective: the process group's timeout then ends them)
            try:
                ok = runs[part]() is not False and ok
            except Exception as exc:
                ok = False
                print(f"rank {ctx.rank}: part {part} failed:\n{traceback.format_exc()}",
                      file=sys.stderr, flush=True)  # fmt: skip
                emit(ctx, {"part": f"{part}-error", "error": f"{type(exc).__name__}: {exc}"})
            if ctx.cuda:
                torch.cuda.empty_cache()
    finally:
        # every rank done before any closes its connections (gloo aborts a peer otherwise)
        with contextlib.suppress(Exception):
            dist.barrier()
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    code = main()
    # The results are written and the process group destroyed; leave without the interpreter's
    # finalization, where objects still holding gloo's threads (FSDP2's device mesh, the store)
    # can be destructed with a thread still joinable: std::terminate, exit code -6, seen once in
    # CI after every check had passed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
