"""bench/verl_update.py's batches (issue 33's agentic shape next to the prompt groups) and budgets,
on CPU. The veRL batch tests run where veRL 0.9.1 is installed (scripts/test.sh runs this file in
its environment too): the rows in veRL's no-padding layout are the shape's rows, token for
token, with their prompt / response split and positions."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import trees  # noqa: E402
import verl_update as vu  # noqa: E402

VOCAB = 500


def test_group_rows():
    gen = torch.Generator().manual_seed(4)
    rows = vu.shape_rows("3,7,4", 2, VOCAB, gen, seed=4)
    assert (rows.group_tokens, rows.rows_per_group, rows.row_max) == (7 + 3 * 4, 3, 11)
    assert len(rows.prompts) == 6 and rows.tokens == 6 * 11
    # drawn group by group: the prompt, then its responses
    want = torch.Generator().manual_seed(4)
    for g in range(2):
        prompt = torch.randint(0, VOCAB, (7,), generator=want).tolist()
        for i in range(3):
            assert rows.prompts[3 * g + i] == prompt
            assert (
                rows.responses[3 * g + i] == torch.randint(0, VOCAB, (4,), generator=want).tolist()
            )


def test_agentic_rows():
    rows = vu.shape_rows("agentic", 2, VOCAB, torch.Generator(), seed=1, scale=0.02)
    tree = trees.agentic(tasks=2, seed=1, scale=0.02)
    assert rows.rows_per_group == 22 and len(rows.prompts) == 44
    assert rows.group_tokens == max(tree.tree_tokens()) and sum(tree.tree_tokens()) == sum(
        tree.lengths
    )
    prompts, responses, _ = tree.token_rows(VOCAB, 1)
    assert rows.prompts == prompts and rows.responses == responses
    assert rows.row_max == max(len(p) + len(r) for p, r in zip(prompts, responses))
    # the prompt of a turn after the first is the whole row of the turn before it
    full = [p + r for p, r in zip(prompts, responses)]
    later = [p for p in prompts if len(p) > tree.lengths[0]]
    assert len(later) == 2 * 20 and all(p in full for p in later)


def test_budgets():
    rows = vu.Rows([[1]] * 10, [[2]] * 10, group_tokens=50, rows_per_group=5, row_max=30)
    assert vu.budgets("dualkv", 2, rows) == [(50, 5), (100, 10)]
    assert vu.budgets("verl", 2, rows) == [(30, 1), (60, 2), (120, 4), (240, 8), (300, 10)]


def test_bad_shape():
    for bad in ("forest", "4,32", "4,x,8"):
        with pytest.raises(SystemExit):
            vu.main(["--device", "cpu", "--shapes", bad])


@pytest.mark.parametrize("shape", ["3,7,4", "agentic"])
def test_verl_batch_holds_the_rows(shape):
    pytest.importorskip("verl", reason="veRL is not installed here (scripts/setup_verl_env.sh)")
    gen = torch.Generator().manual_seed(2)
    rows = vu.shape_rows(shape, 2, VOCAB, gen, seed=2, scale=0.02)
    batch = vu.make_batch(rows, VOCAB, gen)
    ids = batch["input_ids"]
    assert ids.is_nested and ids.size(0) == len(rows.prompts)
    pw = batch["prompts"].shape[1]
    assert pw == max(len(p) for p in rows.prompts)
    for b, (p, r) in enumerate(zip(rows.prompts, rows.responses)):
        assert ids[b].tolist() == p + r
        assert batch["position_ids"][b].tolist() == list(range(len(p) + len(r)))
        assert batch["prompts"][b, pw - len(p) :].tolist() == p
        assert batch["response_mask"][b].tolist() == [1] * len(r) + [0] * (
            batch["response_mask"].shape[1] - len(r)
        )
    assert batch["advantages"].shape == batch["old_log_probs"].shape == batch["response_mask"].shape
