"""The main job: ``python -m dualkv.demo`` (see ``--help``).

One GRPO policy-update step of a tiny random Qwen3 (CPU by default; larger shapes by flags on a
GPU), standard rows vs DualKV packed: tokens, rho, time, memory, log-prob/loss/gradient
differences. The attention-only demo is ``python -m dualkv.demo_attention``."""

from __future__ import annotations

import sys

from .grpo_demo import main

if __name__ == "__main__":
    sys.exit(main())
