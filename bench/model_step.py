"""Model-level benchmark: one GRPO/DAPO policy-update step of a Qwen3 shape (random weights).

Paths, each on the same model and the same batch of one prompt group (N responses of R tokens
after a P-token prompt), gradient checkpointing on:

* standard       N rows of P+R tokens, HF SDPA (no padding: SDPA takes its fastest causal
                 kernel), full-vocabulary logits of the response positions + log-softmax;
* flex           the packed stream P+NR with FlexAttention and a shared-prefix BlockMask (what
                 mask-based shared-prefix trainers do), full logits of the response tokens;
* flex-chunked   as flex but with DualKV's chunked log-probs (isolates the attention kernel);
* dualkv         the packed stream with attn_implementation="dualkv" and chunked log-probs;
                 checkpointing keeps the attention outputs (no attention forward in the recompute);
* dualkv-recompute  as dualkv, but the checkpoint recompute runs the attention forward again;
* dualkv-depth2  as dualkv, on DualKV's prompt/response packing (rows grouped by identical
                 prompt): on a tree shape, what DualKV shared before prefix trees;
* dualkv-sp      as dualkv, through the sequence-parallel code path (dualkv.parallel: sharded
                 batch, Ulysses attention, sharded log-probs, gradient all-reduce) over a process
                 group of size 1 that this script initialises (nccl on CUDA, gloo on CPU): what
                 the SP path costs when it does not split anything;
* verl           (for hybrid sliding/global models such as Gemma 4) what veRL PR #7131 does: the
                 N rows, with the strongest kernels its user has. On the global (full-attention)
                 layers ``--full-kernel``: ``best`` (default) ffpa-attn's CuTe DSL kernels at head
                 dims above 256 (Gemma 4's 512), FA4 (flash-attn-4) at 256 and below; ``sdpa`` HF
                 SDPA (at head dim 512 PyTorch takes its memory-efficient kernel, K/V expanded as
                 HF's sdpa does). On the sliding layers ``--sliding-kernel``: ``fa4`` (default)
                 FA4 with its window; ``dualkv-rows`` DualKV's kernel on the rows as plain causal
                 varlen attention with the window, each row its own group with no shared prompt;
                 ``flex`` FlexAttention with a causal sliding-window BlockMask; ``sdpa`` SDPA with
                 an explicit [L, L] window mask, which no flash/cuDNN backend of SDPA takes, so it
                 runs dense. Where FA4 or ffpa-attn is not installed (or the device is not CUDA)
                 the path says so and falls back to ``dualkv-rows`` / ``sdpa``. Rows in
                 micro-batches of ``--rows-micro-batch`` with gradient accumulation (token-mean
                 over the whole batch), full-vocabulary logits per micro-batch.

Tree shapes (issue 33; ``--shapes agentic``, ``branching`` or ``sysprompt``: bench/trees.py,
``--tasks`` trees of the agentic one, default 1: 22 per-turn rows of a 6K context, rho ~ 9): the
rows in the trainer layout (left-padded prompt, right-padded response; a row's response is its
last turn / its response), the packed paths on ``dualkv.pack(..., tree=True)`` (``--min-shared``;
flex with the tree mask of trees.tree_block_mask), ``standard`` and ``verl`` on the ragged rows,
each row a forward/backward of its own (no padding; SDPA, resp. FA4 where installed), full logits
of its response, the token-mean loss over the batch. MFU on the tree's useful FLOPs.

Presets: Qwen3 shapes (dualkv.demos.grpo_step.PRESETS) and ``gemma4-31b`` (Gemma-4-31B's text layer
stack: hidden 5376, 32 query heads, sliding layers head dim 256 with 16 KV heads and window 1024,
full layers head dim 512 with 4 KV heads and attention_k_eq_v, proportional partial RoPE, 5
sliding : 1 full, final logit softcap 30, vocab 262144; ``--layers`` sets the depth, default 6,
the last layer is full) and ``gemma4-tiny`` (the same structure, small, for CPU smoke runs).

With ``--compile`` every decoder layer is compiled with ``torch.compile`` (regional compilation,
as trainers do) in every path, so the model's own elementwise code (RMSNorm, RoPE, SwiGLU,
residuals) is fused the same way around each attention.

With ``--rounds K`` the paths are measured in turn K times (A B A B ...: a drift of the GPU's
clocks reaches every path alike); each path's time is the median over all its rounds' steps, and
the per-round medians are printed.

Per path: median step time (pack + forward + log-probs + loss + backward), peak memory, and MFU
on the *useful* FLOPs of the packed layout (the decoder layers' matrices on the packed tokens, the
LM head on the N x R scored tokens, x3 for forward+backward; DualKV's attention count x3.5, i.e.
DESIGN.md's backward = 2.5x forward, which includes the backward's recompute of the scores as
FlashAttention's benchmarks count it -- 2x would give a 4-8% lower MFU at the default shapes;
the checkpoint recompute not counted) over the GPU's dense bf16 peak (--peak-tflops, 989 for
H100/H200 SXM). Every path is credited these same FLOPs, whatever it computes.

    python bench/model_step.py                                   # the issue's full table
    python bench/model_step.py --presets 1.7b --shapes 16,8192,1024 --paths flex,dualkv
    python bench/model_step.py --presets 1.7b --shapes 16,8192,1024 --paths flex,dualkv --compile
    python bench/model_step.py --presets 1.7b --shapes 16,8192,1024 --paths flex,dualkv --rounds 3
    python bench/model_step.py --presets 1.7b --shapes 16,8192,1024 --paths dualkv,dualkv-sp
    python bench/model_step.py --preset-tiny-cpu                 # a smoke run on CPU
    python bench/model_step.py --presets gemma4-31b --layers 6 --shapes 16,32768,2048 \
        --paths verl,dualkv --rows-micro-batch 1                  # Gemma-4-31B layer stack
    python bench/model_step.py --presets gemma4-tiny --shapes 4,64,16 --paths standard,verl,dualkv \
        --device cpu --warmup 0 --repeats 1 --rows-micro-batch 2  # its CPU smoke run
    python bench/model_step.py --presets 1.7b --shapes agentic \
        --paths standard,flex,dualkv,dualkv-depth2                # the agentic tree batch
    python bench/model_step.py --presets tiny --shapes agentic --tree-scale 0.02 --device cpu \
        --paths standard,dualkv,dualkv-depth2 --warmup 0 --repeats 1   # its CPU smoke run
    python bench/model_step.py ... --out bench/RESULTS.md        # append the table
    python bench/model_step.py ... --strict                      # exit 1 if a path fails

OOM in a path is reported as such and the other paths go on (with --strict the run then exits
with status 1).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import statistics
import sys
import time
import traceback
from typing import Any

import torch
from trees import TREES, TreeBatch, tree_block_mask

import dualkv
from dualkv import parallel
from dualkv.demos.grpo_step import build_model
from dualkv.integrations.transformers import (
    enable_gradient_checkpointing,
    packed_hidden_states,
    sequence_parallel_logprobs,
)
from dualkv.logprobs import logprobs_from_logits, response_logprobs
from dualkv.losses import dapo_loss, group_advantages
from dualkv.packing import pack_rows, rows_from_lists

ALL_PATHS = (
    "standard",
    "flex",
    "flex-chunked",
    "dualkv",
    "dualkv-recompute",
    "dualkv-depth2",
    "dualkv-sp",
    "verl",
)
SLIDING_KERNELS = ("fa4", "dualkv-rows", "flex", "sdpa")
FULL_KERNELS = ("best", "sdpa")
# the packages behind the verl path's FA4 and ffpa-attn kernels
KERNEL_MODULES = {"fa4": "flash_attn.cute.interface", "ffpa": "ffpa_attn"}
HYBRID = "dualkv_bench_verl_hybrid"  # the verl path's attention implementation

# Gemma-4-31B's text config (google/gemma-4-31B config.json text_config), minus its depth
GEMMA4_PRESETS: dict[str, dict[str, Any]] = {
    "gemma4-31b": dict(
        vocab_size=262_144, hidden_size=5376, intermediate_size=21_504, num_hidden_layers=6,
        num_attention_heads=32, num_key_value_heads=16, head_dim=256, global_head_dim=512,
        num_global_key_value_heads=4, attention_k_eq_v=True, sliding_window=1024,
        final_logit_softcapping=30.0, hidden_size_per_layer_input=0, num_kv_shared_layers=0,
        max_position_embeddings=262_144, tie_word_embeddings=True,
    ),
    "gemma4-tiny": dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
        num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=16,
        final_logit_softcapping=30.0, hidden_size_per_layer_input=0, num_kv_shared_layers=0,
        max_position_embeddings=4096, tie_word_embeddings=True,
    ),
}  # fmt: skip

# set by main() (resolve_kernels): the verl path's kernels on sliding and on full layers
# ("ffpa", "fa4" or "sdpa") and its rows micro-batch
OPTIONS: dict[str, Any] = {
    "sliding_kernel": "dualkv-rows",
    "full_kernel": "sdpa",
    "rows_micro_batch": 0,
    # set per shape by main(): a tree shape's rows are ragged and packed with tree=True
    "tree": False,
    "min_shared": None,  # dualkv.pack's min_shared for trees (None: its default)
}


def build_any(preset: str, device: torch.device, dtype: torch.dtype,
              overrides: dict[str, Any] | None = None) -> torch.nn.Module:  # fmt: skip
    """A random causal LM of a Qwen3 (demos.grpo_step) or Gemma 4 (GEMMA4_PRESETS) preset."""
    if preset not in GEMMA4_PRESETS:
        return build_model(preset, device, dtype, overrides=overrides)
    from transformers import AutoModelForCausalLM, Gemma4TextConfig

    fields = dict(GEMMA4_PRESETS[preset], attention_dropout=0.0)
    fields.update(overrides or {})
    config = Gemma4TextConfig(**fields)  # layer_types: 5 sliding : 1 full, last one full
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    return model.to(device=device, dtype=dtype)


def _layer_attention(model: torch.nn.Module) -> list[tuple[int, int | None]]:
    """(head dim, sliding window or None) of every decoder layer's attention."""
    out = []
    for layer in model.model.layers:
        attn = layer.self_attn
        out.append((int(attn.head_dim), getattr(attn, "sliding_window", None) or None))
    return out


def _final_softcap(model: torch.nn.Module) -> float | None:
    return getattr(model.config, "final_logit_softcapping", None)


_MASKS: dict[tuple[Any, ...], Any] = {}


def _sliding_rows_attention(module, query, key, value, scaling, window: int) -> torch.Tensor:
    """Causal sliding-window attention of the rows [N, H, L, D] with ``OPTIONS['sliding_kernel']``;
    returns [N, L, Hq, D]."""
    n, hq, length, d = query.shape
    kernel = OPTIONS["sliding_kernel"]
    if kernel == "fa4":  # (window - 1, 0) keys back and ahead: q - kv < window, causal
        from flash_attn.cute.interface import flash_attn_func

        q, k, v = (x.transpose(1, 2) for x in (query, key, value))
        window_size = (window - 1, None)
        out, _ = flash_attn_func(
            q, k, v, softmax_scale=scaling, causal=True, window_size=window_size
        )
        return out
    if kernel == "dualkv-rows":  # every row its own group, all prompt: plain causal varlen
        key_ = ("layout", n, length, query.device)
        if key_ not in _MASKS:
            _MASKS[key_] = dualkv.Layout([length] * n, [[] for _ in range(n)], device=query.device)
        q, k, v = (x.transpose(1, 2).reshape(n * length, x.shape[1], d)
                   for x in (query, key, value))  # fmt: skip
        out = dualkv.attention(q, k, v, _MASKS[key_], softmax_scale=scaling, window=window)
        assert isinstance(out, torch.Tensor)
        return out.view(n, length, hq, d)
    if kernel == "flex":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        key_ = ("flex", length, window, query.device)
        if key_ not in _MASKS:

            def sliding(b, h, q, kv):
                return (kv <= q) & (q - kv < window)

            _MASKS[key_] = create_block_mask(sliding, None, None, length, length,
                                             device=query.device)  # fmt: skip
            _MASKS["flex_fn"] = torch.compile(flex_attention, dynamic=False)
        out = _MASKS["flex_fn"](query, key, value, block_mask=_MASKS[key_], scale=scaling,
                                enable_gqa=hq != key.shape[1])  # fmt: skip
        return out.transpose(1, 2)
    # sdpa: an explicit window mask (no flash/cuDNN backend of SDPA takes a window)
    key_ = ("sdpa", length, window, query.device)
    if key_ not in _MASKS:
        i = torch.arange(length, device=query.device)
        _MASKS[key_] = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window)
    rep = hq // key.shape[1]
    k, v = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, k, v, attn_mask=_MASKS[key_], scale=scaling
    )
    return out.transpose(1, 2)


def hybrid_attention_forward(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout=0.0,
    scaling=None,
    sliding_window=None,
    softcap=None,
    **kwargs,
):
    """The verl path's attention: the full kernel (causal) on full layers, the sliding kernel on
    sliding layers. Rows without padding: no mask is built (HF's sdpa then runs is_causal)."""
    if softcap:
        raise ValueError("the verl path does not run attention logit soft-capping")
    if sliding_window:
        return _sliding_rows_attention(
            module, query, key, value, scaling, int(sliding_window)
        ), None
    if OPTIONS["full_kernel"] == "fa4":
        from flash_attn.cute.interface import flash_attn_func

        out, _ = flash_attn_func(*(x.transpose(1, 2) for x in (query, key, value)),
                                 softmax_scale=scaling, causal=True)  # fmt: skip
        return out, None
    if OPTIONS["full_kernel"] == "ffpa":
        from ffpa_attn import ffpa_attn_func

        gqa = query.shape[1] != key.shape[1]
        out = ffpa_attn_func(query, key, value, is_causal=True, scale=scaling, enable_gqa=gqa,
                             backend="cutedsl")  # fmt: skip
        return out.transpose(1, 2), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, None, dropout=dropout,
                                  scaling=scaling, is_causal=True)  # fmt: skip


def kernel_missing(kernel: str, device: torch.device) -> str | None:
    """Why the verl path cannot run ``kernel`` (``fa4``, ``ffpa``) here; None if it can."""
    import importlib

    if device.type != "cuda":
        return f"device {device.type}"
    try:
        importlib.import_module(KERNEL_MODULES[kernel])
    except Exception as e:  # ImportError, or a native library that does not load
        return f"{type(e).__name__}: {str(e)[:100]}"
    return None


def resolve_kernels(model: torch.nn.Module, sliding: str, full: str, device: torch.device) -> None:
    """Sets OPTIONS' sliding and full kernels of the verl path for ``model``: as asked (``full``
    ``best``: ffpa-attn above head dim 256, FA4 at or below), or, with the reason printed, the
    fallback (``dualkv-rows`` / ``sdpa``) where a package is missing."""
    if sliding == "fa4" and (why := kernel_missing("fa4", device)):
        print(f"verl path: FA4 not available ({why}): sliding layers run dualkv-rows")
        sliding = "dualkv-rows"
    if full == "best":
        full_dims = [d for d, w in _layer_attention(model) if not w]
        full = "ffpa" if max(full_dims, default=0) > 256 else "fa4"
        if why := kernel_missing(full, device):
            name = {"ffpa": "ffpa-attn", "fa4": "FA4"}[full]
            print(f"verl path: {name} not available ({why}): full layers run HF SDPA")
            full = "sdpa"
    OPTIONS.update(sliding_kernel=sliding, full_kernel=full)


def register_hybrid() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from dualkv.integrations.transformers import dualkv_mask

    AttentionInterface.register(HYBRID, hybrid_attention_forward)
    AttentionMaskInterface.register(HYBRID, dualkv_mask)  # full rows, no padding: no mask


DEFAULT_SHAPES = ("16,8192,1024", "32,4096,2048", "8,16384,2048")


def make_rows(n: int, p: int, r: int, vocab: int, device: torch.device, seed: int):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab, (p,), generator=g)
    resp = torch.randint(0, vocab, (n, r), generator=g)
    ids = torch.cat([prompt.expand(n, p), resp], dim=1).to(device)
    mask = torch.ones_like(ids)
    gid = torch.zeros(n, dtype=torch.int64, device=device)
    rewards = torch.rand(n, generator=g).to(device)
    return ids, mask, gid, group_advantages(rewards, gid)


def make_tree_rows(tree: TreeBatch, vocab: int, device: torch.device, seed: int):
    """A tree batch's rows in the trainer layout (left-padded prompt of width ``pw``, right-padded
    response): ``(ids, mask, task, advantages, pw)``; GRPO groups = the tree's tasks."""
    prompts, responses, task = tree.token_rows(vocab, seed)
    ids, mask, pw, _ = rows_from_lists(prompts, [[r] for r in responses], device=device)
    g = torch.Generator().manual_seed(seed)
    rewards = torch.rand(len(task), generator=g).to(device)
    gid = torch.tensor(task, device=device)
    return ids, mask, gid, group_advantages(rewards, gid), pw


def pack_batch(path: str, ids, mask, gid, p: int) -> dualkv.PackedBatch:
    """The packed batch of ``path``: a tree shape packed as a prefix tree, except on
    ``dualkv-depth2`` (rows grouped by identical prompt: DualKV's prompt/response packing)."""
    if path == "dualkv-depth2":
        return pack_rows(ids, mask, p)
    if OPTIONS["tree"]:
        return dualkv.pack(ids, mask, p, tree=True, min_shared=OPTIONS["min_shared"])
    return pack_rows(ids, mask, p, gid)


def rows_step(model, path: str, ids, mask, adv, p: int, old: torch.Tensor) -> torch.Tensor:
    """The rows path of a tree shape (ragged rows): each row alone (no padding), full logits of
    its response, the token-mean loss over the whole batch, a backward per row (gradient
    accumulation); ``standard`` with HF SDPA, ``verl`` with its kernels (FA4 where installed)."""
    model.set_attn_implementation("sdpa" if path == "standard" else HYBRID)
    plen = mask[:, :p].sum(1).tolist()
    rlen = mask[:, p:].sum(1).tolist()
    resp_mask = mask[:, p:].bool()
    n_tok = resp_mask.sum()
    total = torch.zeros((), device=ids.device)
    for b, (pb, rb) in enumerate(zip(plen, rlen)):
        row = ids[b : b + 1, p - pb : p + rb]
        out = model(input_ids=row, use_cache=False, logits_to_keep=rb + 1)
        logits = out.logits[:, :-1]  # (a final soft-cap, if any, is in the model's logits)
        lp = logprobs_from_logits(logits, row[:, pb:])
        del out, logits
        loss, _ = dapo_loss(lp, old[b : b + 1, :rb], adv[b : b + 1], resp_mask[b : b + 1, :rb],
                            num_tokens=n_tok)  # fmt: skip
        loss.backward()
        total += loss.detach()
    return total


def flex_block_mask(layout: dualkv.Layout, device: torch.device, window: int | None = None):
    """FlexAttention BlockMask of the shared-prompt layout (same rule as DualKV's, with the
    sliding window on logical positions when given); of a tree layout, the tree mask
    (trees.tree_block_mask)."""
    from torch.nn.attention.flex_attention import create_block_mask

    if layout.is_tree:
        return tree_block_mask(list(layout.parents), list(layout.lengths), device, window)

    seg, grp = [], []
    s = 0
    for g, (p, rs) in enumerate(zip(layout.prefix_lens, layout.response_lens, strict=True)):
        seg.append(torch.full((p,), -1, dtype=torch.int32))
        grp.append(torch.full((p + sum(rs),), g, dtype=torch.int32))
        for r in rs:
            seg.append(torch.full((r,), s, dtype=torch.int32))
            s += 1
    seg_t = torch.cat(seg).to(device)
    grp_t = torch.cat(grp).to(device)

    def mask_mod(b, h, q, kv):
        same_group = grp_t[q] == grp_t[kv]
        kv_prompt = seg_t[kv] == -1
        q_prompt = seg_t[q] == -1
        causal = kv <= q
        own = (seg_t[q] == seg_t[kv]) & causal
        allowed = same_group & ((kv_prompt & (~q_prompt | causal)) | (~q_prompt & own))
        if window is None:
            return allowed
        return allowed & (pos_t[q] - pos_t[kv] < window)

    pos_t = layout.position_ids.to(device)

    t = layout.total_tokens
    return create_block_mask(mask_mod, 1, None, t, t, device=device)


def useful_flops(model: torch.nn.Module, layout: dualkv.Layout, resp_tokens: int) -> float:
    """fwd+bwd FLOPs of the useful work of a packed step (no checkpoint recompute): 6 x decoder
    weights x packed tokens + 6 x hidden x vocab x ``resp_tokens`` + 3.5 x each layer's attention
    forward count (tests/python/test_flop_count.py checks it against a hand count)."""
    cfg = model.config
    t = layout.total_tokens
    dense = 0
    for layer in model.model.layers:
        for mod in layer.modules():
            if isinstance(mod, torch.nn.Linear):
                dense += mod.in_features * mod.out_features
    dense_flops = 6.0 * t * dense
    head_flops = 6.0 * resp_tokens * cfg.hidden_size * cfg.vocab_size
    # per layer: its head dim and window (Gemma 4 mixes 256-sliding and 512-full layers)
    attn = sum(layout.flops(d, cfg.num_attention_heads, w) for d, w in _layer_attention(model))
    return dense_flops + head_flops + 3.5 * attn


def allow_recompiles(n: int = 64) -> None:
    """Lets dynamo keep ``n`` compiled graphs per function (default 8): one per (path, shape, grad
    mode). Past the limit it runs the function uncompiled, which for FlexAttention means the
    unfused kernel that materialises the scores."""
    import torch._dynamo

    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    setattr(cfg, name, max(n, getattr(cfg, name)))


def compile_layers(model: torch.nn.Module) -> None:
    """``torch.compile`` each decoder layer in place (one graph per layer, reused by all layers).
    Side effects in a checkpointed forward are not replayed in its recompute, as trainers set for
    regional compilation: transformers' ``kernels`` wrapper (transformers 5.25) sets a global in
    every attention forward, which would otherwise run each checkpointed layer uncompiled."""
    import torch._dynamo

    allow_recompiles()
    if hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    for layer in model.model.layers:
        layer.compile()


def step(model, path: str, ids, mask, gid, adv, p: int, old: torch.Tensor) -> torch.Tensor:
    """One timed step of ``path``; returns the loss."""
    r = ids.shape[1] - p
    if OPTIONS["tree"] and path in ("standard", "verl"):
        return rows_step(model, path, ids, mask, adv, p, old)
    if path == "verl":  # the N rows in micro-batches, hybrid attention, full logits
        model.set_attn_implementation(HYBRID)
        resp_mask = mask[:, p:].bool()
        n_tok = resp_mask.sum()
        mb = OPTIONS["rows_micro_batch"] or ids.shape[0]
        total = torch.zeros((), device=ids.device)
        for s in range(0, ids.shape[0], mb):
            out = model(input_ids=ids[s : s + mb], use_cache=False, logits_to_keep=r + 1)
            lp = logprobs_from_logits(out.logits[:, -(r + 1) : -1], ids[s : s + mb, p:])
            del out
            loss, _ = dapo_loss(lp, old[s : s + mb], adv[s : s + mb], resp_mask[s : s + mb],
                                num_tokens=n_tok)  # fmt: skip
            loss.backward()
            total += loss.detach()
        return total
    softcap = _final_softcap(model)
    if path == "standard":
        model.set_attn_implementation("sdpa")
        out = model(input_ids=ids, use_cache=False, logits_to_keep=r + 1)
        logits = out.logits[:, -(r + 1) : -1]
        lp = logprobs_from_logits(logits, ids[:, p:])
        del out, logits
        resp_mask = mask[:, p:].bool()
    else:
        packed = pack_batch(path, ids, mask, gid, p)
        resp_mask = packed.response_mask
        head = model.get_output_embeddings().weight
        if path == "dualkv-sp":
            model.set_attn_implementation("dualkv")
            lp = sequence_parallel_logprobs(model, packed)
            loss, _ = dapo_loss(lp, old, adv, resp_mask)
            loss.backward()
            parallel.all_reduce_gradients(model.parameters())
            return loss.detach()
        if path.startswith("dualkv"):
            model.set_attn_implementation("dualkv")
            hidden = packed_hidden_states(model, packed)
        else:
            model.set_attn_implementation("flex_attention")
            block_mask: Any = flex_block_mask(packed.layout, ids.device)
            windows = {w for _, w in _layer_attention(model) if w}
            if windows:  # hybrid model (Gemma 4): one mask per layer type
                (w,) = windows
                block_mask = {
                    "full_attention": block_mask,
                    "sliding_attention": flex_block_mask(packed.layout, ids.device, w),
                }
            out = model.model(input_ids=packed.input_ids, position_ids=packed.position_ids,
                              attention_mask=block_mask, use_cache=False)  # fmt: skip
            hidden = out.last_hidden_state
        if path == "flex":  # full logits of every response token at once
            h = hidden[0].index_select(0, packed.token_sources)
            logits = torch.nn.functional.linear(h, head)
            if softcap:
                logits = torch.tanh(logits / softcap) * softcap
            flat = logprobs_from_logits(logits, packed.token_labels)
            lp = packed.scatter_tokens(flat)
            del h, logits
        else:
            lp = response_logprobs(hidden, head, packed, logit_softcap=softcap)
    loss, _ = dapo_loss(lp, old, adv, resp_mask)
    loss.backward()
    return loss.detach()


def init_group_of_one(device: torch.device) -> None:
    """The default process group with this process alone (for the dualkv-sp path)."""
    import atexit
    import socket

    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    atexit.register(dist.destroy_process_group)


def checkpointing_for(model, path: str) -> None:
    """Gradient checkpointing as each path runs it: DualKV keeps its attention outputs (the
    selective policy would only add its per-op dispatch cost to the other paths)."""
    enable_gradient_checkpointing(
        model, keep_attention=path in ("dualkv", "dualkv-depth2", "dualkv-sp")
    )


def profiled_step(model, path, ids, mask, gid, adv, p, old):  # noqa: ANN201
    """One step of ``path`` under torch.profiler (CPU and CUDA); returns the profiler."""
    from torch.profiler import ProfilerActivity, profile

    model.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step(model, path, ids, mask, gid, adv, p, old)
        torch.cuda.synchronize()
    model.zero_grad(set_to_none=True)
    return prof


def profile_step(model, path, ids, mask, gid, adv, p, old, top: int) -> None:
    """One more step under torch.profiler: the GPU time per kernel, largest first."""
    prof = profiled_step(model, path, ids, mask, gid, adv, p, old)
    print(f"-- profile: {path} --")
    table = prof.key_averages().table(
        sort_by="self_device_time_total", row_limit=top, max_name_column_width=70
    )
    print(table)


def bench_path(model, path, ids, mask, gid, adv, p, old, warmup, repeats, device):
    times = []
    loss = None
    torch.cuda.empty_cache() if device.type == "cuda" else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    try:
        for i in range(warmup + repeats):
            model.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            loss = step(model, path, ids, mask, gid, adv, p, old)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    except torch.OutOfMemoryError:
        error = "OOM"
    except Exception as exc:  # report and go on with the other paths
        traceback.print_exc()
        error = f"error: {type(exc).__name__}"
    else:
        error = None
    if error is not None:
        model.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache() if device.type == "cuda" else None
        return {"path": path, "error": error}
    peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else None
    model.zero_grad(set_to_none=True)
    return {"path": path, "time": statistics.median(times), "times": times, "peak": peak,
            "loss": float(loss)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--presets",
        default="1.7b,4b",
        help="Qwen3 shapes (dualkv.demos.grpo_step.PRESETS) or gemma4-31b, gemma4-tiny",
    )
    ap.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES),
                    help=f"N,P,R triples or tree batches ({', '.join(TREES)})")  # fmt: skip
    ap.add_argument("--tasks", type=int, default=1,
                    help="trees (tasks) of the agentic tree shape")  # fmt: skip
    ap.add_argument("--tree-scale", type=float, default=1.0,
                    help="scale every length of a tree shape (smoke runs)")  # fmt: skip
    ap.add_argument("--min-shared", type=int, default=None,
                    help="dualkv.pack's min_shared for tree shapes (default: its own)")  # fmt: skip
    ap.add_argument("--paths", default="standard,flex,dualkv", help=f"subset of {ALL_PATHS}")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1,
                    help="measure the paths in turn this many times")  # fmt: skip
    ap.add_argument("--no-grad-ckpt", action="store_true")
    ap.add_argument("--compile", action="store_true", help="torch.compile each decoder layer")
    ap.add_argument("--layers", type=int, help="override the layer count (quick runs)")
    ap.add_argument("--sliding-window", type=int, help="override a Gemma 4 preset's window")
    ap.add_argument("--sliding-kernel", choices=SLIDING_KERNELS, default="fa4",
                    help="the verl path's kernel on sliding layers (see above)")  # fmt: skip
    ap.add_argument("--full-kernel", choices=FULL_KERNELS, default="best",
                    help="the verl path's kernel on full-attention layers (see above)")  # fmt: skip
    ap.add_argument(
        "--rows-micro-batch",
        type=int,
        default=0,
        help="rows per forward/backward in the verl path (0: all N at once)",
    )
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the GPU")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset-tiny-cpu", action="store_true", help="smoke run: tiny shape on CPU")
    ap.add_argument("--out", help="append the markdown table to this file")
    ap.add_argument("--profile", type=int, default=0, metavar="K",
                    help="profile one more step per path: its top K GPU kernels")  # fmt: skip
    ap.add_argument("--strict", action="store_true",
                    help="exit with status 1 if a path fails (an error or OOM)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.preset_tiny_cpu:
        args.presets, args.shapes, args.device = "tiny", ["4,64,16"], "cpu"
        args.paths, args.warmup, args.repeats = "standard,dualkv", 0, 1
    OPTIONS.update(rows_micro_batch=args.rows_micro_batch, min_shared=args.min_shared)
    for shape in args.shapes:
        if shape not in TREES and len(shape.split(",")) != 3:
            ap.error(f"--shapes: {shape!r} is neither N,P,R nor one of {list(TREES)}")
    register_hybrid()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    paths = [x for x in args.paths.split(",") if x]
    for x in paths:
        if x not in ALL_PATHS:
            ap.error(f"unknown path {x!r}; choose from {ALL_PATHS}")
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    if "dualkv-sp" in paths:
        init_group_of_one(device)
    rows: list[dict[str, Any]] = []
    base = "verl" if "verl" in paths and "standard" not in paths else "standard"
    header = (f"| model | N, P, R (or tree) | rho | path | step time | peak memory | MFU | "
              f"vs {base} |\n"
              "|---|---|---|---|---|---|---|---|")  # fmt: skip
    print(header, flush=True)
    for preset in args.presets.split(","):
        overrides: dict[str, Any] = {"num_hidden_layers": args.layers} if args.layers else {}
        if args.sliding_window and preset in GEMMA4_PRESETS:
            overrides["sliding_window"] = args.sliding_window
        model = build_any(preset, device, dtype, overrides=overrides)
        model.train()
        if "verl" in paths:
            resolve_kernels(model, args.sliding_kernel, args.full_kernel, device)
        if args.compile:
            compile_layers(model)
        for shape in args.shapes:
            OPTIONS["tree"] = shape in TREES
            if OPTIONS["tree"]:
                extra = {"tasks": args.tasks} if shape == "agentic" else {}
                tree = TREES[shape](scale=args.tree_scale, **extra)
                ids, mask, gid, adv, p = make_tree_rows(
                    tree, model.config.vocab_size, device, seed=len(tree.rows)
                )
                layout = pack_batch("dualkv", ids, mask, gid, p).layout
                resp_tokens = int(mask[:, p:].sum())
                rho = int(mask.sum()) / layout.total_tokens  # rows that end inside a tree count
                what = f"{shape}, {len(tree.rows)} rows, T {layout.total_tokens}"
                print(f"{tree.describe()}; packed by dualkv.pack(tree=True): {what}", flush=True)
            else:
                n, p, r = (int(x) for x in shape.split(","))
                ids, mask, gid, adv = make_rows(
                    n, p, r, model.config.vocab_size, device, seed=n + p + r
                )
                layout = dualkv.Layout([p], [[r] * n])
                resp_tokens, rho, what = n * r, layout.token_reduction, f"{n}, {p}, {r}"
            flops = useful_flops(model, layout, resp_tokens)
            # on-policy-ish: ratio = exp(logp)
            old = torch.zeros(ids.shape[0], ids.shape[1] - p, device=device)
            # --rounds: the paths take turns (round 1: each path, round 2: each path, ...), so
            # that a drift of the GPU's clocks over the run reaches every path alike; each path's
            # time is the median of all its rounds' steps.
            per_round: dict[str, list[float]] = {x: [] for x in paths}
            results = []
            for rnd in range(args.rounds):
                for k, path in enumerate(paths):
                    if not args.no_grad_ckpt:
                        checkpointing_for(model, path)
                    warm = args.warmup if rnd == 0 else 1
                    res = bench_path(model, path, ids, mask, gid, adv, p, old,
                                     warm, args.repeats, device)  # fmt: skip
                    if rnd == 0:
                        results.append(res)
                    elif "times" in res and "times" in results[k]:
                        results[k]["times"] += res["times"]
                        if res["peak"] is not None:  # None on CPU
                            results[k]["peak"] = max(results[k]["peak"], res["peak"])
                    if "times" in res:
                        per_round[path].append(statistics.median(res["times"]))
            for res in results:
                if "times" in res:
                    res["time"] = statistics.median(res["times"])
            if args.rounds > 1:
                print("per-round medians: " + "; ".join(
                    f"{x} " + " ".join(f"{t:.3f}" for t in ts) for x, ts in per_round.items()
                ), flush=True)  # fmt: skip
            if args.profile and device.type == "cuda":
                for res in results:
                    if "time" in res:
                        if not args.no_grad_ckpt:
                            checkpointing_for(model, res["path"])
                        try:
                            profile_step(model, res["path"], ids, mask, gid, adv, p, old,
                                         args.profile)  # fmt: skip
                        except Exception:  # the timings above still get printed
                            traceback.print_exc()
                            model.zero_grad(set_to_none=True)
            # the same step on every path: their losses agree to the dtype's rounding
            print("losses: " + ", ".join(f"{x['path']} {x['loss']:.6g}" for x in results
                                         if "loss" in x), flush=True)  # fmt: skip
            std = next((x for x in results if x["path"] == base and "time" in x), None)
            for res in results:
                if "time" in res:
                    t = res["time"]
                    mfu = flops / t / (args.peak_tflops * 1e12)
                    peak = f"{res['peak'] / 2**30:.1f} GiB" if res["peak"] is not None else "n/a"
                    speed = f"{std['time'] / t:.2f}x" if std else "-"
                    cells = [f"{t:.3f} s", peak, f"{100 * mfu:.1f}%", speed]
                else:
                    cells = [res["error"], "-", "-", "-"]
                label = res["path"] + (" (compiled)" if args.compile else "")
                name = preset if preset in GEMMA4_PRESETS else f"Qwen3-{preset}"
                if res["path"] == "verl":
                    mb = args.rows_micro_batch
                    label += f" [{OPTIONS['sliding_kernel']} sliding, {OPTIONS['full_kernel']} full"
                    label += f", micro-batch {mb}]" if mb else "]"
                line = (f"| {name} | {what} | {rho:.2f} | "
                        f"{label} | " + " | ".join(cells) + " |")  # fmt: skip
                print(line, flush=True)
                rows.append({"line": line, **res})
            del ids, mask, gid, adv
        del model
        gc.collect()
        torch.cuda.empty_cache() if device.type == "cuda" else None
    if args.out:
        cmd = "python bench/model_step.py " + " ".join(argv if argv is not None else sys.argv[1:])
        with open(args.out, "a") as f:
            f.write(f"\n## Model step (GRPO/DAPO policy update), {gpu}, "
                    f"{datetime.date.today().isoformat()}\n\n")  # fmt: skip
            f.write(f"Command: `{cmd}`; torch {torch.__version__}; bf16 weights and grads; "
                    f"gradient checkpointing {'off' if args.no_grad_ckpt else 'on'}; "
                    f"decoder layers {'compiled' if args.compile else 'eager'}; MFU on the "
                    "useful FLOPs of the packed layout over "
                    f"{args.peak_tflops:.0f} TFLOP/s.\n\n")  # fmt: skip
            f.write(header + "\n" + "\n".join(x["line"] for x in rows) + "\n")
    failed = [x["path"] for x in rows if "error" in x]
    if args.strict and failed:
        print(f"failed paths: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
