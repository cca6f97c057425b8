"""DualKV: exact shared-prompt attention for RL post-training (GRPO, DAPO).

A prompt group is packed once as ``[prompt | r_1 | ... | r_N]``; :func:`attention` computes the
same function as causal attention over the N rows ``[prompt | r_i]``.
"""

from .attention import attention
from .layout import Layout

__version__ = "0.1.0"
__all__ = ["Layout", "attention", "__version__"]
from .training import *  # noqa: E402, F403  (issue 4 training API: pack, response_logprobs, losses)
