"""Framework integrations of DualKV.

* :mod:`dualkv.integrations.transformers` registers ``attn_implementation="dualkv"`` with HF
  transformers (imported on demand, so ``import dualkv`` does not import transformers).
"""

from __future__ import annotations

__all__: list[str] = []
