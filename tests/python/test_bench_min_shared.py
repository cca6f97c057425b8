"""bench/min_shared.py (the min_shared sweep of tree packing, issue 33) on CPU: the sweep packs
one batch with each value (fewer segments and more packed tokens as min_shared grows, every row's
tokens still there), times DualKV's attention and the model step, writes its JSON; the command
line refuses bad values."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import min_shared as bms  # noqa: E402
import model_step as ms  # noqa: E402


def test_sweep_on_cpu(tmp_path, monkeypatch):
    monkeypatch.setattr(ms, "OPTIONS", dict(ms.OPTIONS))
    common = ["--device", "cpu", "--scale", "0.04", "--groups", "2", "--responses", "6",
              "--warmup", "0", "--repeats", "1", "--out", str(tmp_path)]  # fmt: skip
    rows = bms.main([*common, "--parts", "attention", "--heads", "2,1,16", "4,2,16",
                     "--values", "1,4,16,64"])  # fmt: skip
    assert [r["min_shared"] for r in rows] == [1, 4, 16, 64]
    segs = [r["segments"] for r in rows]
    tokens = [r["packed_tokens"] for r in rows]
    assert segs == sorted(segs, reverse=True) and segs[0] > segs[-1]
    assert tokens == sorted(tokens) and tokens[0] < tokens[-1]
    assert all(r["attention_ms_2_1_16"] > 0 and r["attention_ms_4_2_16"] > 0 for r in rows)
    saved = json.loads((tmp_path / "min_shared.json").read_text())
    assert saved["rows"] == rows
    rows = bms.main([*common, "--parts", "model", "--preset", "tiny", "--values", "8"])
    assert isinstance(rows[0]["model_step_s"], float) and ms.OPTIONS["min_shared"] == 8


@pytest.mark.parametrize("bad", [["--values", "0,16"], ["--parts", "kernels"], ["--heads", "16,8"]])
def test_command_line(bad):
    with pytest.raises(SystemExit):
        bms.main([*bad, "--device", "cpu"])
