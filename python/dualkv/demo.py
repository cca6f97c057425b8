"""The main job: ``python -m dualkv.demo`` (see ``--help``).

One GRPO policy-update step of a tiny random Qwen3 (CPU by default; larger shapes by flags on a
GPU), standard rows vs DualKV packed: tokens, rho, time, memory, log-prob/loss/gradient
differences (:mod:`dualkv.demos.grpo_step`). The attention-only demo is
``python -m dualkv.demos.attention``."""

from __future__ import annotations

import sys

from .demos.grpo_step import main

if __name__ == "__main__":
    sys.exit(main())
