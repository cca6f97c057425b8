"""bench/multi_gpu.py (the multi-GPU run of issue 18) works: its exactness part and its per-layer
all-to-all timing, launched as on the GPU machines (torchrun), on 2 CPU processes over gloo.

The script compares, on every rank, DualKV attention and a Qwen3 and a Gemma 4 packed GRPO/DAPO
step under Ulysses SP = 2 (replicated weights, and FSDP2 with gradient checkpointing) against
SP = 1 on the same inputs, with a float64 oracle setting the float32 noise; here its JSON lines
are read back and checked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch.distributed as dist

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "multi_gpu.py")

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)


def test_exactness_and_comm_parts_on_two_gloo_processes(tmp_path, seed):
    pytest.importorskip("transformers")
    out = tmp_path / "multi_gpu.jsonl"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        SCRIPT, "--device", "cpu", "--parts", "exact,comm", "--config", "tiny",
        "--seed", str(seed % 2**24), "--preset", "tiny", "--shapes", "4,64,16",
        "--gemma-preset", "gemma4-tiny", "--gemma-shapes", "2,50,7", "--comm-repeats", "2",
        "--json", str(out),
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    assert "exactness: PASS" in proc.stdout

    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(r["world"] == 2 and r["dtype"] == "float32" for r in recs)
    (summary,) = [r for r in recs if r["part"] == "exact-summary"]
    checks = [r for r in recs if r["part"] == "exact"]
    assert summary["pass"] and summary["gemma_supported"]
    assert summary["checks"] == len(checks)
    assert all(r["pass"] for r in checks), [r for r in checks if not r["pass"]]
    # every quantity of the brief, for attention (4 head configurations) and both model steps
    # (SP with replicated weights, SP + FSDP2 + checkpointing)
    quantities = [r["quantity"].split(" (")[0] for r in checks]
    for q in ("out", "lse", "dq", "dk", "dv"):
        assert quantities.count(q) == 4, q
    for q in ("log-probs", "entropy", "loss", "grads"):
        assert quantities.count(q) == 4, q  # 2 models x 2 ways
    assert sum(r["case"].startswith("gemma4") for r in checks) == 8
    # float32 on CPU: the differences are at float32 rounding, far below the noise-based bound
    for r in checks:
        assert r["max_rel_diff"] <= 1e-5, r
        assert r["tolerance"] > 0 and r["max_abs_diff"] <= r["tolerance"], r
    # the same per-head computation on CPU: outputs, lse and dq bitwise equal; one head
    # configuration replicates its KV heads (Hkv = 1 < SP)
    for r in checks:
        if r["quantity"] in ("out", "lse", "dq"):
            assert r["max_abs_diff"] == 0.0, r
    assert sum("(KV x2)" in r["case"] for r in checks) == 5

    # per-layer all-to-alls: T = 64 + 4 * 16 = 128 (a multiple of 2), so the bytes sent are
    # exactly docs/trainers.md's (sp-1)/sp^2 * T * D * b * (2 Hq + 2 Hkv') (b = 4 in float32);
    # Gemma's T = 50 + 14 = 64 as well
    comm = {r["layer"]: r for r in recs if r["part"] == "comm"}
    assert set(comm) == {"Qwen3-tiny full", "gemma4-tiny sliding", "gemma4-tiny full"}
    for r in comm.values():
        want = (2 - 1) / 2**2 * r["T"] * r["D"] * 4 * (2 * r["Hq"] + 2 * r["Hkv_sent"])
        assert r["formula_bytes"] == pytest.approx(want)
        assert r["sent_bytes"] == pytest.approx(want)
        assert r["fwd_s"] > 0 and r["bwd_s"] > 0
    qwen = comm["Qwen3-tiny full"]
    assert (qwen["T"], qwen["Hq"], qwen["Hkv_sent"], qwen["D"]) == (128, 4, 2, 32)
