"""Loads the compiled op library (dualkv/_C) and wires autograd onto its ops."""

from __future__ import annotations

import glob
import os
from typing import Any

import torch
import torch.autograd.forward_ad as fwAD

_HERE = os.path.dirname(os.path.abspath(__file__))


def _library_path() -> str:
    override = os.environ.get("DUALKV_LIBRARY")
    if override:
        return override
    found = sorted(glob.glob(os.path.join(_HERE, "_C*.so")))
    if not found:
        raise ImportError(
            f"dualkv's compiled library (_C*.so) was not found in {_HERE}; install the package "
            "with `pip install .` from the repository root (it builds the C++ code)."
        )
    return found[0]


torch.ops.load_library(_library_path())
ops = torch.ops.dualkv


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    q, k, v, segments, query_tiles, key_tiles, total_tokens, scale, window, softcap, det = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, segments, query_tiles, key_tiles)
    ctx.options = (total_tokens, scale, window, softcap, det)


def _backward(
    ctx: Any, dout: torch.Tensor, dlse: torch.Tensor | None
) -> tuple[torch.Tensor | None, ...]:
    q, k, v, out, lse, segments, query_tiles, key_tiles = ctx.saved_tensors
    total_tokens, scale, window, softcap, det = ctx.options
    dq, dk, dv = ops.bwd(
        dout, q, k, v, out, lse, dlse, segments, query_tiles, key_tiles,
        total_tokens, scale, window, softcap, det,
    )  # fmt: skip
    return dq, dk, dv, None, None, None, None, None, None, None, None


torch.library.register_autograd("dualkv::fwd", _backward, setup_context=_setup_context)


# Second-order gradients are not implemented: the backward op's own backward raises (only when a
# second backward actually flows through it: create_graph=True alone still works), and so do the
# functorch transforms, whose batching rule the ops do not have.
_NO_DOUBLE_BACKWARD = (
    "dualkv.attention: double backward (a gradient of its gradients: create_graph=True followed "
    "by another backward, gradgradcheck, torch.func.hessian) is not supported yet"
)


def _no_double_backward(ctx: Any, *grads: Any) -> Any:
    raise NotImplementedError(_NO_DOUBLE_BACKWARD)


def _no_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    return None


NO_FUNCTORCH_MESSAGE = (
    "dualkv.attention under torch.func transforms (vmap, grad, jacrev, jacfwd, hessian) is not "
    "supported yet (the op has no batching rule); use torch.autograd, or call it per example"
)


# Forward-mode AD (torch.autograd.forward_ad): the ops (and dualkv::chunked_logprobs) have no jvp
# rule. On dual inputs that do not also require grad, torch's generated autograd kernel runs the
# op below autograd and the output simply carries no tangent: a jvp through them would silently
# leave out their part. Their Python entry points call this first.
def check_no_tangents(what: str, *tensors: torch.Tensor | None) -> None:
    """Raises when one of ``tensors`` is a forward-mode AD dual tensor (has a tangent)."""
    for t in tensors:
        if isinstance(t, torch.Tensor) and fwAD.unpack_dual(t).tangent is not None:
            raise NotImplementedError(
                f"{what}: forward-mode AD (torch.autograd.forward_ad dual tensors, jvp) is not "
                "supported yet (the op has no jvp rule); use reverse mode (backward / "
                "torch.autograd.grad)"
            )


def _no_vmap(info: Any, in_dims: Any, *args: Any) -> Any:
    raise NotImplementedError(NO_FUNCTORCH_MESSAGE)


torch.library.register_autograd("dualkv::bwd", _no_double_backward, setup_context=_no_setup)
for _name in ("dualkv::fwd", "dualkv::bwd"):
    torch.library.register_vmap(_name, _no_vmap)
