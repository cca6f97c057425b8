"""Every bad input to dualkv.attention raises a clear error naming the argument."""

from __future__ import annotations

import pytest
import torch

import dualkv

LAYOUT = dualkv.Layout([4], [[2, 3]])  # T = 9


def qkv(T: int = 9, hq: int = 4, hkv: int = 2, d: int = 16, dtype: torch.dtype = torch.float32):
    return (
        torch.randn(T, hq, d, dtype=dtype),
        torch.randn(T, hkv, d, dtype=dtype),
        torch.randn(T, hkv, d, dtype=dtype),
    )


def call(q, k, v, layout=LAYOUT, **kw):  # noqa: ANN001, ANN003, ANN201
    return dualkv.attention(q, k, v, layout, **kw)


def test_wrong_rank() -> None:
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"q must have shape \[T, Hq, D\]"):
        call(q[None], k, v)
    with pytest.raises(ValueError, match=r"k must have shape"):
        call(q, k[0], v)


def test_tokens_vs_layout() -> None:
    q, k, v = qkv(T=10)
    with pytest.raises(ValueError, match="total_tokens=9"):
        call(q, k, v)


def test_heads() -> None:
    q, k, v = qkv(hq=6, hkv=4)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        call(q, k, v)


def test_head_dim_mismatch() -> None:
    q, k, v = qkv()
    with pytest.raises(ValueError, match="head dim"):
        call(q[..., :8], k, v)


def test_k_v_shapes() -> None:
    q, k, v = qkv()
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        call(q, k, v[:, :1])


def test_dtypes() -> None:
    q, k, v = qkv()
    with pytest.raises(TypeError, match="same dtype"):
        call(q, k.double(), v)
    with pytest.raises(TypeError, match="dtype"):
        call(q.int(), k.int(), v.int())


def test_options() -> None:
    q, k, v = qkv()
    with pytest.raises(ValueError, match="window"):
        call(q, k, v, window=0)
    with pytest.raises(ValueError, match="softcap"):
        call(q, k, v, softcap=-1.0)
    with pytest.raises(ValueError, match="softmax_scale"):
        call(q, k, v, softmax_scale=float("nan"))
    with pytest.raises(TypeError, match="dualkv.Layout"):
        call(q, k, v, layout=[4, [2, 3]])


def test_meta_device_mismatch() -> None:
    q, k, v = qkv()
    with pytest.raises(ValueError, match="same device"):
        call(q, k.to("meta"), v)
    with pytest.raises(ValueError, match="layout is on cpu"):
        call(q.to("meta"), k.to("meta"), v.to("meta"))
