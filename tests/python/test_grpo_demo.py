"""The main job runs end to end on CPU and its two paths agree."""

from __future__ import annotations

import io

import pytest
import torch

pytest.importorskip("transformers")

from dualkv.demos import grpo_step  # noqa: E402


def test_grpo_demo_runs_and_matches(seed):
    out = io.StringIO()
    argv = ["--layers", "1", "--vocab", "512", "--groups", "2", "--n", "3", "--prompt-len", "40",
            "--response-len", "12", "--steps", "2", "--quiet", "--seed", str(seed % 10_000),
            "--device", "cpu"]  # fmt: skip
    results = grpo_step.run(argv, out=out)
    text = out.getvalue()
    for line in ("tokens   standard", "rho =", "step median", "saved activations", "match"):
        assert line in text, text
    assert len(results) == 2
    for r in results:
        assert r.standard.error is None and r.packed.error is None
        assert r.max_logprob_diff is not None and r.max_logprob_diff < 1e-4
        assert r.loss_diff is not None and r.loss_diff < 1e-5
        assert r.max_grad_rel_diff is not None and r.max_grad_rel_diff < 1e-3


def test_grpo_demo_packed_only():
    out = io.StringIO()
    argv = ["--layers", "1", "--vocab", "256", "--groups", "1", "--n", "2", "--prompt-len", "16",
            "--response-len", "4", "--no-standard", "--loss", "grpo",
            "--device", "cpu"]  # fmt: skip
    (res,) = grpo_step.run(argv, out=out)
    assert res.standard.error == "skipped" and res.packed.error is None
    assert "skipped" in out.getvalue()
    # the packed step really ran: 2 rows of 4 response tokens, finite log-probs (< 0: a random
    # 256-token model is far from certain of any token) and a finite, nonzero loss
    lp, loss = res.packed.logprobs, res.packed.loss
    assert lp is not None and lp.shape == (2, 4)
    assert torch.isfinite(lp).all() and (lp < 0).all()
    assert loss is not None and torch.isfinite(loss) and loss != 0
    assert res.max_logprob_diff is None and res.loss_diff is None


def test_old_demo_module_names_are_deprecation_aliases():
    from dualkv import demo_attention
    from dualkv.demos import attention

    with pytest.warns(DeprecationWarning, match="dualkv.demos.grpo_step"):
        from dualkv.grpo_demo import PRESETS
    assert PRESETS is grpo_step.PRESETS
    with pytest.warns(DeprecationWarning, match="dualkv.demos.attention"):
        assert demo_attention.main is attention.main
