"""dualkv.prefix_forest: the shared-prefix forest of token rows, checked against brute force."""

import random

import pytest
import torch

from dualkv.prefix_forest import forest_tokens, prefix_forest, sorted_rows


def _random_rows(rng: random.Random) -> list[list[int]]:
    """Rows that share prefixes at random depths: a few trunks, branches, repeats, prefixes."""
    vocab = rng.choice([2, 3, 50])
    trunks = [[rng.randrange(vocab) for _ in range(rng.randrange(0, 12))] for _ in range(3)]
    rows: list[list[int]] = []
    for _ in range(rng.randrange(1, 12)):
        base = list(rng.choice(trunks + rows)) if rows else list(rng.choice(trunks))
        cut = rng.randrange(0, len(base) + 1)
        rows.append(base[:cut] + [rng.randrange(vocab) for _ in range(rng.randrange(0, 8))])
    return rows


def _tensors(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max([len(r) for r in rows] + [1])
    keys = torch.full((len(rows), width), 7, dtype=torch.int64)  # pads never read
    for b, r in enumerate(rows):
        keys[b, : len(r)] = torch.tensor(r, dtype=torch.int64)
    return keys, torch.tensor([len(r) for r in rows])


def _segment_of(forest) -> list[int]:
    return [i for i, n in enumerate(forest.lengths) for _ in range(n)]


def _check(rows: list[list[int]], forest, min_shared: int) -> None:
    parents, lengths = forest.parents, forest.lengths
    assert all(n > 0 for n in lengths)
    assert all(-1 <= p < i for i, p in enumerate(parents))
    # Depth-first: each segment's subtree follows it contiguously.
    for i, p in enumerate(parents):
        if p >= 0:
            assert all(parents[j] != -1 and _is_desc(parents, j, p) for j in range(p + 1, i))
    seg_of = _segment_of(forest)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    packed = [None] * forest.total_tokens
    for i in range(len(lengths)):  # the packed tokens, from their source rows
        src = rows[forest.source_row[i]]
        packed[starts[i] : starts[i] + lengths[i]] = src[
            forest.source_col[i] : forest.source_col[i] + lengths[i]
        ]
    for b, r in enumerate(rows):
        idx = forest.token_index[b, : len(r)].tolist()
        assert [packed[i] for i in idx] == r  # the row's tokens
        segs = [seg_of[i] for i in idx]
        for j in range(len(r)):  # a root-to-leaf path, positions continuing from the parents
            s = segs[j]
            chain = []
            while s >= 0:
                chain.append(s)
                s = parents[s]
            assert sum(lengths[c] for c in chain[1:]) + idx[j] - starts[segs[j]] == j
            if j + 1 < len(r):
                seg_end = starts[segs[j]] + lengths[segs[j]] - 1
                assert (
                    segs[j + 1] == segs[j]
                    and idx[j + 1] == idx[j] + 1
                    or (
                        parents[segs[j + 1]] == segs[j]
                        and idx[j] == seg_end
                        and idx[j + 1] == starts[segs[j + 1]]
                    )
                )
        if r:
            assert idx[0] == starts[segs[0]] and parents[segs[0]] == -1
    if min_shared == 1:  # full sharing: one packed token per distinct prefix
        assert forest.total_tokens == len({tuple(r[: j + 1]) for r in rows for j in range(len(r))})
    else:  # no shared inner segment (a branch point) shorter than min_shared
        for i, n in enumerate(lengths):
            kids = sum(1 for p in parents if p == i)
            if kids:
                assert n >= min_shared or kids + _ends(rows, forest, i) <= 1


def _is_desc(parents, j, p):
    while j >= 0:
        if j == p:
            return True
        j = parents[j]
    return False


def _ends(rows, forest, seg) -> int:
    seg_of = _segment_of(forest)
    last = [int(forest.token_index[b, len(r) - 1]) for b, r in enumerate(rows) if r]
    return sum(1 for i in last if seg_of[i] == seg)


@pytest.mark.parametrize("min_shared", [1, 3])
def test_random_rows_against_brute_force(min_shared):
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    for _ in range(300):
        rows = _random_rows(rng)
        keys, lengths = _tensors(rows)
        forest = prefix_forest(keys, lengths, min_shared=min_shared)
        try:
            _check(rows, forest, min_shared)
        except AssertionError:
            print("seed", seed, "rows", rows, "forest", forest)
            raise


def test_prompt_groups_pack_as_today():
    rows = [[1, 2, 3, 9], [5, 6, 7], [1, 2, 3, 8, 8], [5, 6, 7, 4], [1, 2, 3, 7]]
    keys, lengths = _tensors(rows)
    f = prefix_forest(keys, lengths)
    # group of row 0 first ([1, 2, 3] then its responses in row order), then the group of row 1:
    # row 1 ends inside row 3, which does not branch there: one segment (the same attention)
    assert f.parents == [-1, 0, 0, 0, -1]
    assert f.lengths == [3, 1, 2, 1, 4]
    assert f.source_row == [0, 0, 2, 4, 3]
    assert f.token_index[1, :3].tolist() == f.token_index[3, :3].tolist() == [7, 8, 9]


def test_per_turn_rows_share_one_segment():
    """Per-turn samples of one trajectory (each row a prefix of the next) pack as one segment,
    whatever min_shared: no branch point, so nothing to split; each row reads its prefix."""
    turns = [[7, 7, 1], [2, 9], [4], [3, 3, 8]]
    rows = [sum(turns[: i + 1], []) for i in range(len(turns))][::-1]
    for min_shared in (1, 2, 64):
        f = prefix_forest(*_tensors(rows), min_shared=min_shared)
        assert f.parents == [-1] and f.lengths == [9] and f.source_row == [0]
        _check(rows, f, min_shared)
    # a branch at the second turn: the segments end there, nowhere else
    rows.append([7, 7, 1, 2, 9, 5, 5])
    f = prefix_forest(*_tensors(rows))
    assert f.parents == [-1, 0, 0] and f.lengths == [5, 4, 2]


def test_keys_with_positions_do_not_share_across_positions():
    rows = torch.tensor([[4, 4, 4], [4, 4, 4]])
    pos = torch.tensor([[0, 1, 2], [0, 2, 3]])
    f = prefix_forest(torch.stack([rows, pos], -1), torch.tensor([3, 3]))
    assert f.parents == [-1, 0, 0] and f.lengths == [1, 2, 2]


def test_identical_rows_share_everything():
    keys, lengths = _tensors([[3, 1, 4], [3, 1, 4], []])
    f = prefix_forest(keys, lengths)
    assert f.lengths == [3] and f.token_index[0].tolist() == f.token_index[1].tolist()


@pytest.mark.parametrize("min_shared", [1, 3])
def test_forest_tokens_of_subsets(min_shared, seed):
    """forest_tokens prices a subset of rows from the whole batch's sorted rows: the tokens of
    prefix_forest run on that subset alone."""
    rng = random.Random(seed)
    for _ in range(200):
        rows = _random_rows(rng)
        keys, lengths = _tensors(rows)
        batch = sorted_rows(keys, lengths)
        subset = sorted(rng.sample(range(len(rows)), rng.randint(0, len(rows))))
        got = forest_tokens(batch, subset, min_shared)
        sub_keys, sub_lengths = _tensors([rows[b] for b in subset] or [[]])
        want = prefix_forest(sub_keys, sub_lengths, min_shared).total_tokens
        assert got == want, (rows, subset, got, want)


def test_fewer_rows_never_pack_to_more_tokens(seed):
    """Removing rows never adds packed tokens, at any min_shared (a branch point removed merges
    two segments; a row ending inside a path splits nothing), so a micro-batch partition may treat
    "fits the budget" as downward closed. The rows that broke this when a row's end split its
    segment (folding then repeated a short part in each branch): 5 rows 12 tokens, 4 rows 13."""
    rows = [[1, 0, 0, 1], [1, 0, 0, 0, 0, 1, 1], [1, 0, 0, 0, 1, 0, 1], [1, 0, 0, 0], [1, 0]]
    batch = sorted_rows(*_tensors(rows))
    assert forest_tokens(batch, range(5), 2) == forest_tokens(batch, range(4), 2) == 13
    rng = random.Random(seed)
    for _ in range(300):
        alphabet = rng.randint(1, 3)
        stem = [rng.randint(0, alphabet) for _ in range(rng.randint(0, 8))]
        rows = [
            stem[: rng.randint(0, len(stem))]
            + [rng.randint(0, alphabet) for _ in range(rng.randint(1, 8))]
            for _ in range(rng.randint(2, 9))
        ]
        batch = sorted_rows(*_tensors(rows))
        subset = rng.sample(range(len(rows)), rng.randint(1, len(rows) - 1))
        for min_shared in (1, 2, 4, 6):
            fewer = forest_tokens(batch, subset, min_shared)
            assert fewer <= forest_tokens(batch, range(len(rows)), min_shared), (rows, subset)
