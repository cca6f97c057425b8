"""Ulysses sequence parallelism (dualkv.parallel) on CPU: gloo, 2 and 4 processes spawned here.

Every worker builds the same global inputs from the test's seed, runs the single-process
computation itself (the reference) and the sharded one over the group, and compares its own shard:
attention outputs, lse and q/k/v gradients (bitwise where the math is the same: no KV head
replication; replicated KV heads sum their gradients in another order), padding rows exactly 0
even when the pad inputs are NaN; a tiny random Qwen3 packed GRPO/DAPO step (log-probs, entropy,
loss, every parameter gradient after the gradient all-reduce) against the single-process packed
step, with shard boundaries on a prompt's last token; prefix trees (Layout.tree in the attention
cases, and a multi-turn tree step against sp=1 and the unshared rows).
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dualkv
from dualkv import parallel
from gloo_ranks import free_port, spawn_ranks

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)


# --- attention ------------------------------------------------------------------------------
def _random_layout(rng: random.Random, world: int) -> tuple[list[int], list[list[int]]]:
    groups = rng.randint(2, 4)
    prefix = [rng.choice([0, 1, rng.randint(2, 13)]) for _ in range(groups)]
    responses = [[rng.choice([0, 1, rng.randint(2, 9)]) for _ in range(rng.randint(0, 4))]
                 for _ in range(groups)]  # fmt: skip
    total = sum(prefix) + sum(map(sum, responses))
    if total % world == 0:  # keep the stream's length off the group size
        prefix[-1] += 1
    return prefix, responses


def _attention_cases(world: int, seed: int) -> list[dict]:
    """(layout, heads, dtype, options) cases; ``bitwise`` where no KV head is replicated."""
    rng = random.Random(seed)
    heads = [(4, 2), (4, 1), (4, 4), (2, 1)] if world == 2 else [(8, 4), (8, 2), (8, 1), (12, 6)]
    cases = []
    for i, (hq, hkv) in enumerate(heads):
        for dtype in (torch.float64, torch.float32):
            prefix, responses = _random_layout(rng, world)
            opts = {}
            if i % 2 == 1:
                opts = {"window": rng.randint(1, 6), "softcap": 3.0}
            cases.append(dict(prefix=prefix, responses=responses, hq=hq, hkv=hkv, dtype=dtype,
                              d=rng.choice([8, 16]), **opts))  # fmt: skip
    # 16-bit, a stream shorter than the group (ranks with no real token), the example layout
    cases.append(dict(prefix=[7, 2], responses=[[3, 0, 5], [4]], hq=world * 2, hkv=world,
                      dtype=torch.bfloat16, d=16))  # fmt: skip
    cases.append(dict(prefix=[3, 2], responses=[[5, 1], [2]], hq=world * 2, hkv=1,
                      dtype=torch.float16, d=16, softcap=2.0))  # fmt: skip
    cases.append(dict(prefix=[world - 1], responses=[[]], hq=world, hkv=1, dtype=torch.float64,
                      d=8))  # fmt: skip
    cases.append(dict(prefix=[1], responses=[[0]], hq=world, hkv=world, dtype=torch.float64, d=8))
    # prefix trees (Layout.tree): random forests in any order, empty segments included; one
    # KV head per rank, and one KV head replicated, with a window and softcap
    for hkv, opts in ((world, {}), (1, {"window": rng.randint(2, 7), "softcap": 3.0})):
        n = rng.randint(3, 9)
        parents = [rng.randrange(-1, i) for i in range(n)]
        lengths = [rng.choice([0, 1, rng.randint(2, 11)]) for _ in range(n)]
        lengths[0] += 1 + (sum(lengths) % world == world - 1)  # T > 0, not a multiple of sp
        cases.append(dict(tree=(parents, lengths), hq=world * 2, hkv=hkv, dtype=torch.float64,
                          d=8, **opts))  # fmt: skip
    return cases


def _check(got: torch.Tensor, want: torch.Tensor, bitwise: bool, what: str) -> None:
    assert not torch.isnan(got).any(), what
    if bitwise:
        assert torch.equal(got, want), (what, (got.double() - want.double()).abs().max())
    else:
        tol = {torch.float64: 1e-12, torch.float32: 2e-6}.get(got.dtype, 2e-2)
        scale = max(want.double().abs().amax().item(), 1.0) if want.numel() else 1.0
        torch.testing.assert_close(got, want, rtol=0, atol=tol * scale, msg=what)


def _pairs() -> Any:
    """This rank's 2-rank group of a 4-process run: {0, 1} or {2, 3} (group ranks are then not
    the global ranks). Every process creates both groups, as torch.distributed requires."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    return groups[dist.get_rank() // 2]


def _attention_worker(rank: int, world: int, seed: int) -> None:
    """The 4-rank cases on the default group, then the 2-rank cases on each pair."""
    assert world == 4
    _attention_cases_run(None, 4, seed)
    _attention_cases_run(_pairs(), 2, seed + 1 + rank // 2)


def _attention_cases_run(group: Any, world: int, seed: int) -> None:
    for n, case in enumerate(_attention_cases(world, seed)):
        what = f"case {n} {case}"
        if "tree" in case:
            layout = dualkv.Layout.tree(*case["tree"])
        else:
            layout = dualkv.Layout(case["prefix"], case["responses"])
        t, dtype = layout.total_tokens, case["dtype"]
        hq, hkv, d = case["hq"], case["hkv"], case["d"]
        opts = {k: case[k] for k in ("window", "softcap") if k in case}
        g = torch.Generator().manual_seed(seed + n)
        q, k, v = (torch.randn(t, h, d, generator=g).to(dtype) for h in (hq, hkv, hkv))
        d_out = torch.randn(t, hq, d, generator=g).to(dtype)
        lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        d_lse = torch.randn(hq, t, generator=g).to(lse_dtype)

        # the single-process run
        qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
        out, lse = dualkv.attention(qr, kr, vr, layout, return_lse=True, **opts)
        ((out * d_out).sum() + (lse * d_lse).sum()).backward()

        # this rank's shard, NaN on the padding
        sl = parallel.ShardedLayout(layout, group)
        assert sl.world_size == world and sl.rank == dist.get_rank(group)
        assert sl.padded_tokens % world == 0 and sl.padded_tokens - t < world
        ql, kl, vl = (sl.shard(x, pad_value=float("nan")).requires_grad_() for x in (q, k, v))
        out_l, lse_l = parallel.ulysses_attention(ql, kl, vl, sl, return_lse=True, **opts)
        assert out_l.shape == (sl.shard_tokens, hq, d) and lse_l.shape == (hq, sl.shard_tokens)
        loss = (out_l * sl.shard(d_out)).sum() + (lse_l * sl.shard(d_lse, dim=1)).sum()
        loss.backward()

        real, s0 = sl.real_tokens, sl.start
        bitwise = parallel.kv_replication(hq, hkv, world) == 1
        _check(out_l[:real], out[s0 : s0 + real].detach(), True, f"out {what}")
        _check(lse_l[:, :real], lse[:, s0 : s0 + real].detach(), True, f"lse {what}")
        _check(ql.grad[:real], qr.grad[s0 : s0 + real], True, f"dq {what}")
        _check(kl.grad[:real], kr.grad[s0 : s0 + real], bitwise, f"dk {what}")
        _check(vl.grad[:real], vr.grad[s0 : s0 + real], bitwise, f"dv {what}")
        for name, x in (("out", out_l), ("dq", ql.grad), ("dk", kl.grad), ("dv", vl.grad)):
            assert torch.equal(x[real:], torch.zeros_like(x[real:])), f"{name} padding {what}"
        assert (lse_l[:, real:] == 0).all(), f"lse padding {what}"
        # without lse: the same output
        assert torch.equal(parallel.ulysses_attention(ql, kl, vl, sl, **opts), out_l)

        # the gather helper (differentiable) rebuilds the global tensor
        x = out_l.detach().requires_grad_()
        full = sl.gather(x, grad_scale=3.0)
        assert full.shape == out.shape and torch.equal(full, out.detach())
        (full * d_out).sum().backward()  # the same downstream on every rank
        assert torch.equal(x.grad[:real], 3.0 * d_out[s0 : s0 + real])
        assert (x.grad[real:] == 0).all()

    # head splits that cannot work name the case
    sl = parallel.ShardedLayout(dualkv.Layout([4], [[3]]), group)
    s = sl.shard_tokens
    with pytest.raises(ValueError, match="multiple of the group size"):
        parallel.ulysses_attention(torch.randn(s, world + 1, 8), torch.randn(s, 1, 8),
                                   torch.randn(s, 1, 8), sl)  # fmt: skip
    with pytest.raises(ValueError, match="shard has"):
        q = torch.randn(s + 1, world, 8)
        parallel.ulysses_attention(q, q, q, sl)

    # the same rows padded to another response width on odd ranks: one packed stream, but the
    # log-probs' all-reduce would sum [B, R_max] tensors of different shapes (gloo aborted the
    # process; a backend that does not check sizes sums misplaced values)
    ids, mask, pw, gid = dualkv.rows_from_lists([[3, 4, 5]], [[[5, 6], [7, 8, 9]]])
    if dist.get_rank(group) % 2:
        ids, mask = (torch.nn.functional.pad(x, (0, 2)) for x in (ids, mask))
    with pytest.raises(ValueError, match="passed different packed batches"):
        parallel.shard_batch(dualkv.pack(ids, mask, pw, gid), group)


def test_attention_equals_single_process(seed):
    """4 ranks, and 2 ranks (two 2-rank groups side by side in the same 4 processes)."""
    spawn_ranks(_attention_worker, 4, seed)


# --- model step --------------------------------------------------------------------------------
TEMPERATURE = 0.9


def _model_batch(seed: int, world: int, model):
    """A packed batch, advantages and old log-probs (the model's own, plus noise: the policy
    ratio stays near 1, so the clipped surrogate has gradients)."""
    from dualkv.integrations import transformers as dkt
    from hf_helpers import VOCAB, random_groups

    rng = random.Random(seed)
    prompts, responses = random_groups(rng, groups=3, p_range=(2, 12), n_range=(1, 4),
                                       r_range=(1, 9))  # fmt: skip
    # the first group's prompt fills rank 0 exactly: its last position (rank 0) predicts the first
    # token of each of its 3 responses (rank 1); the other boundaries fall where they may
    responses[0] = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 5))] for _ in range(3)]
    rest = sum(map(len, responses[0])) + sum(
        len(p) + sum(map(len, rs)) for p, rs in zip(prompts[1:], responses[1:])
    )
    shard = -(-rest // (world - 1))  # then ceil((shard + rest) / world) == shard
    prompts[0] = [rng.randrange(VOCAB) for _ in range(shard)]
    packed = dualkv.pack(prompts=prompts, responses=responses)  # groups in this order
    assert -(-packed.total_tokens // world) == shard == packed.layout.prefix_lens[0]
    rows = packed.num_rows
    g = torch.Generator().manual_seed(seed)
    gid = torch.tensor([i for i, rs in enumerate(responses) for _ in rs])
    adv = dualkv.group_advantages(torch.rand(rows, generator=g), gid).double()
    noise = torch.randn(rows, packed.max_response_len, generator=g).double() * 0.3
    with torch.no_grad():
        old = dkt.packed_response_logprobs(model, packed, temperature=TEMPERATURE) + noise
    return packed, adv, old * packed.response_mask


def _model_step(model, packed, adv, old, sharded: bool, group: Any = None):
    from dualkv.integrations import transformers as dkt

    model.zero_grad(set_to_none=True)
    if sharded:
        lp, ent = dkt.sequence_parallel_logprobs(model, packed, group, TEMPERATURE,
                                                 return_entropy=True)  # fmt: skip
    else:
        lp, ent = dkt.packed_response_logprobs(model, packed, temperature=TEMPERATURE,
                                               return_entropy=True)  # fmt: skip
    loss, _ = dualkv.dapo_loss(lp, old, adv, packed.response_mask)
    loss = loss - 0.01 * dualkv.aggregate(ent, packed.response_mask)
    loss.backward()
    if sharded:
        parallel.all_reduce_gradients(model.parameters(), group)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return lp.detach(), ent.detach(), loss.detach(), grads


def _model_worker(rank: int, world: int, seed: int) -> None:
    """2-rank steps on each pair (plain), then the 4-rank step (gradient checkpointing, keeping
    the attention outputs)."""
    assert world == 4
    _model_run(_pairs(), 2, seed + 1 + rank // 2, checkpointing=False)
    _model_run(None, 4, seed, checkpointing=True)
    _fsdp_run(seed)


def _fsdp_run(seed: int) -> None:
    """dp=2 x sp=2 with FSDP2 (fully_shard of the decoder layers over all 4 ranks, which averages
    the gradients over the 4): with grad_scale=sp the gradients are the mean over the two data-
    parallel batches of the single-process gradients."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dualkv.integrations import transformers as dkt
    from hf_helpers import tiny_model

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "sp"))
    sp_group, dp_rank = mesh.get_group("sp"), mesh.get_local_rank("dp")
    ref = tiny_model("qwen3", torch.float64, seed=seed % 1000)
    ref.set_attn_implementation("dualkv")
    batches = [_model_batch(seed + 10 + i, 2, ref) for i in range(2)]
    want: dict[str, torch.Tensor] = {}
    for packed, adv, old in batches:
        ref.zero_grad(set_to_none=True)
        lp = dkt.packed_response_logprobs(ref, packed, temperature=TEMPERATURE)
        dualkv.dapo_loss(lp, old, adv, packed.response_mask)[0].backward()
        for n, p in ref.named_parameters():
            want[n] = want.get(n, 0) + p.grad / 2

    model = tiny_model("qwen3", torch.float64, seed=seed % 1000)
    model.set_attn_implementation("dualkv")
    flat = init_device_mesh("cpu", (4,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=flat)
    packed, adv, old = batches[dp_rank]
    lp = dkt.sequence_parallel_logprobs(model, packed, sp_group, TEMPERATURE, grad_scale=2.0)
    dualkv.dapo_loss(lp, old, adv, packed.response_mask)[0].backward()
    for n, p in model.named_parameters():
        if "layers" in n:  # FSDP's reduce-scatter averaged these over the 4 ranks
            g = p.grad.full_tensor()
        else:  # embeddings (tied LM head) and the final norm, outside FSDP: the same average
            g = p.grad.clone()
            dist.all_reduce(g)
            g /= 4
        err = (g - want[n]).abs().max().item()
        assert err <= 1e-10 * want[n].abs().max().item() + 1e-15, ("fsdp", n, err)


def _model_run(group: Any, world: int, seed: int, checkpointing: bool) -> None:
    from dualkv.integrations import transformers as dkt
    from hf_helpers import tiny_model

    model = tiny_model("qwen3", torch.float64, seed=seed % 1000)
    model.set_attn_implementation("dualkv")
    if checkpointing:
        model.train()
        dkt.enable_gradient_checkpointing(model, keep_attention=True)
    packed, adv, old = _model_batch(seed, world, model)
    assert packed.token_reduction > 1.0

    lp_r, ent_r, loss_r, g_r = _model_step(model, packed, adv, old, sharded=False)
    lp_s, ent_s, loss_s, g_s = _model_step(model, packed, adv, old, sharded=True, group=group)
    torch.testing.assert_close(lp_s, lp_r, rtol=0, atol=1e-12)
    torch.testing.assert_close(ent_s, ent_r, rtol=0, atol=1e-12)
    assert (lp_s[~packed.response_mask] == 0).all()
    torch.testing.assert_close(loss_s, loss_r, rtol=1e-12, atol=1e-14)
    assert g_s.keys() == g_r.keys() and len(g_r) == len(list(model.parameters()))
    for name, gr in g_r.items():
        err = (g_s[name] - gr).abs().max().item()
        assert err <= 1e-10 * gr.abs().max().item() + 1e-15, (name, err)

    # the sharded hidden states are the single-process ones, rank by rank; the layout also
    # travels through use_layout (the context manager) instead of the keyword
    with torch.no_grad():
        want = dkt.packed_hidden_states(model, packed)[0]
        batch = parallel.shard_batch(packed, group)
        with dkt.use_layout(batch.layout, model):
            got = model.model(input_ids=batch.input_ids, position_ids=batch.position_ids,
                              use_cache=False).last_hidden_state[0]  # fmt: skip
        full = batch.layout.gather(got)
        torch.testing.assert_close(full, want, rtol=0, atol=1e-12)
        # a shard's positions are checked exactly: a model called without position_ids numbers
        # each shard 0..S-1, a shift per rank that a per-group rule could not see (one group of
        # one response: rank 1's shard was accepted, log-probs off by up to 6.9)
        dkt.check_positions(batch.position_ids.clone(), batch.layout)
        one = parallel.shard_batch(
            dualkv.pack(prompts=[list(range(3, 15))], responses=[[[5] * 4]]), group
        )
        if one.layout.rank > 0:
            with pytest.raises(ValueError, match="this rank's slice"):
                dkt.check_positions(torch.arange(one.layout.shard_tokens)[None], one.layout)
        # ranks that pass different batches are refused on every rank (each would attend with
        # its own layout): another split of the same tokens, then another token
        rank = dist.get_rank(group)
        for odd in ([[5] * 2, [5] * 2], [[5] * 3 + [6]]):
            responses = odd if rank % 2 else [[5] * 4]
            with pytest.raises(ValueError, match="passed different packed batches"):
                parallel.shard_batch(
                    dualkv.pack(prompts=[list(range(3, 15))], responses=[responses]), group
                )
        # every scored token is scored on exactly one rank
        count = torch.tensor([batch.token_rows.numel()])
        dist.all_reduce(count, group=group)
        assert int(count) == packed.num_response_tokens


def test_qwen3_step_equals_single_process(seed):
    """2 ranks (two groups side by side), 4 ranks with gradient checkpointing, and 2 x 2 data x
    sequence parallel under FSDP2."""
    pytest.importorskip("transformers")
    spawn_ranks(_model_worker, 4, seed)


def test_group_of_one_is_the_single_gpu_path(seed):
    """In-process, a group of size 1: the same numbers, and no collective in the path."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        layout = dualkv.Layout([5, 2], [[3, 1], [4]])
        sl = parallel.ShardedLayout(layout)
        assert (sl.shard_tokens, sl.padded_tokens, sl.start) == (15, 15, 0)
        g = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(15, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
        want = dualkv.attention(q, k, v, layout, window=3)
        assert torch.equal(parallel.ulysses_attention(q, k, v, sl, window=3), want)
        assert sl.shard(q) is q or torch.equal(sl.shard(q), q)
    finally:
        dist.destroy_process_group()


# --- prefix trees -------------------------------------------------------------------------------
def _tree_batch(rng: random.Random, world: int, boundary: str):
    """Multi-turn rows packed as a tree of depth >= 3 (``dualkv.pack(..., tree=True)``) whose
    first shard boundary falls strictly inside a segment (``"inside"``) or at the end of a
    segment with two children or more (``"branch"``: its last position, on rank 0, predicts each
    child's first token, on rank 1)."""
    from hf_helpers import tree_rows

    for _ in range(2000):
        ids, mask, pw = tree_rows(rng)
        packed = dualkv.pack(ids, mask, pw, tree=True, min_shared=1)
        parents, lengths = packed.layout.parents, packed.layout.lengths
        depth: list[int] = []
        for p in parents:
            depth.append(depth[p] + 1 if p >= 0 else 1)
        shard = -(-packed.total_tokens // world)
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        if boundary == "inside":
            hit = any(s < shard < s + n for s, n in zip(starts, lengths))
        else:
            hit = any(
                s + n == shard and parents.count(i) >= 2
                for i, (s, n) in enumerate(zip(starts, lengths))
            )
        if hit and max(depth) >= 3:
            return ids, mask, pw, packed
    raise AssertionError(f"no tree with a shard boundary {boundary} a segment was drawn")


def _tree_worker(rank: int, world: int, seed: int) -> None:
    """A multi-turn tree micro-batch under sp=2 equals sp=1 and the unshared rows: log-probs,
    entropy, loss and every gradient; with 2 KV heads (one per rank) and with 1 (replicated)."""
    rng = random.Random(seed)
    for kv_heads in (2, 1):
        for boundary in ("inside", "branch"):
            _tree_run(world, seed, _tree_batch(rng, world, boundary), kv_heads)

    # ranks that pass different trees of the same tokens and positions are refused on every
    # rank (each would attend with its own mask): here the odd rank's segments are all roots
    packed = _tree_batch(rng, world, "inside")[3]
    if rank % 2:
        flat = [-1] * len(packed.layout.parents)
        packed = dataclasses.replace(packed, layout=dualkv.Layout.tree(flat, packed.layout.lengths))
    with pytest.raises(ValueError, match="passed different packed batches"):
        parallel.shard_batch(packed)


def _tree_run(world: int, seed: int, batch: tuple, kv_heads: int) -> None:
    from dualkv.integrations import transformers as dkt
    from hf_helpers import Float64Throughout, tiny_config, tiny_model

    ids, mask, pw, packed = batch
    what = (kv_heads, packed.layout.parents, packed.layout.lengths)
    config = tiny_config("qwen3")
    config.num_key_value_heads = kv_heads
    model = tiny_model("qwen3", torch.float64, seed=seed % 1000, config=config)
    assert parallel.kv_replication(4, kv_heads, world) == 3 - kv_heads
    g = torch.Generator().manual_seed(seed + kv_heads)
    adv = torch.randn(packed.num_rows, generator=g, dtype=torch.float64)
    resp = packed.response_mask
    old = torch.randn(resp.shape, generator=g, dtype=torch.float64) * 0.3 * resp

    def step(kind: str):  # noqa: ANN202
        model.zero_grad(set_to_none=True)
        model.set_attn_implementation("sdpa" if kind == "rows" else "dualkv")
        with Float64Throughout():
            if kind == "rows":
                lp, ent = dkt.rows_response_logprobs(
                    model, ids, mask, pw, temperature=TEMPERATURE, return_entropy=True
                )
            elif kind == "sp1":
                lp, ent = dkt.packed_response_logprobs(
                    model, packed, temperature=TEMPERATURE, return_entropy=True
                )
            else:
                lp, ent = dkt.sequence_parallel_logprobs(
                    model, packed, None, TEMPERATURE, return_entropy=True
                )
            lp, ent = lp * resp, ent * resp
            loss = dualkv.dapo_loss(lp, old, adv, resp)[0] - 0.01 * dualkv.aggregate(ent, resp)
            loss.backward()
        if kind == "sp2":
            parallel.all_reduce_gradients(model.parameters())
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        return lp.detach(), ent.detach(), loss.detach(), grads

    sp2, sp1, rows = step("sp2"), step("sp1"), step("rows")
    for name, want, tol in (("sp1", sp1, 1e-12), ("rows", rows, 1e-10)):
        for i, part in enumerate(("logprobs", "entropy", "loss")):
            torch.testing.assert_close(
                sp2[i], want[i], rtol=0, atol=tol, msg=f"{part} vs {name} {what}"
            )
        assert sp2[3].keys() == want[3].keys()
        for n, gw in want[3].items():
            err = (sp2[3][n] - gw).abs().max().item()
            assert err <= 100 * tol * gw.abs().max().item() + 1e-15, (name, n, err, what)
    # the shard's positions are its slice of the tree's (each segment continuing from its
    # parent's end), checked exactly
    batch = parallel.shard_batch(packed)
    dkt.check_positions(batch.position_ids.clone(), batch.layout)


def test_tree_step_equals_single_process_and_rows(seed):
    """Sharded prefix trees (Ulysses, 2 ranks)."""
    pytest.importorskip("transformers")
    spawn_ranks(_tree_worker, 2, seed)


# --- a window that only the mask applies ------------------------------------------------------
def _mask_window_worker(rank: int, world: int, seed: int) -> None:
    """Qwen2-MoE's use_sliding_window reaches the mask only (the attention call gets no window).
    Under sequence parallelism the mask function sees one rank's shard (S tokens), not the packed
    stream: a window w with S <= w < T passed its length test, so the ranks attended without the
    window (log-probs 0.04 off the rows). It must raise as on one process; a window as long as
    the stream changes nothing and runs, equal to the model's own rows."""
    import transformers as T

    from dualkv.integrations import transformers as dkt
    from hf_helpers import VOCAB

    rng = random.Random(seed)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(20)]]
    responses = [[[rng.randrange(3, VOCAB) for _ in range(k)] for k in (12, 10, 8)]]
    ids, mask, pw, gid = dualkv.rows_from_lists(prompts, responses)
    packed = dualkv.pack(ids, mask, pw, gid)
    t = packed.total_tokens
    shard = -(-t // world)
    longest = 20 + 12  # the longest row: distances up to 31 reach past a window of 28
    for window, refused in ((28, True), (t, False)):
        assert not refused or shard <= window < longest
        config = T.Qwen2MoeConfig(
            use_sliding_window=True, sliding_window=window, max_window_layers=2, vocab_size=VOCAB,
            hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
            num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
            max_position_embeddings=512, pad_token_id=0,
        )  # fmt: skip
        torch.manual_seed(seed % 1000)
        model = T.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
        with torch.no_grad():  # weights large enough that the window moves the log-probs
            for name, p in model.named_parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, 0.5 if "embed" in name else 0.08)
            rows = dkt.rows_response_logprobs(model, ids, mask, pw)
            model.set_attn_implementation("dualkv")
            if refused:
                with pytest.raises(NotImplementedError, match=f"limits attention to {window}"):
                    dkt.sequence_parallel_logprobs(model, packed)
            else:
                lp = dkt.sequence_parallel_logprobs(model, packed)
                torch.testing.assert_close(lp, rows * packed.response_mask, rtol=0, atol=1e-4)


def test_window_in_the_mask_only_raises_under_sequence_parallelism(seed):
    pytest.importorskip("transformers")
    spawn_ranks(_mask_window_worker, 2, seed)


def test_sequence_parallel_logprobs_moved() -> None:
    """The old name in dualkv.parallel is a deprecation alias of the HF integration's function."""
    dkt = pytest.importorskip("dualkv.integrations.transformers")
    with pytest.warns(DeprecationWarning, match="dualkv.integrations.transformers"):
        moved = parallel.sequence_parallel_logprobs
    assert moved is dkt.sequence_parallel_logprobs
    with pytest.raises(AttributeError):
        parallel.no_such_name  # noqa: B018
