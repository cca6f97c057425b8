"""Deprecated alias: the attention demo moved to :mod:`dualkv.demos.attention` (run it with
``python -m dualkv.demos.attention``)."""

from __future__ import annotations

import warnings
from typing import Any

from .demos import attention as _moved

_MOVED = "dualkv.demo_attention moved to dualkv.demos.attention"


def __getattr__(name: str) -> Any:
    warnings.warn(_MOVED, DeprecationWarning, stacklevel=2)
    return getattr(_moved, name)


if __name__ == "__main__":
    warnings.warn(_MOVED, DeprecationWarning, stacklevel=1)
    _moved.main()
