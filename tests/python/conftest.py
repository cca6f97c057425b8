"""Shared pytest fixtures: fresh seeds, device selection, GPU skipping with a reason."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


def cuda_available() -> bool:
    return torch.cuda.is_available()


@pytest.fixture
def seed(request: pytest.FixtureRequest) -> int:
    """A fresh random seed per test, printed so a failure can be replayed (DUALKV_SEED=...)."""
    s = int(os.environ.get("DUALKV_SEED", int.from_bytes(os.urandom(4), "little")))
    print(f"[{request.node.name}] seed={s}")
    return s


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine): GPU test skipped")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
