"""The barrier protocols of the warp-specialised sm_90a kernels, on the CPU.

tests/cuda/ws_protocol_sim.py replays each kernel's sequence of mbarrier waits and arrivals,
named barriers, copies and distributed-shared-memory exchanges under thousands of random
interleavings (deadlock, overwrite and early-read checks), and injects known protocol errors
that must be caught. It needs no GPU, so it runs with every test run: a change to a kernel's
protocol that the model rejects fails here before it reaches a GPU.
"""

import subprocess
import sys
from pathlib import Path

SIM = Path(__file__).resolve().parents[1] / "cuda" / "ws_protocol_sim.py"


def test_kernel_barrier_protocols_model() -> None:
    run = subprocess.run(
        [sys.executable, str(SIM)], capture_output=True, text=True, timeout=600, check=False
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith("ok ")]
    # the random schedules, then each family of injected errors
    assert len(lines) >= 7, run.stdout
