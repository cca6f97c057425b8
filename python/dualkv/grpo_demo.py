"""Deprecated alias: the GRPO-step demo moved to :mod:`dualkv.demos.grpo_step` (run it with
``python -m dualkv.demo``)."""

from __future__ import annotations

import sys
import warnings
from typing import Any

from .demos import grpo_step as _moved

_MOVED = "dualkv.grpo_demo moved to dualkv.demos.grpo_step (python -m dualkv.demo runs it)"


def __getattr__(name: str) -> Any:
    warnings.warn(_MOVED, DeprecationWarning, stacklevel=2)
    return getattr(_moved, name)


if __name__ == "__main__":
    warnings.warn(_MOVED, DeprecationWarning, stacklevel=1)
    sys.exit(_moved.main())
