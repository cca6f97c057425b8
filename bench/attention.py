"""Attention benchmark on the GPU: DualKV vs the ways a trainer runs shared-prompt attention today.

For each layout (N responses of R tokens sharing a prompt of P tokens, one group; plain causal
attention, N = 1 and R = 0, where every method computes the same function; the realistic
micro-batch: several groups of different P, N and long-tailed R; or a prefix-tree batch of
bench/trees.py: branching rollouts, an agentic multi-turn batch, a system prompt shared by
groups) it times the forward and forward+backward of
  dualkv      DualKV on the packed layout (P + N*R tokens; a tree: every segment once)
  sdpa_cudnn  PyTorch SDPA, cuDNN backend, causal, on the N unshared rows of P + R tokens
              (several groups: every group's rows, right-padded to the longest row; a tree:
              every row, a root-to-leaf path or, agentic, each turn's whole prefix)
  sdpa_fa2    PyTorch SDPA, FlashAttention-2 backend, same rows
  sdpa_mem    PyTorch SDPA, memory-efficient backend, same rows (the only one that takes D = 512)
  flex        FlexAttention on the packed layout with a shared-prefix block mask (a tree: the tree
              mask of trees.tree_mask_mod, pre-order intervals + causal on logical positions, as
              AReaL-style tree training builds it; create_block_mask compiled)
  cudnn_3pass the 3-pass + lse-merge composition (below) with cuDNN's attention ops
  mem_3pass   the composition with PyTorch's memory-efficient attention ops (D = 512)
  fa4-rows    FlashAttention-4 (flash-attn-4, CuTe DSL; head dims <= 256 on Hopper), causal
              varlen on the N unshared rows (no padding, GQA native)
  fa4-3pass   the composition with FA4's kernels
  ffpa-rows   ffpa-attn (CuTe DSL; on Hopper the head dims above 256: D = 512), causal varlen on
              the rows
  ffpa-3pass  the composition with ffpa-attn's kernels
The 3-pass composition (one group of equal responses; the NeMo-RL/Megatron approach): the prompt
causal, all response queries against the prompt (non-causal), each response causal against
itself, merged by lse; an exact backward: the merged output and lse go to each pass's backward.
A method whose package is missing, or whose kernels do not take the shape, is skipped with the
reason printed. Before timing, each method is checked at a small layout (CHECK_LAYOUT) with each
timed head configuration: output and gradients against the float64 reference of the unshared
rows, FlashAttention's tolerance rule; a method that fails is not timed.
Trees are checked at CHECK_TREE instead (the 3-pass composition does not apply to them).
Reported: the median time (CUDA events) and useful TFLOP/s on the packed layout's FLOP count
(dualkv.Layout.flops: 4*D*Hq*allowed pairs forward, 2.5x that backward; a tree's too), and for
each layout its token reduction rho (unshared row tokens / packed tokens).

    python bench/attention.py                 # the packed reference shapes, all methods
    python bench/attention.py --shapes packed,plain,d512      # every shape of SHAPE_SETS
    python bench/attention.py --shapes 0 --methods dualkv,flex --out bench/out
    python bench/attention.py --shapes plain --head-dims 64,128 --methods dualkv,fa4-rows
    python bench/attention.py --shape 16,8192,1024,16,8,128   # a shape of your own (Qwen3-1.7B)
    python bench/attention.py --multi 16,8,128                # the realistic micro-batch
    python bench/attention.py --shapes tree --methods dualkv,flex,fa4-rows,sdpa_cudnn \
        --out $OUT/trees                  # the three tree batches (32/8/128)
    python bench/attention.py --shapes tree-d2 --methods dualkv --out $OUT/twins   # their twins
    python bench/attention.py --summary $OUT/trees/attention.json $OUT/twins/attention.json
    python bench/attention.py --tree agentic,16,8,128 --methods dualkv,flex   # one tree
    python bench/attention.py --shapes tree-deep --tree-segments listed --methods dualkv
        # the long-horizon batch as listed (depth 25): packed, its turns merge into 9 segments
(bench/trees_gpu.sh runs the tree benchmarks in a few device calls.)
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from trees import TREES, TreeBatch, forest_rows, tree_block_mask

import dualkv

Tensor = torch.Tensor

# (N, P, R, Hq, Hkv, D); N = 0: the realistic micro-batch (`realistic_groups`) with those heads;
# N a name of trees.TREES: that prefix-tree batch with those heads.
SHAPES: list[tuple] = [
    # DESIGN.md's packed reference shapes
    (16, 8192, 1024, 32, 8, 128),
    (32, 4096, 2048, 32, 8, 128),
    (8, 16384, 2048, 32, 8, 128),
    (16, 2048, 2048, 16, 16, 64),
    (16, 4096, 1024, 16, 8, 256),
    (0, 0, 0, 32, 8, 128),
    # plain causal attention: one sequence of P tokens
    (1, 8192, 0, 16, 16, 64),
    (1, 16384, 0, 16, 16, 64),
    (1, 8192, 0, 16, 8, 128),
    (1, 16384, 0, 16, 8, 128),
    (1, 8192, 0, 32, 8, 128),
    (1, 16384, 0, 32, 8, 128),
    (1, 8192, 0, 16, 8, 256),
    (1, 16384, 0, 16, 8, 256),
    (1, 8192, 0, 32, 4, 512),
    (1, 16384, 0, 32, 4, 512),
    (1, 32768, 0, 32, 4, 512),
    # packed, Gemma-4-31B's full-attention layers (D = 512, 32/4)
    (16, 8192, 1024, 32, 4, 512),
    (8, 16384, 2048, 32, 4, 512),
    # packed, more of issue 32's table: Qwen3-1.7B's heads; many short responses
    (16, 8192, 1024, 16, 8, 128),
    (64, 4096, 512, 32, 8, 128),
]
# Prefix trees (issue 33; trees.py: "branching", "agentic", "sysprompt"; "long-horizon") with
# these heads, as (name, 0, 0, Hq, Hkv, D); and their depth-two twins (TreeBatch.twin: the
# depth-two layout of comparable size, for the "tree >= 90% of the depth-two kernel's TF/s"
# comparison).
TREE_HEADS = (32, 8, 128)
_FIRST_TREE = len(SHAPES)
SHAPES += [(name, 0, 0, *TREE_HEADS) for name in TREES]
SHAPES += [(*TREES[name]().twin(), *TREE_HEADS) for name in TREES]
SHAPE_SETS = {
    "packed": [0, 1, 2, 3, 4, 5, 19, 20],
    "plain": list(range(6, 17)),
    "d512": [14, 15, 16, 17, 18],
    # the three tree batches; then long-horizon (deep trees) with its twin
    "tree": list(range(_FIRST_TREE, _FIRST_TREE + 3)),
    "tree-d2": list(range(_FIRST_TREE + len(TREES), _FIRST_TREE + len(TREES) + 3)),
    "tree-deep": [_FIRST_TREE + 3, _FIRST_TREE + len(TREES) + 3],
}
Groups = list[tuple[int, list[int]]]  # (prompt length, response lengths) per group


def realistic_groups(seed: int = 0) -> Groups:
    """A GRPO micro-batch as a trainer packs it: 4 groups with prompts of 1K, 2.5K, 4K and 6K
    tokens, 8-16 responses each, response lengths long-tailed (log-normal, median ~700, capped
    at 4K, at least 16), fixed by the seed so every run times the same layout."""
    g = torch.Generator().manual_seed(seed)
    groups = []
    for p in (1024, 2560, 4096, 6144):
        n = int(torch.randint(8, 17, (), generator=g))
        rs = torch.exp(6.5 + 0.9 * torch.randn(n, generator=g)).clamp(16, 4096)
        groups.append((p, [int(x) for x in rs]))
    return groups


METHODS = [
    "dualkv",
    "sdpa_cudnn",
    "sdpa_fa2",
    "flex",
    "cudnn_3pass",
    "fa4-rows",
    "fa4-3pass",
    "ffpa-rows",
    "ffpa-3pass",
]
# Also available (not in the default list): sdpa_mem, mem_3pass.
EXTRA_METHODS = ["sdpa_mem", "mem_3pass"]
# The head dims each method's kernels take; a shape outside is skipped with the reason.
HEAD_DIMS: dict[str, tuple[int, int, str]] = {
    "sdpa_cudnn": (1, 256, "cuDNN's attention takes head dims <= 256"),
    "sdpa_fa2": (1, 256, "FlashAttention-2 takes head dims <= 256"),
    "flex": (1, 256, "FlexAttention's kernels take head dims <= 256"),
    "cudnn_3pass": (1, 256, "cuDNN's attention takes head dims <= 256"),
    "fa4-rows": (1, 256, "FA4's Hopper kernels take head dims <= 256"),
    "fa4-3pass": (1, 256, "FA4's Hopper kernels take head dims <= 256"),
    "ffpa-rows": (257, 1024, "ffpa-attn is timed above head dim 256 (FA4 covers the rest)"),
    "ffpa-3pass": (257, 1024, "ffpa-attn is timed above head dim 256 (FA4 covers the rest)"),
}
# (N, P, R) of the correctness check: off every kernel's tile boundaries.
CHECK_LAYOUT = (3, 200, 72)
# The tree of the correctness check (tree shapes): two trees, depth 4, segments off the tile
# boundaries, a one-token segment, rows that end where the tree goes on (per-turn samples).
CHECK_TREE = TreeBatch(
    "check",
    parents=[-1, 0, 1, 1, 3, 0, 5, -1, 7, 7],
    lengths=[200, 72, 33, 150, 129, 1, 90, 130, 64, 17],
    rows=[(2, 1), (4, 1), (1, 1), (3, 3), (6, 5), (7, 7), (8, 8), (9, 9)],
    task=[0, 0, 0, 0, 0, 1, 1, 1],
)


# GPU clock cycles of the spin queued before each timed call with --lead-spin (~1 ms at the
# H200's 1.98 GHz: longer than any method's host-side dispatch of one call here).
LEAD_SPIN_CYCLES = 2_000_000


def time_ms(fn: Callable[[], object], warmup: int, repeats: int, lead_spin: bool = False) -> float:
    """Median of `repeats` CUDA-event timings after `warmup` calls. Each timed call starts from
    an idle GPU (the previous one was synchronised), so the events include the host's latency to
    its first kernel; with `lead_spin` a spin kernel is queued first, so the host issues the call
    while the GPU spins and the events time the GPU's work alone."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if lead_spin:
            torch.cuda._sleep(LEAD_SPIN_CYCLES)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


class Skip(Exception):
    """A method that does not apply to this shape or machine (its package is missing, its
    kernels do not take the head dim or layout): reported with the reason, not as a failure."""


class Case:
    """Packed and row-layout inputs of one layout (random): `groups` of (P, [R_1..R_N]), or a
    prefix-tree batch (trees.TreeBatch)."""

    def __init__(
        self,
        groups: Groups | TreeBatch,
        hq: int,
        hkv: int,
        d: int,
        device: str = "cuda",
        dtype: torch.dtype = torch.bfloat16,
        seed: int = 0,
        tree_segments: str = "packed",
    ) -> None:
        self.hq, self.hkv, self.d = hq, hkv, d
        if isinstance(groups, TreeBatch):
            self.groups: Groups | None = None
            self.tree: TreeBatch | None = groups
            # "packed": the segments dualkv.pack(tree=True) makes of the rows (they end where
            # rows branch); "listed": the batch's own, a segment per turn. The same function and
            # tokens either way; the rows below come from the listed forest.
            forest = groups.packed_forest() if tree_segments == "packed" else groups.layout_forest()
            self.layout = dualkv.Layout.tree(*forest, device=device)
            self.single = False
        else:
            self.groups, self.tree = groups, None
            # one group of equal responses: the shape the single-group methods (3-pass) take
            (self.p, rs), *rest = groups
            self.n, self.r = len(rs), rs[0] if rs else 0
            self.single = not rest and all(x == self.r for x in rs)
            self.layout = dualkv.Layout(
                [p for p, _ in groups], [r for _, r in groups], device=device
            )
        T = self.layout.total_tokens
        g = torch.Generator(device=device).manual_seed(seed)
        mk = lambda h: torch.randn(T, h, d, device=device, dtype=dtype, generator=g)  # noqa: E731
        self.q, self.k, self.v = mk(hq), mk(hkv), mk(hkv)
        self.dout = mk(hq)
        self.scale = 1.0 / math.sqrt(d)
        self.flops_fwd = self.layout.flops(d, hq)
        self.flops_bwd = self.layout.flops(d, hq, backward=True)
        # The unshared rows: every root-to-leaf path of the layout's segments (for groups:
        # [prompt | response], a group without responses its prompt alone), as the packed tokens
        # they hold, and for each packed token the (row, position) its output is read back from:
        # the first row that holds it (every copy computes the same output).
        rows = (
            forest_rows(*self.tree.layout_forest()) if self.tree is not None
            else forest_rows(list(self.layout.parents), list(self.layout.lengths))
        )  # fmt: skip
        # rho: the rows' tokens over the packed tokens
        self.rho = sum(len(x) for x in rows) / T if T else 1.0
        lens = [len(x) for x in rows]
        offsets = [0, *itertools.accumulate(lens)]
        length = max(lens)
        row_of = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(lens))
        col_of = torch.arange(offsets[-1]) - torch.tensor(offsets[:-1])[row_of]
        flat = torch.cat(rows)
        first = torch.full((T,), offsets[-1], dtype=torch.int64)
        first.scatter_reduce_(0, flat, torch.arange(offsets[-1]), reduce="amin")
        src = torch.stack([row_of[first], col_of[first]], 1)
        # varlen (the rows concatenated): token index, cumulative lengths, source position
        self.rows_index = flat.to(device)
        self.rows_cu = torch.tensor(offsets, dtype=torch.int32, device=device)
        self.rows_max = length
        self.rows_source = first.to(device)
        # padded [rows, L] (SDPA), right-padded with token 0: causal attention never lets a
        # real query see a padded key
        pad = torch.stack([torch.cat([x, x.new_zeros(length - len(x))]) for x in rows])
        self.pad_index = pad.to(device)
        self.pad_source = (src[:, 0] * length + src[:, 1]).to(device)

    @functools.cached_property
    def padded_rows(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """q, k, v, dout as the padded rows [rows, H, L, D], K/V expanded to Hq heads (SDPA)."""
        rows_of = lambda t: t[self.pad_index].transpose(1, 2).contiguous()  # noqa: E731
        g = self.hq // self.hkv
        k, v = (x.repeat_interleave(g, 1) for x in (self.k, self.v))
        return rows_of(self.q), rows_of(k), rows_of(v), rows_of(self.dout)

    def leaves(self, *ts: Tensor) -> list[Tensor]:
        return [t.detach().requires_grad_() for t in ts]

    @staticmethod
    def source_only(rows_grad: Tensor, source: Tensor) -> Tensor:
        """A token-major [M, H, D] output gradient of the rows with every copy of a token but
        its source zeroed: the rows then carry the packed layout's loss, so their gradients map
        back to the packed ones exactly (`rows_to_packed`)."""
        keep = torch.zeros(rows_grad.shape[0], dtype=rows_grad.dtype, device=rows_grad.device)
        keep[source] = 1
        return rows_grad * keep[:, None, None]

    def rows_to_packed(
        self, index: Tensor, source: Tensor, dq: Tensor, dk: Tensor, dv: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Packed [T, H, D] gradients from the rows' (token-major [M, H', D]; `index`: the packed
        token at each row position), after a backward with `source_only`'s output gradient:
        a token's dq is its source copy's; dk/dv sum over every copy of the token, and over the
        query heads of a KV head where K/V were expanded."""

        def keys(g: Tensor) -> Tensor:
            t = wide(g).new_zeros(self.layout.total_tokens, *g.shape[1:])
            return t.index_add_(0, index, wide(g)).unflatten(1, (self.hkv, -1)).sum(2)

        return dq[source], keys(dk), keys(dv)


def wide(x: Tensor) -> Tensor:
    """`x` in at least float32 (for sums of 16-bit gradients)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class Runner(NamedTuple):
    forward: Callable[[], object]
    forward_backward: Callable[[], object]
    packed_out: Callable[[], Tensor]  # the forward output in packed [T, Hq, D] order
    # dq, dk, dv in packed order ([T, Hq or Hkv, D]) for the output gradient Case.dout
    packed_grads: Callable[[], tuple[Tensor, Tensor, Tensor]]


def fresh_backward(leaves: list[Tensor], out: Tensor, grad: Tensor) -> None:
    """Backward into cleared gradients, as flash-attn's benchmarks do: in a model q, k, v are
    activations, so no step adds its gradients into existing ones (accumulating into the
    leaves' .grad would time an elementwise add per input, 2-4% of DualKV's time at D = 64)."""
    for t in leaves:
        t.grad = None
    torch.autograd.backward(out, grad)


def grads_of(leaves: list[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = (t.grad for t in leaves)
    assert dq is not None and dk is not None and dv is not None
    return dq, dk, dv


def run_dualkv(c: Case) -> Runner:
    q, k, v = c.leaves(c.q, c.k, c.v)
    fwd = lambda: dualkv.attention(q, k, v, c.layout)  # noqa: E731
    fb = lambda: fresh_backward([q, k, v], fwd(), c.dout)  # noqa: E731

    def packed_grads() -> tuple[Tensor, Tensor, Tensor]:
        fb()
        return grads_of([q, k, v])

    return Runner(fwd, fb, fwd, packed_grads)


def run_sdpa(c: Case, backend: torch.nn.attention.SDPBackend) -> Runner:
    rq, rk, rv, rdout = c.padded_rows
    q, k, v = c.leaves(rq, rk, rv)
    flat = lambda t: t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3])  # noqa: E731

    def fwd() -> Tensor:
        with torch.nn.attention.sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def packed_grads() -> tuple[Tensor, Tensor, Tensor]:
        dout = c.source_only(flat(rdout), c.pad_source)
        fresh_backward([q, k, v], fwd(), dout.view(rdout.transpose(1, 2).shape).transpose(1, 2))
        dq, dk, dv = (flat(g) for g in grads_of([q, k, v]))
        return c.rows_to_packed(c.pad_index.flatten(), c.pad_source, dq, dk, dv)

    fb = lambda: fresh_backward([q, k, v], fwd(), rdout)  # noqa: E731
    return Runner(fwd, fb, lambda: flat(fwd())[c.pad_source], packed_grads)


def run_varlen_rows(c: Case, attend: Callable[..., Tensor]) -> Runner:
    """A causal varlen kernel on the N unshared rows, concatenated: `attend(q, k, v,
    cu_seqlens, max_seqlen)` -> out, q/out [M, Hq, D], k/v [M, Hkv, D]."""
    q, k, v = c.leaves(*(t[c.rows_index] for t in (c.q, c.k, c.v)))
    dout = c.dout[c.rows_index]
    fwd = lambda: attend(q, k, v, c.rows_cu, c.rows_max)  # noqa: E731

    def packed_grads() -> tuple[Tensor, Tensor, Tensor]:
        fresh_backward([q, k, v], fwd(), c.source_only(dout, c.rows_source))
        return c.rows_to_packed(c.rows_index, c.rows_source, *grads_of([q, k, v]))

    fb = lambda: fresh_backward([q, k, v], fwd(), dout)  # noqa: E731
    return Runner(fwd, fb, lambda: fwd()[c.rows_source], packed_grads)


def run_flex(c: Case) -> Runner:
    """FlexAttention on the packed stream: a shared-prefix block mask for groups, the tree mask
    (trees.tree_mask_mod: ancestor test by pre-order intervals, causal on logical positions) for
    a tree. Compiled on CUDA; eager on the CPU (FlexAttention's dense reference: forward only)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    device = c.q.device
    T = c.layout.total_tokens
    if device.type == "cuda":
        # A graph per shape and grad mode (the forward runs under no_grad too), and per shape of
        # the compiled tree mask: past dynamo's default of 8 the later shapes would run the
        # unfused flex_attention (out of memory at D = 256).
        from model_step import allow_recompiles

        allow_recompiles()
    if c.groups is None:
        block_mask = tree_block_mask(list(c.layout.parents), list(c.layout.lengths), device)
    else:
        pos = c.layout.position_ids
        # Per token: its group, and its segment (0 for the prompt, i + 1 for response i).
        group, seg = [], []
        for gi, (p, rs) in enumerate(c.groups):
            group += [gi] * (p + sum(rs))
            seg += [0] * p + [i + 1 for i, r in enumerate(rs) for _ in range(r)]
        grp, seg_t = (torch.tensor(x, device=device) for x in (group, seg))

        def mask_mod(b, h, qi, ki):  # noqa: ANN001, ANN202
            same = (grp[ki] == grp[qi]) & ((seg_t[ki] == 0) | (seg_t[ki] == seg_t[qi]))
            return same & (pos[ki] <= pos[qi])

        block_mask = create_block_mask(mask_mod, 1, 1, T, T, device=device)

    flex: Callable[..., Tensor] = flex_attention
    if device.type == "cuda":
        flex = torch.compile(flex_attention, dynamic=False)
    q, k, v = c.leaves(*(t.transpose(0, 1)[None] for t in (c.q, c.k, c.v)))
    dout = c.dout.transpose(0, 1)[None]
    fwd = lambda: flex(q, k, v, block_mask=block_mask, scale=c.scale, enable_gqa=True)  # noqa: E731
    fb = lambda: fresh_backward([q, k, v], fwd(), dout)  # noqa: E731

    def packed_grads() -> tuple[Tensor, Tensor, Tensor]:
        fb()
        dq, dk, dv = (g[0].transpose(0, 1) for g in grads_of([q, k, v]))
        return dq, dk, dv

    return Runner(fwd, fb, lambda: fwd()[0].transpose(0, 1), packed_grads)


class PassKernel:
    """One attention kernel as the 3-pass composition (`run_3pass`) calls it, in the kernel's
    own tensor layout: tokens on axis `dim` of q/k/v/out; `forward` returns lse shaped to
    broadcast against out (size 1 on the last axis). `segments`: the number of equal segments
    of the tokens (pass 3: one per response), each attending causally within itself only; a
    kernel that takes them as a batch regroups them with `split` / `join`."""

    dim = 0

    def inputs(self, c: Case) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """q, k, v, dout of the whole packed stream in this layout."""
        return c.q, c.k, c.v, c.dout

    def split(self, x: Tensor, segments: int) -> Tensor:
        return x

    def join(self, x: Tensor, segments: int) -> Tensor:
        return x

    def packed(self, x: Tensor) -> Tensor:
        """A packed-stream tensor of this layout as [T, H, D]."""
        return x

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, segments: int
    ) -> tuple[Tensor, Tensor, Any]:
        """(out, lse broadcastable against out, what the backward needs)."""
        raise NotImplementedError

    def backward(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        saved: Any,
        causal: bool,
        segments: int,
    ) -> tuple[Tensor, Tensor, Tensor]:
        raise NotImplementedError


def run_3pass(c: Case, kernel: PassKernel) -> Runner:
    """The 3-pass + lse-merge composition on the packed layout with `kernel`: the prompt causal,
    all response queries against the prompt (non-causal), each response causal against itself;
    the response outputs merged by lse. Backward: the merged output and lse go to each pass's
    backward (exact), the passes' gradients summed as autograd would."""
    if not c.single:
        raise Skip("the 3-pass composition is timed on one group of equal R")
    if c.n * c.r == 0:
        raise Skip("R = 0: the composition is its prompt pass alone (the rows method)")
    n, p, dim = c.n, c.p, kernel.dim
    q, k, v, dout = kernel.inputs(c)
    prompt = lambda x: x.narrow(dim, 0, p)  # noqa: E731
    resp = lambda x: x.narrow(dim, p, x.shape[dim] - p)  # noqa: E731
    split = lambda x: kernel.split(resp(x).contiguous(), n)  # noqa: E731
    passes = [  # (q, k, v, causal, segments)
        (prompt(q), prompt(k), prompt(v), True, 1),
        (resp(q), prompt(k), prompt(v), False, 1),
        (split(q), split(k), split(v), True, n),
    ]
    douts = [prompt(dout), resp(dout), split(dout)]

    def forward() -> tuple[list, Tensor, Tensor]:
        res = [kernel.forward(*ps) for ps in passes]
        (o_p, l_p, _), (o_a, l_a, _), (o_b, l_b, _) = res
        o_b, l_b = kernel.join(o_b, n), kernel.join(l_b, n)
        l_r = torch.logaddexp(l_a, l_b)
        o_r = o_a * torch.exp(l_a - l_r) + o_b * torch.exp(l_b - l_r)
        out = torch.cat([o_p, o_r.to(o_a.dtype)], dim=dim)
        return [s for _, _, s in res], out, torch.cat([l_p, l_r], dim=dim)

    def backward() -> tuple[Tensor, Tensor, Tensor]:
        saved, out, lse = forward()
        outs = [prompt(out), resp(out), kernel.split(resp(out), n)]
        lses = [prompt(lse), resp(lse), kernel.split(resp(lse), n)]
        g = [
            kernel.backward(do, qq, kk, vv, o, lse_, s, causal, segs)
            for (qq, kk, vv, causal, segs), do, o, lse_, s in zip(passes, douts, outs, lses, saved)
        ]
        join = lambda x: kernel.join(x, n)  # noqa: E731
        dq = torch.cat([g[0][0], g[1][0] + join(g[2][0])], dim=dim)
        dk = torch.cat([g[0][1] + g[1][1], join(g[2][1])], dim=dim)
        dv = torch.cat([g[0][2] + g[1][2], join(g[2][2])], dim=dim)
        return dq, dk, dv

    def packed_grads() -> tuple[Tensor, Tensor, Tensor]:
        dq, dk, dv = (kernel.packed(x) for x in backward())
        # the query heads of a KV head summed (a kernel that took K/V expanded)
        heads = lambda x: wide(x).unflatten(1, (c.hkv, -1)).sum(2)  # noqa: E731
        return dq, heads(dk), heads(dv)

    return Runner(lambda: forward()[1], backward, lambda: kernel.packed(forward()[1]), packed_grads)


class AtenKernel(PassKernel):
    """PyTorch's cuDNN (`backend="cudnn"`) or memory-efficient (`"mem"`) attention ops: layout
    [B, H, L, D], K/V expanded to all query heads, segments as the batch."""

    dim = 2

    def __init__(self, c: Case, backend: str) -> None:
        self.c, self.backend = c, backend

    def inputs(self, c: Case) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        expand = lambda t: t.repeat_interleave(c.hq // c.hkv, 1)  # noqa: E731
        q, k, v, dout = (t.transpose(0, 1)[None] for t in (c.q, expand(c.k), expand(c.v), c.dout))
        return q, k, v, dout

    def split(self, x: Tensor, segments: int) -> Tensor:  # [1, H, n*R, E] -> [n, H, R, E]
        return x.reshape(x.shape[1], segments, -1, x.shape[-1]).transpose(0, 1)

    def join(self, x: Tensor, segments: int) -> Tensor:
        return x.transpose(0, 1).reshape(1, x.shape[1], -1, x.shape[-1])

    def packed(self, x: Tensor) -> Tensor:
        return x[0].transpose(0, 1)

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, segments: int
    ) -> tuple[Tensor, Tensor, Any]:
        aten, scale = torch.ops.aten, self.c.scale
        if self.backend == "mem":
            res = aten._scaled_dot_product_efficient_attention(
                q, k, v, None, True, 0.0, causal, scale=scale
            )
            lse = res[1][..., : res[0].shape[2]]  # [B, H, L rounded up]
        else:
            res = aten._scaled_dot_product_cudnn_attention(
                q, k, v, None, True, 0.0, causal, False, scale=scale
            )
            lse = res[1].reshape(res[0].shape[:3])
        return res[0], lse[..., None], res

    def backward(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        saved: Any,
        causal: bool,
        segments: int,
    ) -> tuple[Tensor, Tensor, Tensor]:
        aten, scale, rr = torch.ops.aten, self.c.scale, saved
        dout, out, lse = dout.contiguous(), out.contiguous(), lse[..., 0]
        if self.backend == "mem":
            lse_pad = F.pad(lse, (0, rr[1].shape[-1] - lse.shape[-1])).contiguous()
            flags = [True, True, True, False]
            return aten._scaled_dot_product_efficient_attention_backward(
                dout, q, k, v, None, out, lse_pad, rr[2], rr[3], 0.0, flags, causal, scale=scale
            )[:3]
        return aten._scaled_dot_product_cudnn_attention_backward(
            dout,
            q,
            k,
            v,
            out,
            lse.contiguous().view_as(rr[1]),
            rr[6],
            rr[7],
            None,  # attn_bias: undefined (no bias), as autograd passes it
            rr[2],
            rr[3],
            rr[4],
            rr[5],
            0.0,
            causal,
            scale=scale,
        )


class FlashKernel(PassKernel):
    """A FlashAttention-style forward/backward pair (FA4's `_flash_attn_fwd` / `_flash_attn_bwd`,
    ffpa-attn's Hopper functions, which take the same arguments) on the packed [T, H, D]
    layout, GQA native: one sequence as a batch of 1, equal segments as varlen sequences."""

    def __init__(self, c: Case, fwd: Callable[..., Any], bwd: Callable[..., Any]) -> None:
        self.c, self.fwd, self.bwd = c, fwd, bwd
        self.cu: dict[tuple[int, int], Tensor] = {}  # cumulative lengths per (segments, tokens)

    def _varlen(self, length: int, segments: int) -> dict[str, Any]:
        if segments == 1:
            return {}
        if (segments, length) not in self.cu:  # built once, before the timed calls
            cu = torch.arange(0, length + 1, length // segments, device=self.c.q.device)
            self.cu[(segments, length)] = cu.to(torch.int32)
        cu = self.cu[(segments, length)]
        m = length // segments
        return dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=m, max_seqlen_k=m)

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, segments: int
    ) -> tuple[Tensor, Tensor, Any]:
        varlen = self._varlen(q.shape[0], segments)
        if not varlen:
            q, k, v = q[None], k[None], v[None]
        res = self.fwd(
            q, k, v, softmax_scale=self.c.scale, causal=causal, return_lse=True, **varlen
        )
        out, lse = (res[0], res[1]) if varlen else (res[0][0], res[1][0])
        return out, lse.t()[..., None], None  # lse [H, L] -> [L, H, 1]

    def backward(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        saved: Any,
        causal: bool,
        segments: int,
    ) -> tuple[Tensor, Tensor, Tensor]:
        varlen = self._varlen(q.shape[0], segments)
        ts = [dout, q, k, v, out, lse[..., 0].t().contiguous()]
        if not varlen:
            ts = [t[None] for t in ts]
        dout, q, k, v, out, lse = ts
        dq, dk, dv = self.bwd(
            q, k, v, out, dout, lse, softmax_scale=self.c.scale, causal=causal, **varlen
        )[:3]
        return (dq, dk, dv) if varlen else (dq[0], dk[0], dv[0])


def _import(what: str, package: str) -> Any:
    """`what` imported, or Skip naming the package (not installed, or its CUDA libraries not
    loadable here)."""
    import importlib

    module, _, attr = what.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except Exception as e:  # ImportError, or OSError/RuntimeError from a native library
        raise Skip(f"{package} not available ({type(e).__name__}: {str(e)[:100]})") from e


def run_fa4_rows(c: Case) -> Runner:
    varlen = _import("flash_attn.cute.interface.flash_attn_varlen_func", "flash-attn-4")

    def attend(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, m: int) -> Tensor:
        out, _ = varlen(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=m,
                        max_seqlen_k=m, softmax_scale=c.scale, causal=True)  # fmt: skip
        return out

    return run_varlen_rows(c, attend)


def run_ffpa_rows(c: Case) -> Runner:
    varlen = _import("ffpa_attn.ffpa_attn_varlen_func", "ffpa-attn")

    def attend(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, m: int) -> Tensor:
        return varlen(q, k, v, cu, cu, m, m, softmax_scale=c.scale, causal=True, enable_gqa=True)

    return run_varlen_rows(c, attend)


def fa4_kernel(c: Case) -> PassKernel:
    fwd = _import("flash_attn.cute.interface._flash_attn_fwd", "flash-attn-4")
    bwd = _import("flash_attn.cute.interface._flash_attn_bwd", "flash-attn-4")
    return FlashKernel(c, fwd, bwd)


def ffpa_kernel(c: Case) -> PassKernel:
    """ffpa-attn's functions for this GPU and head dim (the ones ffpa_attn_varlen_func runs)."""
    fwd_for = _import("ffpa_attn.cute._forward_impl_for_device", "ffpa-attn")
    bwd_for = _import("ffpa_attn.cute._backward_impl_for_device", "ffpa-attn")
    dev = c.q.device
    return FlashKernel(c, fwd_for(dev, c.d, c.d), bwd_for(dev, c.d, c.d))


SDPB = torch.nn.attention.SDPBackend
RUNNERS: dict[str, Callable[[Case], Runner]] = {
    "dualkv": run_dualkv,
    "sdpa_cudnn": lambda c: run_sdpa(c, SDPB.CUDNN_ATTENTION),
    "sdpa_fa2": lambda c: run_sdpa(c, SDPB.FLASH_ATTENTION),
    "sdpa_mem": lambda c: run_sdpa(c, SDPB.EFFICIENT_ATTENTION),
    "flex": run_flex,
    "cudnn_3pass": lambda c: run_3pass(c, AtenKernel(c, "cudnn")),
    "mem_3pass": lambda c: run_3pass(c, AtenKernel(c, "mem")),
    "fa4-rows": run_fa4_rows,
    "fa4-3pass": lambda c: run_3pass(c, fa4_kernel(c)),
    "ffpa-rows": run_ffpa_rows,
    "ffpa-3pass": lambda c: run_3pass(c, ffpa_kernel(c)),
}


def make_runner(method: str, c: Case) -> Runner:
    if method not in RUNNERS:
        raise ValueError(f"unknown method {method!r}; choose from {METHODS + EXTRA_METHODS}")
    lo, hi, why = HEAD_DIMS.get(method, (1, 1 << 20, ""))
    if not lo <= c.d <= hi:
        raise Skip(why)
    return RUNNERS[method](c)


def max_err(a: Tensor, b: Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def rows_reference(c: Case, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Plain PyTorch causal attention on each unshared row of `c`, in q's dtype; each packed
    token's output read from its source row: [T, Hq, D]. Differentiable (the rows are gathered
    from the packed tensors, so a shared token's dk/dv sum over its rows)."""
    g = c.hq // c.hkv
    cu = c.rows_cu.tolist()
    outs = []
    for a, b in zip(cu[:-1], cu[1:]):
        idx = c.rows_index[a:b]
        kk, vv = (x[idx].repeat_interleave(g, 1) for x in (k, v))
        s = torch.einsum("qhd,khd->hqk", q[idx], kk) * c.scale
        future = torch.ones(b - a, b - a, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(future, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), vv))
    return torch.cat(outs)[c.rows_source]


def check_methods(
    methods: list[str], hq: int, hkv: int, d: int, device: str = "cuda", tree: bool = False
) -> dict[str, str]:
    """Each method's output and dq/dk/dv at CHECK_LAYOUT (`tree`: CHECK_TREE) with these heads,
    against the float64 reference of the unshared rows (rows_reference), by FlashAttention's rule
    as the package's tests apply it: error <= 2x (output) / 3x (gradients) the error of the plain
    PyTorch rows in the same precision, plus 1e-4 (gradients: at least 2 ulps of the reference).
    Prints a line per method; returns {method: "ok" | "FAIL ..." | "skipped: ..." | "error:
    ..."}."""
    n, p, r = CHECK_LAYOUT
    c = Case(CHECK_TREE if tree else [(p, [r] * n)], hq, hkv, d, device=device, seed=1)

    def rows(dtype: torch.dtype) -> list[Tensor]:
        q, k, v = (t.detach().to(dtype).requires_grad_() for t in (c.q, c.k, c.v))
        out = rows_reference(c, q, k, v)
        out.backward(c.dout.to(dtype))
        return [t.detach() for t in (out, *grads_of([q, k, v]))]

    exact, plain = rows(torch.float64), rows(c.q.dtype)
    ulps = [0.0] + [2 * max_err(g.to(c.q.dtype) + 0.3 - 0.3, g.to(c.q.dtype)) for g in exact[1:]]
    status: dict[str, str] = {}
    where = f"tree {CHECK_TREE.lengths}" if tree else f"N={n} P={p} R={r}"
    print(f"check at {where} Hq={hq} Hkv={hkv} D={d} (max error vs float64; "
          "PyTorch rows in the same precision in brackets):", flush=True)  # fmt: skip
    for m in methods:
        try:
            run = make_runner(m, c)
            with torch.no_grad():
                out = run.packed_out()
            got = [out, *run.packed_grads()]
        except Skip as e:
            status[m] = f"skipped: {e}"
        except Exception as e:  # a method that cannot run at all: reported, not timed
            status[m] = f"error: {type(e).__name__}: {str(e)[:120]}"
        else:
            errs, fails = [], []
            for name, g, ref, pl, factor, ulp in zip(
                ("out", "dq", "dk", "dv"), got, exact, plain, (2, 3, 3, 3), ulps
            ):
                err, base = max_err(g, ref), max_err(pl, ref)
                bound = factor * base + max(1e-4, ulp)
                errs.append(f"{name} {err:.1e} [{base:.1e}]")
                if not (g.shape == ref.shape and err <= bound):  # NaN fails too
                    fails.append(f"{name} {err:.2e} > {bound:.2e}")
            status[m] = "FAIL " + ", ".join(fails) if fails else "ok"
            print(f"  {m:<12} {', '.join(errs)}", flush=True)
        if not status[m].startswith("ok"):
            print(f"  {m:<12} {status[m]}", flush=True)
        torch.cuda.empty_cache() if device == "cuda" else None
    return status


def tree_summary(rows: list[dict]) -> list[str]:
    """Issue 33's comparisons from timed rows (attention.json's, any runs together), one line per
    tree shape timed with dualkv: its fwd+bwd TF/s against DualKV's on the depth-two twin with
    the same heads (bar: >= 0.90), and its speed-up over FlexAttention with the tree mask and
    over each rows method (time ratios; bar against Flex: >= 2x), with the token reduction."""
    timed = {(r["shape"], r["method"]): r for r in rows if "fwd_bwd_ms" in r}
    out = []
    for (shape, method), r in timed.items():
        name = shape.split(" ")[0]
        if method != "dualkv" or name not in TREES:
            continue
        heads = shape[shape.index(" Hq=") :]
        n, p, rr = TREES[name]().twin()
        twin = timed.get((f"N={n} P={p} R={rr}{heads}", "dualkv"))
        parts = [f"{shape}: rho {r.get('rho', float('nan')):.2f}, DualKV "
                 f"{r['fwd_bwd_tflops']:.0f} TF/s"]  # fmt: skip
        if twin is not None:
            ratio = r["fwd_bwd_tflops"] / twin["fwd_bwd_tflops"]
            parts.append(f"{ratio:.2f} of the depth-two twin's {twin['fwd_bwd_tflops']:.0f} "
                         f"(bar 0.90: {'met' if ratio >= 0.9 else 'NOT met'})")  # fmt: skip
        for (s2, m2), o in timed.items():
            if s2 == shape and m2 != "dualkv":
                speed = o["fwd_bwd_ms"] / r["fwd_bwd_ms"]
                bar = f" (bar 2x: {'met' if speed >= 2 else 'NOT met'})" if m2 == "flex" else ""
                parts.append(f"{speed:.2f}x {m2}{bar}")
        out.append("; ".join(parts))
    return out


def parse_shapes(args: argparse.Namespace, ap: argparse.ArgumentParser) -> list[tuple]:
    """The shapes to time: --shape / --multi, else --shapes (indices into SHAPES or names of
    SHAPE_SETS), filtered by --head-dims."""
    shapes = [tuple(int(x) for x in sh.split(",")) for sh in args.shape]
    if any(len(sh) != 6 for sh in shapes):
        ap.error("--shape takes six integers N,P,R,Hq,Hkv,D")
    multi = [tuple(int(x) for x in sh.split(",")) for sh in args.multi]
    if any(len(sh) != 3 for sh in multi):
        ap.error("--multi takes three integers Hq,Hkv,D")
    shapes += [(0, 0, 0, *sh) for sh in multi]
    for spec in args.tree:
        name, *heads = spec.split(",")
        if name not in TREES or len(heads) != 3 or not all(h.isdigit() for h in heads):
            ap.error(f"--tree takes NAME,Hq,Hkv,D with NAME one of {list(TREES)}, got {spec!r}")
        shapes.append((name, 0, 0, *(int(h) for h in heads)))
    if not shapes:
        picked: list[int] = []
        for s in args.shapes.split(","):
            if s in SHAPE_SETS:
                picked += SHAPE_SETS[s]
            elif s.isdigit() and int(s) < len(SHAPES):
                picked.append(int(s))
            else:
                ap.error(f"--shapes: {s!r} is neither an index < {len(SHAPES)} nor one of "
                         f"{list(SHAPE_SETS)}")  # fmt: skip
        shapes = [SHAPES[i] for i in dict.fromkeys(picked)]
    if args.head_dims:
        dims = {int(x) for x in args.head_dims.split(",")}
        shapes = [sh for sh in shapes if sh[5] in dims]
    if not shapes:
        ap.error("no shape selected")
    return shapes


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[tuple], list[str]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--shapes",
        default="packed",
        help=f"indices into SHAPES and/or set names {list(SHAPE_SETS)}, comma-separated",
    )
    ap.add_argument(
        "--shape",
        action="append",
        default=[],
        metavar="N,P,R,Hq,Hkv,D",
        help="a shape of your own (repeatable; R = 0, N = 1: plain causal); replaces --shapes",
    )
    ap.add_argument(
        "--multi",
        action="append",
        default=[],
        metavar="Hq,Hkv,D",
        help="the realistic micro-batch (realistic_groups) with these heads (repeatable); "
        "replaces --shapes",
    )
    ap.add_argument(
        "--tree",
        action="append",
        default=[],
        metavar="NAME,Hq,Hkv,D",
        help=f"a prefix-tree batch of bench/trees.py ({', '.join(TREES)}) with these heads "
        "(repeatable); replaces --shapes",
    )
    ap.add_argument(
        "--tree-segments",
        choices=["packed", "listed"],
        default="packed",
        help="the tree batches' segments: as dualkv.pack(tree=True) makes them (they end where "
        "rows branch; default) or as bench/trees.py lists them (a segment per turn)",
    )
    ap.add_argument("--head-dims", help="keep only the shapes of these head dims, e.g. 64,128")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="time the methods in turn this many times (every other round in reverse) and "
        "report the median of the rounds",
    )
    ap.add_argument(
        "--lead-spin",
        action="store_true",
        help="queue ~1 ms of GPU spin before each timed call, so that the events time the "
        "GPU's work without the host's launch latency (for every method alike)",
    )
    ap.add_argument(
        "--no-check",
        dest="check",
        action="store_false",
        help="skip the correctness check at CHECK_LAYOUT (and time every method)",
    )
    ap.add_argument(
        "--budget",
        type=float,
        metavar="SECONDS",
        help="start no shape later than this after the start (the rest are listed as not run), "
        "so that a run under a time limit still ends with its table and JSON",
    )
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/out"))
    ap.add_argument(
        "--summary",
        nargs="+",
        metavar="JSON",
        help="print the tree comparisons (tree_summary) of these attention.json files and exit",
    )
    args = ap.parse_args(argv)
    if args.summary:
        return args, [], []
    methods = [m for m in args.methods.split(",") if m]
    for m in methods:
        if m not in RUNNERS:
            ap.error(f"unknown method {m!r}; choose from {METHODS + EXTRA_METHODS}")
    return args, parse_shapes(args, ap), methods


def main() -> None:
    start = time.monotonic()
    args, shapes, methods = parse_args()
    if args.summary:
        rows = []
        for path in args.summary:
            with open(path) as f:
                rows += json.load(f)["rows"]
        print("\n".join(tree_summary(rows)) or "no tree shape timed with dualkv")
        return
    rows = []
    # the check per head configuration, at CHECK_LAYOUT and (for tree shapes) at CHECK_TREE
    checks: dict[tuple[tuple[int, int, int], bool], dict[str, str]] = {}
    if args.check:
        for heads, tree in dict.fromkeys((sh[3:], isinstance(sh[0], str)) for sh in shapes):
            checks[(heads, tree)] = check_methods(methods, *heads, tree=tree)
    reductions: dict[str, float] = {}

    def save() -> None:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "attention.json"), "w") as f:
            json.dump(
                dict(
                    gpu=torch.cuda.get_device_name(),
                    torch=torch.__version__,
                    lead_spin=args.lead_spin,
                    checks={
                        ",".join(map(str, heads)) + (",tree" if tree else ""): v
                        for (heads, tree), v in checks.items()
                    },
                    token_reduction=reductions,
                    rows=rows,
                ),
                f,
                indent=1,
            )

    for i, (n, p, r, hq, hkv, d) in enumerate(shapes):
        if args.budget is not None and time.monotonic() - start > args.budget:
            print(f"--budget {args.budget:.0f} s spent: not run {shapes[i:]}", flush=True)
            break
        is_tree = isinstance(n, str)
        if is_tree:
            tree = TREES[n]()
            c = Case(tree, hq, hkv, d, tree_segments=args.tree_segments)
            shape = f"{n} T={c.layout.total_tokens} Hq={hq} Hkv={hkv} D={d}"
            print(f"{tree.describe()}; depth-two twin N,P,R = {','.join(map(str, tree.twin()))}")
        else:
            groups = realistic_groups() if n == 0 else [(p, [r] * n)]
            c = Case(groups, hq, hkv, d)
            shape = f"N={n} P={p} R={r} Hq={hq} Hkv={hkv} D={d}"
            if n == 0:
                shape = f"multi T={c.layout.total_tokens} Hq={hq} Hkv={hkv} D={d}"
                per_group = [(p, len(rs), sum(rs), max(rs)) for p, rs in groups]
                print(f"{shape}: (P, N, sum R, max R) per group {per_group}")
        reductions[shape] = c.rho
        # The methods in turn, every other round in reverse (--rounds): a GPU's clocks follow its
        # recent load, so a method timed right after an idle moment or after a heavy one is not
        # timed like the others; each figure is the median over the rounds.
        reference = None  # the first method's output (DualKV's by default): all must agree with it
        times: dict[str, list[tuple[float, float]]] = {m: [] for m in methods}
        diffs: dict[str, float] = {}
        errors: dict[str, str] = {}
        for m in methods:  # failed the check: not timed (a wrong baseline is worse than none)
            status = checks.get(((hq, hkv, d), is_tree), {}).get(m, "ok")
            if status.startswith("FAIL"):
                errors[m] = f"not timed: failed the correctness check ({status[5:][:90]})"
        for rnd in range(args.rounds):
            for m in methods if rnd % 2 == 0 else methods[::-1]:
                if m in errors:
                    continue
                try:
                    fwd, fb, packed_out, _ = make_runner(m, c)
                    with torch.no_grad():
                        if rnd == 0:
                            out = packed_out().float()
                            reference = out if reference is None else reference
                            diffs[m] = (out - reference).abs().max().item()
                            del out
                        t_f = time_ms(fwd, args.warmup, args.repeats, args.lead_spin)
                    t_fb = time_ms(fb, args.warmup, args.repeats, args.lead_spin)
                    times[m].append((t_f, t_fb))
                except Skip as e:
                    errors[m] = f"skipped: {e}"
                except Exception as e:  # a baseline that cannot run this shape (e.g. out of memory)
                    errors[m] = f"{type(e).__name__}: {str(e)[:120]}"
                torch.cuda.empty_cache()
        for m in methods:
            if m in errors:
                rows.append(dict(shape=shape, method=m, error=errors[m]))
            else:
                t_f = statistics.median(t[0] for t in times[m])
                t_fb = statistics.median(t[1] for t in times[m])
                rows.append(
                    dict(
                        shape=shape,
                        method=m,
                        fwd_ms=t_f,
                        fwd_bwd_ms=t_fb,
                        fwd_tflops=c.flops_fwd / t_f / 1e9,
                        fwd_bwd_tflops=(c.flops_fwd + c.flops_bwd) / t_fb / 1e9,
                        max_diff=diffs[m],
                        rounds=len(times[m]),
                        rho=reductions[shape],
                    )
                )
            print_row(rows[-1], flush=True)  # as it comes: a run cut short keeps its figures
        del c
        torch.cuda.empty_cache()
        save()  # after each shape: a run stopped by a time limit keeps the shapes it timed
    save()
    timing = "GPU time (--lead-spin)" if args.lead_spin else "host launch latency included"
    print(
        f"\nGPU {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, {timing}; "
        "TF/s = useful TFLOP/s on the packed layout's FLOP count; max|diff| = forward output "
        "vs the first method's"
    )
    head = ("shape", "method", "fwd ms", "fwd TF/s", "f+b ms", "f+b TF/s", "max|diff|")
    print("{:<38} {:<12} {:>8} {:>9} {:>8} {:>9} {:>9}".format(*head))
    for row in rows:
        print_row(row)
    print("token reduction rho (unshared row tokens / packed tokens): " + ", ".join(
        f"{shape.split(' Hq')[0]} {rho:.2f}" for shape, rho in reductions.items()))  # fmt: skip
    for line in tree_summary(rows):
        print(line)
    try:
        plot(rows, os.path.join(args.out, "attention.png"))
    except ImportError:
        print("matplotlib not installed: no plot")


def print_row(row: dict, flush: bool = False) -> None:
    if "error" in row:
        print(f"{row['shape']:<38} {row['method']:<12} {row['error']}", flush=flush)
    else:
        print(
            f"{row['shape']:<38} {row['method']:<12} {row['fwd_ms']:8.2f} "
            f"{row['fwd_tflops']:9.1f} {row['fwd_bwd_ms']:8.2f} {row['fwd_bwd_tflops']:9.1f} "
            f"{row['max_diff']:9.1e}",
            flush=flush,
        )


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / len(methods)
    for mi, m in enumerate(methods):
        vals = [
            next(
                (r.get("fwd_bwd_tflops", 0) for r in rows if r["shape"] == s and r["method"] == m),
                0,
            )
            for s in shapes
        ]
        ax.bar([i + mi * width for i in range(len(shapes))], vals, width, label=m)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(shapes))])
    ax.set_xticklabels([s.replace(" Hq", "\nHq") for s in shapes], fontsize=7)
    ax.set_ylabel("useful TFLOP/s (fwd+bwd)")
    ax.set_title(f"Shared-prompt attention, {torch.cuda.get_device_name()}, bf16")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
