"""bench/grpo_learning.py (GRPO with TRL's trainer and DualKV's, side by side) at its toy size on
CPU: the supervised warm-up lowers the loss, both trainers run every step from the same model and
data, the first step's generations (so its rewards) are the same and its gradient norm agrees in
float32, and the JSON and the plot are written and re-plotted from the JSON."""

from __future__ import annotations

import io
import json
import math
import os
import sys

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")
pytest.importorskip("matplotlib")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import grpo_learning  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_digit_credit():
    assert grpo_learning.digit_credit("5 8", "5 8") == 1.0
    assert grpo_learning.digit_credit("5 9", "5 8") == 0.5
    assert grpo_learning.digit_credit("5 8 1", "5 8") == pytest.approx(2 / 3)
    assert grpo_learning.digit_credit("", "5 8") == 0.0
    assert grpo_learning.reward_exact(["5 8", "5 8 1"], ["5 8", "5 8"]) == [1.0, 0.0]


def test_example_format(seed):
    import random

    prompt, answer = grpo_learning.make_example(random.Random(seed), digits=3, prompt_len=50)
    words = prompt.split()
    assert len(words) == 50 and words[-9] == grpo_learning.QUESTION and words[-1] == "="
    a, b = int("".join(words[-8:-5])), int("".join(words[-4:-1]))
    assert 100 <= a < 1000 and 100 <= b < 1000 and words[-5] == "+"
    assert answer == " ".join(reversed(str(a + b)))  # least-significant digit first
    tok = grpo_learning.make_tokenizer()
    assert len(tok(prompt)["input_ids"]) == 50  # one token per word, no special tokens added


def test_toy_run_both_trainers(tmp_path, seed):
    out = io.StringIO()
    argv = ["--preset", "toy", "--device", "cpu", "--seed", str(seed % 2**31),
            "--out", str(tmp_path)]  # fmt: skip
    result = grpo_learning.run(argv, out=out)
    text = out.getvalue()

    warm = result["warmup"]["log"]
    assert result["warmup"]["steps"] == 30 and warm[0]["step"] == 1 and warm[-1]["step"] == 30
    assert warm[-1]["loss"] < warm[0]["loss"]  # the supervised steps fit the answers
    assert 0.0 <= warm[-1]["reward"] <= 1.0

    runs = result["runs"]
    assert set(runs) == {"trl", "dualkv"}
    for mode, logs in runs.items():
        assert [s["step"] for s in logs] == [1, 2, 3], mode
        for s in logs:
            assert 0.0 <= s["exact"] <= s["reward"] <= 1.0, (mode, s)
            assert math.isfinite(s["loss"]) and math.isfinite(s["grad_norm"]), (mode, s)
            assert s["step_time"] > s["gen_time"] > 0, (mode, s)
            assert 1.0 <= s["completion_len"] <= grpo_learning.completion_len(2), (mode, s)
        if mode == "dualkv":  # 8 completions of <= 4 tokens share each 40-token prompt
            assert all(s["token_reduction"] > 4.5 for s in logs), logs
        else:
            assert all(s["token_reduction"] is None for s in logs), logs
    # Same weights, data and seed in float32: the same completions at step 1, so the same rewards
    # and (TRL's rows against DualKV's packed groups) the same loss and gradient. The parameters
    # then differ by float32 rounding only, too little to change a sampled token in 3 steps.
    # (A draw where every completion of a step scores alike has no gradient to compare: rare at
    # this warm-up, ~0.1 reward per completion.)
    for trl, dk in zip(runs["trl"], runs["dualkv"], strict=True):
        for key in ("reward", "exact", "completion_len"):
            assert dk[key] == trl[key], (key, trl, dk)
        assert dk["loss"] == pytest.approx(trl["loss"], rel=1e-4, abs=1e-6), (trl, dk)
        assert dk["grad_norm"] == pytest.approx(trl["grad_norm"], rel=1e-4, abs=1e-7), (trl, dk)
    summary = result["summary"]
    assert summary["step1_reward_diff"] == 0.0
    assert summary["trl"]["reward_first10"] == pytest.approx(
        sum(s["reward"] for s in runs["trl"]) / 3
    )
    assert "step-1 reward diff 0 " in text and "dualkv: reward" in text

    path = tmp_path / "grpo_learning.json"
    assert json.loads(path.read_text()) == json.loads(json.dumps(result))
    png = tmp_path / "grpo_learning.png"
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 10_000
    png.unlink()
    grpo_learning.run(["--plot", str(path)])
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_bad_options():
    with pytest.raises(SystemExit, match="--modes"):
        grpo_learning.run(["--modes", "trl,vllm"])
    with pytest.raises(ValueError, match="no room for filler"):
        grpo_learning.run(["--prompt-len", "7", "--modes", "trl"])
