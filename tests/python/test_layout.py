"""dualkv.Layout: structure, positions, FLOP count, validation."""

from __future__ import annotations

import random

import pytest
import torch

import dualkv
from dualkv.reference import random_layout_lens


def brute_force_pairs(prefix: list[int], resp: list[list[int]], window: int | None) -> int:
    """Counts allowed (q, k) pairs directly from the rule in DESIGN.md."""
    pairs = 0
    for P, rs in zip(prefix, resp):
        for pq in range(P):  # prompt queries: causal within the prompt
            pairs += sum(1 for pk in range(pq + 1) if window is None or pq - pk < window)
        for R in rs:  # response queries: whole prompt, then own response causally
            for j in range(R):
                pq = P + j
                pairs += sum(1 for pk in range(pq + 1) if window is None or pq - pk < window)
    return pairs


def test_structure_and_positions() -> None:
    layout = dualkv.Layout([3, 0, 2], [[2, 0, 1], [2], []])
    assert layout.total_tokens == 3 + 3 + 2 + 2
    assert layout.num_groups == 3 and layout.num_responses == 4
    assert layout.position_ids.dtype == torch.int64
    assert layout.position_ids.tolist() == [0, 1, 2, 3, 4, 3, 0, 1, 0, 1]
    assert layout.unshared_tokens == (3 + 2) + (3 + 0) + (3 + 1) + 2
    assert layout.token_reduction == pytest.approx(layout.unshared_tokens / 10)
    # segments, non-empty only: [start, len, pos0, root_start, root_len, group, parent, depth,
    # pre, pre_end, last_desc]; group 1 has no prompt, so its response is a tree of its own
    assert layout.segments.tolist() == [
        [0, 3, 0, 0, 3, 0, -1, 0, 0, 3, 2],
        [3, 2, 3, 0, 3, 0, 0, 1, 1, 2, 1],
        [5, 1, 3, 0, 3, 0, 0, 1, 2, 3, 2],
        [6, 2, 0, 6, 2, 1, -1, 0, 3, 4, 3],
        [8, 2, 0, 8, 2, 2, -1, 0, 4, 5, 4],
    ]
    assert not layout.is_tree and layout.num_segments == 7
    assert layout.parents == (-1, 0, 0, 0, -1, 4, -1)
    assert layout.lengths == (3, 2, 0, 1, 0, 2, 2)
    assert "groups=3" in repr(layout)


def test_rho_formula() -> None:
    layout = dualkv.Layout([8192], [[1024] * 16])
    assert layout.token_reduction == pytest.approx(16 * (8192 + 1024) / (8192 + 16 * 1024))


def test_tiles_cover_every_token_once_longest_first(seed: int) -> None:
    rng = random.Random(seed)
    layout = dualkv.Layout(*random_layout_lens(rng, groups=4, max_p=700, max_r=400))
    for tiles in (layout.query_tiles, layout.key_tiles):
        covered = torch.zeros(layout.total_tokens, dtype=torch.int32)
        for _, begin, end, _ in tiles.tolist():
            assert 0 < end - begin <= 128
            covered[begin:end] += 1
        assert bool((covered == 1).all())
        costs = tiles[:, 3]
        assert bool((costs[:-1] >= costs[1:]).all()) if len(costs) > 1 else True


@pytest.mark.parametrize("window", [None, 1, 5, 64])
def test_flops_match_brute_force(window: int | None, seed: int) -> None:
    rng = random.Random(seed)
    prefix, resp = random_layout_lens(rng, groups=3, max_p=60, max_r=40)
    layout = dualkv.Layout(prefix, resp)
    pairs = brute_force_pairs(prefix, resp, window)
    assert layout.allowed_pairs(window) == pairs
    assert layout.flops(128, 8, window) == 4 * 128 * 8 * pairs
    assert layout.flops(128, 8, window, backward=True) == 2.5 * 4 * 128 * 8 * pairs


def test_device_and_to() -> None:
    """to() moves every metadata tensor (to the meta device here, so the move is real on a
    machine without a GPU) and keeps the structure; the original stays where it was."""
    layout = dualkv.Layout([2, 0], [[1, 3], [2]])
    assert layout.device == torch.device("cpu")
    moved = layout.to("meta")
    assert moved.device == torch.device("meta")
    for name in ("segments", "query_tiles", "key_tiles", "position_ids"):
        a, b = getattr(layout, name), getattr(moved, name)
        assert a.device.type == "cpu" and b.device.type == "meta", name
        assert a.shape == b.shape and a.dtype == b.dtype, name
    assert moved.total_tokens == layout.total_tokens == 8
    assert moved.prefix_lens == (2, 0) and moved.response_lens == ((1, 3), (2,))
    back = moved.to("cpu")
    assert torch.equal(back.position_ids, layout.position_ids)
    assert torch.equal(back.segments, layout.segments)


@pytest.mark.parametrize(
    "prefix,resp,exc,match",
    [
        ([-1], [[1]], ValueError, r"prefix_lens\[0\] = -1"),
        ([1], [[2, -3]], ValueError, r"response_lens\[0\]\[1\] = -3"),
        ([1, 2], [[1]], ValueError, "2 groups"),
        ([1], [1], TypeError, r"response_lens\[0\]"),
        ([1.5], [[1]], TypeError, r"prefix_lens\[0\]"),
        ([True], [[1]], TypeError, r"prefix_lens\[0\]"),
        (3, [[1]], TypeError, "prefix_lens"),
        ([2**31 - 1], [[2]], ValueError, "int32"),
        ([2**30, 2**30], [[], []], ValueError, "int32"),
        ([2**63], [[1]], ValueError, r"prefix_lens\[0\] = 9223372036854775808 exceeds the int32"),
        ([1], [[2**64]], ValueError, r"response_lens\[0\]\[0\] = .* exceeds the int32"),
        ("ab", [[1]], TypeError, "prefix_lens must be a list of ints"),
        ([-(2**64)], [[1]], ValueError, r"prefix_lens\[0\] = -18446744073709551616 is negative"),
        ([1], [[-(2**40)]], ValueError, r"response_lens\[0\]\[0\] = -1099511627776 is neg"),
    ],
)
def test_invalid_layouts(prefix, resp, exc, match) -> None:  # noqa: ANN001
    with pytest.raises(exc, match=match):
        dualkv.Layout(prefix, resp)


def test_window_must_be_positive() -> None:
    with pytest.raises(ValueError, match="window"):
        dualkv.Layout([2], [[1]]).allowed_pairs(0)
    for bad in (True, 2.0, "4"):  # as dualkv.attention: a bool is not a window of 1
        with pytest.raises(TypeError, match="window must be None or an int"):
            dualkv.Layout([2], [[1]]).flops(64, 1, window=bad)


def test_numpy_lengths() -> None:
    """numpy arrays (and numpy integers) are accepted as lengths, like tensors."""
    np = pytest.importorskip("numpy")
    a = dualkv.Layout(np.array([3, 0]), [np.array([1, 2]), [np.int64(4)]])
    b = dualkv.Layout([3, 0], [[1, 2], [4]])
    assert a.prefix_lens == b.prefix_lens and a.response_lens == b.response_lens
    assert torch.equal(a.position_ids, b.position_ids)
    with pytest.raises(TypeError, match="one-dimensional"):
        dualkv.Layout(np.array([[3]]), [[1]])
