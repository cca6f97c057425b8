"""Framework integrations of DualKV.

* :mod:`dualkv.integrations.transformers` registers ``attn_implementation="dualkv"`` with HF
  transformers (imported on demand, so ``import dualkv`` does not import transformers).
* :mod:`dualkv.integrations.trl`: ``DualKVGRPOTrainer``, TRL 1.16's ``GRPOTrainer`` on packed
  prompt groups (imported on demand; needs ``trl==1.16.*``).
* :mod:`dualkv.integrations.verl` is DualKV's engine for veRL 0.9.1 (loaded by ``import verl``
  through the ``verl.plugins`` entry point; switch: ``attn_implementation=dualkv``), with its
  micro-batching in ``verl_grouping`` and a CPU platform for veRL in ``verl_cpu_platform``.
"""

from __future__ import annotations

__all__: list[str] = []
