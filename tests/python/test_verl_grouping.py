"""The veRL engine's micro-batch partition and packing choice (dualkv.integrations.verl_grouping)
on the CPU, without veRL: prices against the packers themselves, the runs against a plain scan."""

from __future__ import annotations

import random

import pytest
import torch

from dualkv.integrations.verl_grouping import (
    GroupCosts,
    packing_mode,
    prompt_groups,
    sharing_order,
    sharing_runs,
    split_runs,
    use_sharing_partition,
    use_tree,
)
from dualkv.packing import pack_rows, rows_from_lists
from dualkv.tree_packing import (
    DEFAULT_MIN_SHARED,
    TREE_MIN_SAVING,
    pack_rows_tree,
    sorted_trainer_rows,
    tree_saves,
)
from hf_helpers import VOCAB
from multi_turn_rows import agent_rows, grpo_groups_and_one_branching


def _trainer_rows(rng: random.Random, tasks: int):
    """Shuffled multi-turn rows in veRL's padded layout with veRL's position ids."""
    rows = agent_rows(rng, VOCAB, tasks=tasks, rollouts=rng.randint(0, 2))
    rng.shuffle(rows)
    ids, mask, pw, _ = rows_from_lists([r.prompt for r in rows], [[r.response] for r in rows])
    ids = torch.where(mask.bool(), ids, torch.randint(0, VOCAB, ids.shape))
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return rows, ids, mask, pw, pos


def _groups(ids, mask, pw):
    group, plen, rlen = prompt_groups(ids[:, :pw], mask)
    rows_of: list[list[int]] = [[] for _ in range(int(group.max()) + 1)]
    for b, g in enumerate(group.tolist()):
        rows_of[g].append(b)
    flat = [int(plen[r[0]]) + int(rlen[r].sum()) for r in rows_of]
    return rows_of, flat


def test_group_costs_are_the_packers_tokens(seed):
    rng = random.Random(seed)
    rows, ids, mask, pw, pos = _trainer_rows(rng, tasks=rng.randint(1, 4))
    rows_of, flat = _groups(ids, mask, pw)
    prices = GroupCosts(sorted_trainer_rows(ids, mask, pw, pos), rows_of, flat, "auto")
    for _ in range(6):
        groups = rng.sample(range(len(rows_of)), rng.randint(1, len(rows_of)))
        idx = sorted(b for g in groups for b in rows_of[g])
        sub = (ids[idx], mask[idx], pw, pos[idx])
        tree = pack_rows_tree(*sub, min_shared=DEFAULT_MIN_SHARED).total_tokens
        depth_two = pack_rows(*sub[:3], None, position_ids=sub[3]).total_tokens
        assert prices.tree(groups) == tree and prices.flat(groups) == depth_two
        chosen, tokens = prices.choice(groups)
        assert tokens == (tree if chosen else depth_two)
    # the multi-turn rows share earlier turns: the tree packs clearly fewer tokens
    every = list(range(len(rows_of)))
    assert prices.choice(every) == (True, prices.tree(every))
    assert prices.tree(every) <= (1 - TREE_MIN_SAVING) * prices.flat(every)
    # non-canonical position ids are keys too (rows sharing ids at other positions do not share)
    shifted = pos + torch.arange(ids.shape[0])[:, None]
    moved = GroupCosts(sorted_trainer_rows(ids, mask, pw, shifted), rows_of, flat, "auto")
    want = pack_rows_tree(ids, mask, pw, shifted, DEFAULT_MIN_SHARED).total_tokens
    assert moved.tree(every) == want > prices.tree(every)


def test_use_tree_rule():
    assert not use_tree("auto", 1000, 901)  # under TREE_MIN_SAVING: the depth-two fast path
    assert use_tree("auto", 1000, 900)
    assert use_tree("auto", 1000, 950, budget=960)  # only the tree fits the budget
    assert not use_tree("auto", 1000, 950, budget=1000)
    assert not use_tree("auto", 1000, 1200, budget=500)  # never more tokens in auto mode
    assert use_tree("tree", 1000, 1200) and not use_tree("groups", 1000, 10)


def test_packing_mode():
    assert packing_mode(None) == packing_mode("") == "auto"
    assert packing_mode(" Tree ") == "tree" and packing_mode("groups") == "groups"
    with pytest.raises(ValueError, match="DUALKV_VERL_PACKING='trees'"):
        packing_mode("trees")


def test_sharing_order_keeps_tasks_and_turns_together(seed):
    rng = random.Random(seed)
    rows, ids, mask, pw, pos = _trainer_rows(rng, tasks=4)
    rows_of, _ = _groups(ids, mask, pw)
    order = sharing_order(sorted_trainer_rows(ids, mask, pw, pos), rows_of)
    assert sorted(order) == list(range(len(rows_of)))
    task_of = [rows[rows_of[g][0]].task for g in order]
    # each task's groups are neighbours: the task changes 3 times along the order
    assert sum(a != b for a, b in zip(task_of, task_of[1:])) == 3
    # an earlier turn's group before the groups whose prompts continue it
    prompt = [rows[rows_of[g][0]].prompt for g in range(len(rows_of))]
    for a in range(len(rows_of)):
        for b in range(len(rows_of)):
            if len(prompt[a]) < len(prompt[b]) and prompt[b][: len(prompt[a])] == prompt[a]:
                assert order.index(a) < order.index(b)


def _linear_runs(order, fits):
    """The greedy runs by a plain scan, one group at a time."""
    runs, cur = [], []
    for g in order:
        if cur and not fits(cur + [g]):
            runs.append(cur)
            cur = []
        cur.append(g)
    return runs + ([cur] if cur else [])


def test_sharing_runs_against_a_plain_scan(seed):
    rng = random.Random(seed)
    for _ in range(300):
        n = rng.randint(0, 30)
        order = rng.sample(range(n), n)
        cost = [rng.randint(1, 20) for _ in range(n)]
        budget = rng.randint(1, 60)

        def fits(run, cost=cost, budget=budget):  # additive, so downward closed
            return len(run) == 1 or sum(cost[g] for g in run) <= budget

        runs = sharing_runs(order, fits)
        assert runs == _linear_runs(order, fits)
        # not downward closed: each run still fits, and the runs are the order cut in pieces
        odd = set(rng.sample(range(n), n // 3))

        def patchy(run, odd=odd):
            return len(run) == 1 or (len(run) <= 6 and run[-1] not in odd)

        runs = sharing_runs(order, patchy)
        assert [g for r in runs for g in r] == order and all(patchy(r) for r in runs)


def test_split_runs(seed):
    rng = random.Random(seed)
    for _ in range(200):
        n = rng.randint(1, 20)
        cost = [rng.randint(1, 10) for _ in range(n)]
        budget = max(cost) + rng.randint(0, 30)

        def fits(run, cost=cost, budget=budget):
            return len(run) == 1 or sum(cost[g] for g in run) <= budget

        def weight(run, cost=cost):
            return sum(cost[g] for g in run)

        runs = sharing_runs(list(range(n)), fits)
        count = rng.randint(len(runs), n)
        split = split_runs(runs, count, fits, weight)
        assert split is not None and len(split) == count
        assert [g for r in split for g in r] == list(range(n)) and all(map(fits, split))
        assert split_runs(runs, n + 1, fits, weight) is None
    # a cut is made only where both parts fit
    assert split_runs([[0, 1, 2]], 2, lambda r: r != [0, 1] and r != [2], len) == [[0], [1, 2]]
    assert split_runs([[0, 1]], 2, lambda r: len(r) == 2, len) is None


def test_a_group_that_fits_only_as_a_tree_takes_the_tree_aware_partition(seed):
    """An ordinary GRPO batch (the whole batch saves under TREE_MIN_SAVING as a tree) with one
    group of branching rollouts over the token budget as prompt groups but not as a tree: the
    tree-aware partition cuts it (the balanced one prices groups as prompt groups and would refuse
    it), each run within the budget in its own packing, the branching group's run a tree."""
    rng = random.Random(seed)
    prompts, responses, branching = grpo_groups_and_one_branching(rng, VOCAB)
    ids, mask, pw, _ = rows_from_lists(prompts, responses)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    rows_of, flat = _groups(ids, mask, pw)
    assert len(rows_of) == len(prompts)  # (distinct random prompts: one group each)
    sorted_rows = sorted_trainer_rows(ids, mask, pw, pos)
    prices = GroupCosts(sorted_rows, rows_of, flat, "auto")
    every = list(range(len(rows_of)))
    assert not tree_saves(prices.flat(every), prices.tree(every))
    idx = rows_of[branching]
    tree = pack_rows_tree(ids[idx], mask[idx], pw, pos[idx], DEFAULT_MIN_SHARED).total_tokens
    assert prices.tree([branching]) == tree < flat[branching]
    budget = max(tree, max(f for g, f in enumerate(flat) if g != branching))
    assert flat[branching] > budget

    assert use_sharing_partition(prices, budget)
    assert not use_sharing_partition(prices, flat[branching])  # every group fits as prompt groups
    assert not use_sharing_partition(prices, None)  # fixed micro-batch size: rows, no budget
    assert not use_sharing_partition(GroupCosts(sorted_rows, rows_of, flat, "groups"), budget)
    assert use_sharing_partition(GroupCosts(sorted_rows, rows_of, flat, "tree"), None)
    # over the budget even as a tree: the tree-aware partition too (its error names the tree's
    # tokens, the fewer); no saving as a tree: the balanced one (its error names P + sum R)
    assert use_sharing_partition(prices, tree - 1)
    others = [r for g, r in enumerate(rows_of) if g != branching]
    other_flat = [f for g, f in enumerate(flat) if g != branching]
    plain = GroupCosts(sorted_rows, others, other_flat, "auto")
    assert not use_sharing_partition(plain, min(plain.flat_costs))

    # the runs the engine cuts (verl_microbatches.sharing_partition) with these prices
    def fits(run):
        return len(run) == 1 or prices.choice(run, budget)[1] <= budget

    runs = sharing_runs(sharing_order(sorted_rows, rows_of), fits)
    assert sorted(g for r in runs for g in r) == every
    for run in runs:
        chosen, tokens = prices.choice(run, budget)
        assert tokens <= budget
        if branching in run:
            assert chosen and tokens < prices.flat(run)
