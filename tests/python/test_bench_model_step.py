"""bench/model_step.py's tree shapes (issue 33), on CPU: on an agentic tree batch (ragged per-turn
rows) the rows paths (each row alone, SDPA / the verl path's kernels) and DualKV on the tree and
on the depth-two packing take the same step (loss and every gradient, fp32, a tiny Qwen3); the
Flex path's block mask of a tree layout is the tree rule; the command line."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

import dualkv
from test_tree import oracle_mask

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import model_step as ms  # noqa: E402
import trees  # noqa: E402


@pytest.fixture
def options(monkeypatch):
    monkeypatch.setattr(ms, "OPTIONS", dict(ms.OPTIONS))
    return ms.OPTIONS


def test_tree_paths_take_the_same_step(options, seed):
    ms.register_hybrid()
    cpu = torch.device("cpu")
    options.update(tree=True, min_shared=1)
    model = ms.build_any("tiny", cpu, torch.float32, overrides={"num_hidden_layers": 2})
    tree = trees.agentic(tasks=2, scale=0.01, seed=seed % 1000)
    ids, mask, gid, adv, p = ms.make_tree_rows(tree, model.config.vocab_size, cpu, seed=seed)
    assert ids.shape[0] == len(tree.rows) == 44
    packed = ms.pack_batch("dualkv", ids, mask, gid, p)
    assert packed.layout.is_tree and packed.total_tokens == tree.packed_tokens
    depth2 = ms.pack_batch("dualkv-depth2", ids, mask, gid, p)
    assert not depth2.layout.is_tree and depth2.total_tokens > packed.total_tokens
    # near the random model's log-probs (about -log V): ratios near 1, few clipped
    old = torch.randn(ids.shape[0], ids.shape[1] - p) * 0.1 - math.log(model.config.vocab_size)
    out = {}
    for path in ("standard", "verl", "dualkv", "dualkv-depth2"):
        model.zero_grad(set_to_none=True)
        loss = ms.step(model, path, ids, mask, gid, adv, p, old)
        grads = {k: q.grad.clone() for k, q in model.named_parameters() if q.grad is not None}
        out[path] = loss, grads
    want_loss, want = out["standard"]
    for path, (loss, grads) in out.items():
        torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6, msg=path)
        assert grads.keys() == want.keys(), path
        for k, g in want.items():
            err = (grads[k] - g).abs().max().item()
            assert err <= 1e-4 * g.abs().max().item() + 1e-7, (path, k, err)


def test_flex_block_mask_of_a_tree_layout():
    tree = trees.branching(scale=0.05, branches=2, depths=2)
    parents, lengths = tree.layout_forest()
    layout = dualkv.Layout.tree(parents, lengths)
    block_mask = ms.flex_block_mask(layout, torch.device("cpu"))
    t = layout.total_tokens
    got = create_mask(block_mask.mask_mod, 1, 1, t, t, device="cpu")[0, 0]
    assert torch.equal(got, oracle_mask(parents, lengths, None))
    windowed = ms.flex_block_mask(layout, torch.device("cpu"), 7)
    got = create_mask(windowed.mask_mod, 1, 1, t, t, device="cpu")[0, 0]
    assert torch.equal(got, oracle_mask(parents, lengths, 7))


def test_command_line_rejects_unknown_shapes(options):
    for bad in (["--shapes", "forest"], ["--shapes", "4,64"], ["--paths", "dualkv,tree"]):
        with pytest.raises(SystemExit):
            ms.main([*bad, "--device", "cpu", "--presets", "tiny"])


def test_main_on_a_tree_shape(options, capsys):
    """The command on the agentic shape (tiny, CPU): the tree's rho, the packed T, a table row
    per path, the same loss on each."""
    argv = ["--presets", "tiny", "--shapes", "agentic", "--tree-scale", "0.01", "--min-shared",
            "1", "--device", "cpu", "--paths", "dualkv,dualkv-depth2", "--warmup", "0",
            "--repeats", "1", "--layers", "1", "--no-grad-ckpt"]  # fmt: skip
    assert ms.main(argv) == 0
    out = capsys.readouterr().out
    tree = trees.agentic(tasks=1, scale=0.01)
    label = f"agentic, 22 rows, T {tree.packed_tokens} | {tree.row_tokens / tree.packed_tokens:.2f}"
    assert f"| Qwen3-tiny | {label} | dualkv |" in out
    assert f"| Qwen3-tiny | {label} | dualkv-depth2 |" in out
    (losses,) = [x for x in out.splitlines() if x.startswith("losses: ")]
    values = [float(x.split(" ")[-1]) for x in losses[len("losses: ") :].split(", ")]
    assert len(values) == 2 and values[0] == pytest.approx(values[1], rel=1e-5)
