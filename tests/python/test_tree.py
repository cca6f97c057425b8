"""Prefix trees (dualkv.Layout.tree): attention on a packed forest equals causal attention on
every root-to-leaf path as its own row (DESIGN.md, "Prefix trees"); outputs, lse and gradients,
the gradients of a token shared by several rows summed over them. Plus the layout's structure,
counts and validation.

The oracle here is written from DESIGN.md alone: the paths are extracted from the user's
parents / lengths, each row is plain causal attention at positions 0..L-1, and every packed token
takes its output from the first row holding it (so a loss counts it once, as on the packed
stream). Tolerances are test_attention.py's (FlashAttention's rule)."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest
import torch

import dualkv
from test_attention import GRAD_SLACK, SLACK, assert_close, grad_atol

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
Forest = tuple[list[int], list[int]]


# ---- forests ---------------------------------------------------------------------------------


def random_forest(
    rng: random.Random,
    depth: int,
    branching: int,
    max_len: int,
    order: str,
    max_segments: int = 16,
    long_len: int = 0,
) -> Forest:
    """``(parents, lengths)`` of a random forest: 1-2 trees, one path exactly ``depth`` segments
    deep, up to ``branching`` children per segment (at most ``max_segments`` segments in all),
    many empty and one-token segments, and one segment of ``long_len`` tokens when > 0. Listed in
    ``order``: "dfs" (pre-order), "bfs" (level by level) or "any" (a random order that keeps
    each parent before its children)."""
    parent: list[int] = []  # over node ids, in creation (level) order
    level: list[int] = []
    for _ in range(rng.randint(1, 2)):
        parent.append(-1)
        level.append(0)
    spine = 0  # the deepest segment so far of the path of `depth` segments from node 0
    i = 0
    while i < len(parent):
        if level[i] + 1 < depth:
            on_spine = i == spine
            # Room left, keeping one segment for each level the path still has to reach (the
            # spine's first child is one of them).
            room = max_segments - len(parent) - (depth - 1 - level[spine]) + on_spine
            for c in range(min(rng.randint(1 if on_spine else 0, branching), room)):
                parent.append(i)
                level.append(level[i] + 1)
                if on_spine and c == 0:
                    spine = len(parent) - 1
        i += 1
    n = len(parent)
    children: list[list[int]] = [[] for _ in range(n)]
    for c, p in enumerate(parent):
        if p >= 0:
            children[p].append(c)
    roots = [c for c in range(n) if parent[c] < 0]
    if order == "bfs":
        listing = list(range(n))
    elif order == "dfs":
        listing, stack = [], roots[::-1]
        while stack:
            node = stack.pop()
            listing.append(node)
            stack.extend(children[node][::-1])
    else:
        listing, ready = [], list(roots)
        while ready:
            node = ready.pop(rng.randrange(len(ready)))
            listing.append(node)
            ready.extend(children[node])
    index = {node: j for j, node in enumerate(listing)}

    def length() -> int:
        u = rng.random()
        return 0 if u < 0.15 else 1 if u < 0.3 else rng.randint(2, max_len)

    parents = [index[parent[node]] if parent[node] >= 0 else -1 for node in listing]
    lengths = [length() for _ in listing]
    if long_len:
        lengths[rng.randrange(n)] = long_len
    return parents, lengths


def paths(parents: list[int]) -> list[list[int]]:
    """The root-to-leaf paths (segment indices, root first), one per leaf, leaves in order."""
    has_child = set(parents)
    out = []
    for leaf in range(len(parents)):
        if leaf in has_child:
            continue
        path = [leaf]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        out.append(path[::-1])
    return out


def segment_starts(lengths: list[int]) -> list[int]:
    starts, at = [], 0
    for n in lengths:
        starts.append(at)
        at += n
    return starts


def row_tokens(parents: list[int], lengths: list[int]) -> list[torch.Tensor]:
    """Packed token indices of each root-to-leaf row, in row order."""
    starts = segment_starts(lengths)
    return [
        torch.tensor([t for s in path for t in range(starts[s], starts[s] + lengths[s])],
                     dtype=torch.int64)
        for path in paths(parents)
    ]  # fmt: skip


def oracle_mask(parents: list[int], lengths: list[int], window: int | None) -> torch.Tensor:
    """``allowed [T, T]``: k's segment is an ancestor of q's, or both are in one segment with
    pos(k) <= pos(q); with a window also pos(q) - pos(k) < window (positions along the path)."""
    T = sum(lengths)
    allowed = torch.zeros(T, T, dtype=torch.bool)
    for idx in row_tokens(parents, lengths):
        pos = torch.arange(len(idx))
        diff = pos[:, None] - pos[None, :]
        ok = diff >= 0
        if window is not None:
            ok &= diff < window
        allowed[idx[:, None], idx[None, :]] |= ok
    return allowed


# ---- the row oracle --------------------------------------------------------------------------


def causal_row(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    window: int | None,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of one row at positions 0..L-1 in q's dtype: out [L, Hq, D], lse [Hq, L]
    (float32, or float64 for float64 inputs)."""
    hq, hkv = q.shape[1], k.shape[1]
    kk, vv = (x.repeat_interleave(hq // hkv, dim=1) for x in (k, v))
    s = torch.einsum("qhd,khd->hqk", q, kk) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(q.shape[0], device=q.device)
    diff = i[:, None] - i[None, :]
    allowed = diff >= 0
    if window is not None:
        allowed &= diff < window
    s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s.double() if q.dtype == torch.float64 else s.float(), dim=-1)
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), vv), lse


def rows_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    forest: Forest,
    scale: float,
    window: int | None,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every root-to-leaf row run on its own (gathered from the packed tensors, so autograd sums
    a shared token's gradients over its rows); each token's out / lse from the first row holding
    it. ``(out [T, Hq, D], lse [Hq, T])``."""
    T = q.shape[0]
    out = q.new_zeros(q.shape)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse = torch.full((q.shape[1], T), float("-inf"), device=q.device, dtype=lse_dtype)
    done = torch.zeros(T, dtype=torch.bool)
    for idx in row_tokens(*forest):
        if not len(idx):
            continue
        new = ~done[idx]
        done[idx] = True
        if not new.any():
            continue
        dev = idx.to(q.device)
        o, l_ = causal_row(q[dev], k[dev], v[dev], scale, window, softcap)
        take = new.to(q.device)
        out = out.index_copy(0, dev[take], o[take])
        lse = lse.index_copy(1, dev[take], l_[:, take])
    assert bool(done.all()) or T == 0, "a token in no row"
    return out, lse


# ---- one comparison ---------------------------------------------------------------------------


def grads(
    fn: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    inputs: list[torch.Tensor],
    dout: torch.Tensor,
    dlse: torch.Tensor,
) -> list[torch.Tensor]:
    """[out, lse, dq, dk, dv] of loss = sum(out * dout) + sum(lse * dlse)."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out, lse = fn(*leaves)
    loss = (out.to(dout.dtype) * dout).sum() + (lse.to(dlse.dtype) * dlse).sum()
    if loss.requires_grad:
        loss.backward()
    return [out.detach(), lse.detach()] + [
        t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves
    ]


def run_tree_case(
    forest: Forest,
    hq: int,
    hkv: int,
    d: int,
    dtype: torch.dtype,
    device: str,
    window: int | None,
    softcap: float,
    seed: int,
    deterministic: bool = False,
) -> list[torch.Tensor]:
    """Checks dualkv.attention on the forest against the row oracle (float64, on `device`) with
    test_attention's tolerances; the plain low-precision yardstick is the same oracle run in
    `dtype`. Returns the kernel's [out, lse, dq, dk, dv]."""
    layout = dualkv.Layout.tree(*forest, device=device)
    T = layout.total_tokens
    assert T == sum(forest[1])
    gen = torch.Generator().manual_seed(seed)
    q64, k64, v64 = (
        torch.randn(T, h, d, generator=gen, dtype=torch.float64) for h in (hq, hkv, hkv)
    )
    dout64 = torch.randn(T, hq, d, generator=gen, dtype=torch.float64)
    dlse64 = torch.randn(hq, T, generator=gen, dtype=torch.float64)
    q, k, v = (t.to(dtype) for t in (q64, k64, v64))  # the oracle sees exactly these values
    scale = 1.0 / math.sqrt(d)
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32

    def oracle(dt: torch.dtype) -> list[torch.Tensor]:
        return grads(
            lambda *x: rows_attention(*x, forest, scale, window, softcap),
            [t.to(device, dt) for t in (q, k, v)],
            dout64.to(device, dt),
            dlse64.to(device, torch.float64 if dt == torch.float64 else torch.float32),
        )

    got = grads(
        lambda *x: dualkv.attention(
            *x, layout, window=window, softcap=softcap, return_lse=True, deterministic=deterministic
        ),
        [t.to(device) for t in (q, k, v)],
        dout64.to(device, dtype),
        dlse64.to(device, lse_dtype),
    )
    exact = oracle(torch.float64)
    plain = exact if dtype == torch.float64 else oracle(dtype)
    for name, g, r, p, factor in zip(
        ["out", "lse", "dq", "dk", "dv"], got, exact, plain, [2, 2, 3, 3, 3]
    ):
        assert g.shape == r.shape, f"{name}: shape {tuple(g.shape)} != {tuple(r.shape)}"
        slack = (GRAD_SLACK if name.startswith("d") else SLACK)[dtype]
        if name.startswith("d"):
            slack = max(slack, grad_atol(r, dtype))
        assert_close(name, g, r, p, factor, slack)
    return got


def draw_forest(rng: random.Random, order: str, long_len: int, max_len: int = 24) -> Forest:
    return random_forest(
        rng, depth=rng.randint(1, 5), branching=rng.randint(1, 8), max_len=max_len,
        order=order, long_len=long_len,
    )  # fmt: skip


GQA = pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (8, 1)], ids=["1:1", "4:1", "MQA"])


@GQA
@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize("softcap", [0.0, 5.0])
def test_equivalence_cpu_fp64(
    hq: int, hkv: int, window: int | None, softcap: float, seed: int
) -> None:
    """Random forests in fp64 on the CPU: depth 1-5, branching 1-8, empty and one-token
    segments, a segment across the 128-token tile, breadth-first, depth-first and other orders."""
    rng = random.Random(seed)
    for order, long_len in [("bfs", rng.randint(129, 200)), ("dfs", 0), ("any", 0)]:
        forest = draw_forest(rng, order, long_len)
        print(f"forest {forest}")
        run_tree_case(forest, hq, hkv, 64, torch.float64, "cpu", window, softcap, seed)


def test_equivalence_cpu_bf16(seed: int) -> None:
    """One low-precision CPU case (the tolerance rule against the bf16 rows)."""
    rng = random.Random(seed)
    forest = draw_forest(rng, "bfs", rng.randint(129, 200))
    print(f"forest {forest}")
    run_tree_case(forest, 8, 2, 64, torch.bfloat16, "cpu", 37, 5.0, seed)


EDGE_FORESTS: list[Forest] = [
    ([], []),  # nothing
    ([-1, 0, -1], [0, 0, 0]),  # only empty segments: T = 0
    ([-1], [5]),  # one root
    ([-1, 0, 1, 2, 3], [1, 1, 1, 1, 1]),  # a chain of one-token segments
    ([-1, 0, 0, 1, 1], [0, 3, 0, 2, 1]),  # an empty root and an empty inner segment
    ([-1, 0, 0, 1], [130, 129, 1, 257]),  # breadth-first, lengths off the 128-token tile
    ([-1, -1, 0, 1, 2, 0], [1, 2, 1, 1, 1, 3]),  # two trees interleaved
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("forest", EDGE_FORESTS, ids=[str(i) for i in range(len(EDGE_FORESTS))])
def test_edge_forests(device: str, forest: Forest, seed: int) -> None:
    dtype = torch.float64 if device == "cpu" else torch.bfloat16
    run_tree_case(forest, 4, 2, 64, dtype, device, None, 0.0, seed)
    run_tree_case(forest, 4, 2, 64, dtype, device, 2, 3.0, seed + 1)
    if device == "cuda":
        run_tree_case(forest, 4, 2, 512, dtype, device, None, 0.0, seed + 2)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256, 512])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@GQA
@pytest.mark.parametrize("window,softcap", [(None, 0.0), (37, 5.0)])
def test_equivalence_gpu(
    d: int, dtype: torch.dtype, hq: int, hkv: int, window: int | None, softcap: float, seed: int
) -> None:
    """The CUDA kernels on random forests (longer segments than the CPU cases), every head dim."""
    rng = random.Random(seed)
    for order, long_len in [("bfs", rng.randint(129, 400)), ("dfs", rng.randint(129, 300)),
                            ("any", 0)]:  # fmt: skip
        forest = draw_forest(rng, order, long_len, max_len=200)
        print(f"forest {forest}")
        run_tree_case(forest, hq, hkv, d, dtype, "cuda", window, softcap, seed)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256, 512])
def test_deterministic_gpu(d: int, seed: int) -> None:
    """deterministic=True: outputs and gradients bitwise equal over repeated runs (and within the
    tolerance of the oracle)."""
    rng = random.Random(seed)
    forest = draw_forest(rng, "bfs", rng.randint(129, 400), max_len=300)
    first = run_tree_case(forest, 8, 2, d, torch.bfloat16, "cuda", 37, 0.0, seed, True)
    for _ in range(5):
        again = run_tree_case(forest, 8, 2, d, torch.bfloat16, "cuda", 37, 0.0, seed, True)
        for name, a, b in zip(["out", "lse", "dq", "dk", "dv"], first, again):
            assert torch.equal(a, b), f"{name} differs between deterministic runs"


@pytest.mark.parametrize("device", DEVICES)
def test_depth_two_as_tree_is_bitwise_the_layout(device: str, seed: int) -> None:
    """The prompt/response layout given as Layout.tree (prompt -1, responses -> their prompt):
    the same tables, and bitwise the same outputs, lse and gradients."""
    rng = random.Random(seed)
    prefix = [rng.choice([0, 1, rng.randint(2, 200)]) for _ in range(3)]
    resp = [[rng.choice([0, 1, rng.randint(2, 150)]) for _ in range(rng.randint(0, 4))]
            for _ in prefix]  # fmt: skip
    parents: list[int] = []
    lengths: list[int] = []
    for p, rs in zip(prefix, resp):
        parents += [-1] + [len(parents)] * len(rs)
        lengths += [p, *rs]
    pair = dualkv.Layout(prefix, resp, device=device)
    tree = dualkv.Layout.tree(parents, lengths, device=device)
    for name in ("segments", "query_tiles", "key_tiles", "position_ids"):
        assert torch.equal(getattr(pair, name), getattr(tree, name)), name
    assert pair.parents == tree.parents and pair.lengths == tree.lengths
    dtype = torch.float64 if device == "cpu" else torch.bfloat16
    gen = torch.Generator().manual_seed(seed)
    T = pair.total_tokens
    q, k, v, dout = (torch.randn(T, h, 64, generator=gen).to(device, dtype) for h in (8, 2, 2, 8))
    dlse = torch.randn(8, T, generator=gen).to(device)

    def run(layout: dualkv.Layout) -> list[torch.Tensor]:
        return grads(
            lambda *x: dualkv.attention(*x, layout, window=50, return_lse=True),
            [q, k, v], dout, dlse.to(torch.float64 if dtype == torch.float64 else torch.float32),
        )  # fmt: skip

    for name, a, b in zip(["out", "lse", "dq", "dk", "dv"], run(pair), run(tree)):
        assert torch.equal(a, b), name


# ---- the layout --------------------------------------------------------------------------------


def test_structure_and_positions() -> None:
    layout = dualkv.Layout.tree([-1, 0, 0, 1], [4, 3, 2, 5])
    assert layout.is_tree and not dualkv.Layout([1], [[2]]).is_tree
    assert layout.parents == (-1, 0, 0, 1) and layout.lengths == (4, 3, 2, 5)
    assert layout.num_segments == 4 and layout.total_tokens == 14
    assert layout.position_ids.tolist() == [0, 1, 2, 3, 4, 5, 6, 4, 5, 7, 8, 9, 10, 11]
    assert layout.unshared_tokens == (4 + 2) + (4 + 3 + 5)  # rows [0 | 2] and [0 | 1 | 3]
    assert layout.token_reduction == pytest.approx(18 / 14)
    # [start, len, pos0, root_start, root_len, group, parent, depth, pre, pre_end, last_desc]
    assert layout.segments.tolist() == [
        [0, 4, 0, 0, 4, 0, -1, 0, 0, 4, 3],
        [4, 3, 4, 0, 4, 0, 0, 1, 1, 3, 3],
        [7, 2, 4, 0, 4, 0, 0, 1, 3, 4, 2],
        [9, 5, 7, 0, 4, 0, 1, 2, 2, 3, 3],
    ]
    assert repr(layout).startswith("dualkv.Layout.tree(segments=4, roots=1, total_tokens=14")
    for name in ("prefix_lens", "response_lens", "num_groups", "num_responses"):
        with pytest.raises(ValueError, match="tree layout .* parents and lengths"):
            getattr(layout, name)
    moved = layout.to("meta")
    assert moved.is_tree and moved.device == torch.device("meta")
    assert moved.segments.shape == layout.segments.shape and moved.parents == layout.parents


def test_random_forests_match_brute_force(seed: int) -> None:
    """position_ids, unshared tokens, allowed_pairs and flops of random forests against the
    paths and the oracle mask."""
    rng = random.Random(seed)
    for order in ("bfs", "dfs", "any"):
        parents, lengths = draw_forest(rng, order, rng.choice([0, 140]), max_len=30)
        layout = dualkv.Layout.tree(parents, lengths)
        rows = row_tokens(parents, lengths)
        for idx in rows:
            assert layout.position_ids[idx].tolist() == list(range(len(idx)))
        assert layout.unshared_tokens == sum(len(idx) for idx in rows)
        assert layout.total_tokens == sum(lengths)
        for window in (None, 1, 5, 64):
            pairs = int(oracle_mask(parents, lengths, window).sum())
            assert layout.allowed_pairs(window) == pairs, (parents, lengths, window)
            assert layout.flops(128, 8, window) == 4 * 128 * 8 * pairs
            assert layout.flops(64, 2, window, backward=True) == 2.5 * 4 * 64 * 2 * pairs


@pytest.mark.parametrize(
    "parents,lengths,exc,match",
    [
        ([-1, 1], [1, 2], ValueError, r"parents\[1\] = 1: a segment's parent must come before"),
        ([-1, 0, 5], [1, 2, 3], ValueError, r"parents\[2\] = 5"),
        ([-2], [1], ValueError, r"parents\[0\] = -2"),
        ([2**70], [1], ValueError, r"parents\[0\] = 1180591620717411303424"),
        ([-1], [1, 2], ValueError, "parents has 1 entries but lengths has 2"),
        ([-1, 0], [1, -2], ValueError, r"lengths\[1\] = -2 is negative"),
        ([-1, 0], [2**31 - 3, 3], ValueError, r"lengths\[1\] = 3: the logical positions"),
        ([-1, -1], [2**30, 2**30], ValueError, "int32"),
        ([-1], [2**31], ValueError, r"lengths\[0\] = 2147483648 exceeds the int32"),
        ([-1, 0.0], [1, 1], TypeError, r"parents\[1\] must be an int"),
        ([-1], [True], TypeError, r"lengths\[0\] must be an int"),
        (-1, [1], TypeError, "parents must be a list of ints"),
        ([-1], "a", TypeError, "lengths must be a list of ints"),
        (torch.tensor([[-1]]), [1], TypeError, "parents must be one-dimensional"),
    ],
)
def test_invalid_trees(parents, lengths, exc, match) -> None:  # noqa: ANN001
    with pytest.raises(exc, match=match):
        dualkv.Layout.tree(parents, lengths)


def test_tensor_arguments() -> None:
    a = dualkv.Layout.tree(torch.tensor([-1, 0, 0]), torch.tensor([3, 1, 2]))
    b = dualkv.Layout.tree([-1, 0, 0], [3, 1, 2])
    assert a.parents == b.parents and torch.equal(a.segments, b.segments)


def test_inconsistent_tables_are_rejected() -> None:
    """Tables given to the op directly are checked against their own parents and lengths (the CPU
    backend reads them on the host): a changed field is an error naming the segment."""
    layout = dualkv.Layout.tree([-1, 0, 0, 1], [4, 3, 2, 5])
    T = layout.total_tokens
    q = torch.randn(T, 2, 16, dtype=torch.float64)
    for field in range(11):
        bad = layout.segments.clone()
        bad[2, field] += 1
        with pytest.raises(ValueError, match=r"layout\.segments"):
            dualkv._ops.ops.fwd(
                q, q, q, bad, layout.query_tiles, layout.key_tiles, T, 0.25, None, 0.0, False
            )
