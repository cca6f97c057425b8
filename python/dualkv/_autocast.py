"""torch.autocast's casting rule, for the DualKV ops that autocast does not cast itself."""

from __future__ import annotations

import torch


def autocast_inputs(device_type: str, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors`` as an op of autocast's lower-precision list (a matmul, SDPA) receives them.

    Under autocast on ``device_type``: floating-point tensors in the autocast dtype, except
    float64 ones, which autocast never casts (a float64 model under a trainer's ``bf16=True``
    runs in float64); other tensors unchanged. Outside autocast: all unchanged.
    """
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(
        t.to(dtype) if t.is_floating_point() and t.dtype != torch.float64 else t for t in tensors
    )
