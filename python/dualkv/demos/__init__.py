"""DualKV's demos, run as modules:

* ``python -m dualkv.demo`` (:mod:`dualkv.demos.grpo_step`): one GRPO/DAPO policy-update step of a
  transformers model, standard rows vs DualKV packed, side by side;
* ``python -m dualkv.demos.attention`` (:mod:`dualkv.demos.attention`): attention alone, DualKV
  against the unshared reference rows.

The self-test on your own model is ``python -m dualkv.check``.
"""

from __future__ import annotations

__all__: list[str] = []
