"""bench/trees.py, the prefix-tree batches of the benchmarks (issue 33), on CPU: each shape is the
one the issue describes (structure, lengths, rows, token reduction), its tokens pack back into
the same tree, its FLOP count is the allowed pairs of the rows, and the FlexAttention tree mask
allows exactly the pairs of DESIGN.md's rule (the oracle: test_tree.oracle_mask, built from
root-to-leaf rows). Forward of FlexAttention with the tree mask (eager: its dense reference)
against the rows."""

from __future__ import annotations

import math
import os
import random
import sys

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask, flex_attention

import dualkv
from test_tree import causal_row, draw_forest, oracle_mask, row_tokens

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import trees  # noqa: E402


def depth_of(t: trees.TreeBatch, seg: int) -> int:
    return len(t.path(seg)) - 1


def brute_pairs(t: trees.TreeBatch) -> int:
    """Allowed (query, key) pairs counted over the distinct tokens of the rows: a token at
    logical position j sees j + 1 keys, whatever row holds it."""
    seen = {}
    for end, _ in t.rows:
        pos = 0
        for s in t.path(end):
            for j in range(t.lengths[s]):
                seen[(s, j)] = pos + j + 1
            pos += t.lengths[s]
    return sum(seen.values())


def test_branching_shape():
    t = trees.branching()
    assert t.lengths[0] == 4096 and t.parents[0] == -1
    depths = [depth_of(t, s) for s in range(len(t.parents))]
    assert [depths.count(k) for k in range(4)] == [1, 4, 16, 64]
    assert all(512 <= n <= 1024 for n in t.lengths[1:])
    assert all(sum(1 for p in t.parents if p == s) in (0, 4) for s in range(len(t.parents)))
    assert len(t.rows) == 64 and all(depth_of(t, e) == 3 for e, _ in t.rows)
    # the response is everything below the prompt
    assert all(t.row_lengths()[i][0] == 4096 for i in range(64))
    # listed depth-first: each segment's parent is on the path of the one before it
    assert all(t.parents[s] in t.path(s - 1) for s in range(1, len(t.parents)))


def test_agentic_shape():
    t = trees.agentic(tasks=3)
    roots = [s for s, p in enumerate(t.parents) if p < 0]
    assert len(roots) == 3 and all(t.lengths[r] == 6144 for r in roots)
    for r in roots:
        sub = [s for s in range(len(t.parents)) if t.path(s)[0] == r and s != r]
        turns = [depth_of(t, s) for s in sub]
        assert [turns.count(k) for k in (1, 2, 3, 4)] == [2, 4, 8, 8]
        assert all(300 <= t.lengths[s] <= 900 for s in sub)
    # every turn is a row: its whole prefix, its response the turn itself
    assert sorted(e for e, _ in t.rows) == [s for s, p in enumerate(t.parents) if p >= 0]
    assert all(e == r for e, r in t.rows)
    rho = t.row_tokens / t.packed_tokens
    assert 8 <= rho <= 10, rho  # the rho ~ 9
    assert t.task == [roots.index(t.path(e)[0]) for e, _ in t.rows]


def test_long_horizon_shape():
    t = trees.long_horizon()
    roots = [s for s, p in enumerate(t.parents) if p < 0]
    assert len(roots) == 3 and all(t.lengths[r] == 4096 for r in roots)
    for r in roots:
        kids = [s for s, p in enumerate(t.parents) if p == r]
        assert len(kids) == 2  # two trajectories part at the first turn
        for k in kids:  # then each goes on alone: a chain of 24 turns
            chain = [k]
            while below := [s for s, p in enumerate(t.parents) if p == chain[-1]]:
                assert len(below) == 1
                chain += below
            assert len(chain) == 24 and all(150 <= t.lengths[s] <= 600 for s in chain)
    assert max(depth_of(t, s) for s in range(len(t.parents))) == 24
    assert sorted(e for e, _ in t.rows) == [s for s, p in enumerate(t.parents) if p >= 0]
    assert all(e == r for e, r in t.rows)
    assert 15 <= t.row_tokens / t.packed_tokens <= 25


def test_sysprompt_shape():
    t = trees.sysprompt()
    assert t.lengths[0] == 4096
    prompts = [s for s, p in enumerate(t.parents) if p == 0]
    assert len(prompts) == 8 and all(1536 <= t.lengths[s] <= 2560 for s in prompts)
    for g, s in enumerate(prompts):
        kids = [c for c, p in enumerate(t.parents) if p == s]
        assert len(kids) == 16 and all(64 <= t.lengths[c] <= 4096 for c in kids)
        assert sorted(i for i, x in enumerate(t.task) if x == g) == [
            i for i, (e, _) in enumerate(t.rows) if t.parents[e] == s
        ]
    median = sorted(t.lengths[c] for c in range(len(t.parents)) if depth_of(t, c) == 2)[64]
    assert 700 <= median <= 1500


@pytest.mark.parametrize("name", list(trees.TREES))
def test_layout_rows_reduction_and_flops(name):
    t = trees.TREES[name](scale=0.02)
    parents, lengths = t.layout_forest()
    layout = dualkv.Layout.tree(parents, lengths)
    assert layout.total_tokens == t.packed_tokens
    # Layout.tree's unshared rows (one per leaf, empty leaves included) are the batch's rows
    assert layout.unshared_tokens == t.row_tokens
    rows = trees.forest_rows(parents, lengths)
    assert sorted(len(r) for r in rows) == sorted(p + r for p, r in t.row_lengths())
    for got, want in zip(rows, row_tokens(parents, lengths)):
        assert torch.equal(got, want)
    pairs = brute_pairs(t)
    assert int(oracle_mask(parents, lengths, None).sum()) == pairs
    assert layout.flops(64, 4) == 4 * 64 * 4 * pairs
    assert layout.flops(64, 4, backward=True) == 2.5 * 4 * 64 * 4 * pairs
    # the full-size shape: the FLOP count against the pair count
    full = trees.TREES[name]()
    big = dualkv.Layout.tree(*full.layout_forest())
    assert big.flops(128, 32) == 4 * 128 * 32 * brute_pairs(full)


@pytest.mark.parametrize("name", [*trees.TREES, "short-prefix"])
def test_token_rows_pack_into_the_tree(name):
    """The rows' tokens share exactly the tree's segments: dualkv.pack(tree=True) with
    min_shared=1 finds the same segments, a segment with one child merged with it (the packer
    splits only at branch points)."""
    t = (
        trees.short_prefix_batch(scale=0.05)
        if name == "short-prefix"
        else trees.TREES[name](scale=0.02)
    )
    prompts, responses, task = t.token_rows(vocab=1000, seed=3)
    assert [(len(p), len(r)) for p, r in zip(prompts, responses)] == t.row_lengths()
    assert task == t.task
    ids, mask, pw, _ = dualkv.rows_from_lists(prompts, [[r] for r in responses])
    packed = dualkv.pack(ids, mask, pw, tree=True, min_shared=1)
    assert packed.total_tokens == t.packed_tokens
    inner = [s for s in range(len(t.parents)) if s in t.parents]
    one_child = sum(1 for s in inner if t.parents.count(s) == 1)
    assert len(packed.layout.lengths) == len(t.parents) - one_child
    assert (list(packed.layout.parents), list(packed.layout.lengths)) == t.packed_forest()


def test_twin_is_of_comparable_size():
    for name, make in trees.TREES.items():
        t = make()
        n, p, r = t.twin()
        assert abs(p + n * r - t.packed_tokens) <= r, name
        roots = [s for s, q in enumerate(t.parents) if q < 0]
        assert p == round(sum(t.lengths[s] for s in roots) / len(roots))


def test_short_prefix_batch():
    t = trees.short_prefix_batch(groups=3, responses=10, seed=5)
    roots = [s for s, p in enumerate(t.parents) if p < 0]
    assert len(roots) == 3 and all(1024 <= t.lengths[s] <= 3072 for s in roots)
    assert len(t.rows) == 30
    for end, resp in t.rows:
        assert t.parents[resp] in roots and 2 <= t.lengths[resp] <= 48  # the short shared start
        assert 300 <= t.lengths[end] <= 1500
    # some clusters share a start: fewer first-response segments than rows
    assert len({resp for _, resp in t.rows}) < len(t.rows)


@pytest.mark.parametrize("window", [None, 9])
def test_flex_tree_mask_is_the_tree_rule(window, seed):
    """The mask_mod allows exactly the oracle's pairs on random forests (depth 1-5, branching
    1-8, empty and one-token segments, breadth-first and other orders)."""
    rng = random.Random(seed)
    for order in ("dfs", "bfs", "any"):
        parents, lengths = draw_forest(rng, order, long_len=rng.choice([0, 140]))
        t = sum(lengths)
        if t == 0:
            continue
        mod = trees.tree_mask_mod(parents, lengths, "cpu", window)
        got = create_mask(mod, 1, 1, t, t, device="cpu")[0, 0]
        want = oracle_mask(parents, lengths, window)
        assert torch.equal(got, want), (order, parents, lengths)
        _, _, pos = trees.tree_mask_tensors(parents, lengths, "cpu")
        assert torch.equal(pos.long(), dualkv.Layout.tree(parents, lengths).position_ids)


def test_flex_with_the_tree_block_mask_matches_the_rows(seed):
    """FlexAttention (eager: its dense reference, forward only on the CPU) with tree_block_mask
    on the packed stream equals causal attention on each row, fp64."""
    t = trees.agentic(tasks=2, scale=0.03, seed=seed % 100)
    parents, lengths = t.layout_forest()
    total = sum(lengths)
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(total, h, 16, dtype=torch.float64, generator=g) for h in (4, 2, 2))
    scale = 1 / math.sqrt(16)
    block_mask = trees.tree_block_mask(parents, lengths, "cpu")
    out = flex_attention(*(x.transpose(0, 1)[None] for x in (q, k, v)), block_mask=block_mask,
                         scale=scale, enable_gqa=True)[0].transpose(0, 1)  # fmt: skip
    for idx in row_tokens(parents, lengths):
        want, _ = causal_row(q[idx], k[idx], v[idx], scale, None, 0.0)
        torch.testing.assert_close(out[idx], want, rtol=1e-10, atol=1e-10)
