"""A CPU platform for veRL (:func:`use_cpu_platform`), so that its FSDP engine runs on the CPU
with gloo: for tests and smoke runs on machines without an accelerator."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch


def use_cpu_platform() -> None:
    """Give veRL a CPU platform (veRL 0.9.1 ships CUDA, ROCm and NPU ones), through its own
    platform plugin API, so its FSDP engine runs on the CPU with gloo: for tests and smoke runs
    on machines without an accelerator. Call it before veRL's engine is built."""
    from verl.plugin.platform.platform_base import PlatformBase
    from verl.plugin.platform.platform_manager import set_platform

    class CPUPlatform(PlatformBase):
        device_name = "cpu"  # type: ignore[assignment]
        vendor_name = "cpu"  # type: ignore[assignment]
        device_module = torch.cpu  # type: ignore[assignment]

        def is_available(self) -> bool:
            return True

        def current_device(self) -> Any:
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            return None

        def synchronize(self, device_index: int | None = None) -> None:
            return None

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def get_device_capability(self, device_index: int = 0) -> tuple[None, None]:
            return (None, None)

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        def nvtx_range(self, msg: str) -> Any:
            return nullcontext()

        def profiler_start(self) -> None:
            return None

        def profiler_stop(self) -> None:
            return None

        def ray_resource_name(self) -> str:
            return "CPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> Any:
            return None

    set_platform(CPUPlatform())
