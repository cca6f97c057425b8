"""dualkv.pack: trainer rows and token lists to the packed shared-prompt layout and back."""

from __future__ import annotations

import math
import random

import pytest
import torch

import dualkv
from dualkv.packing import PackedBatch, pack, rows_from_lists
from hf_helpers import VOCAB, random_groups, shuffled_rows


def _check_maps(pk: PackedBatch, ids: torch.Tensor, mask: torch.Tensor, pw: int) -> None:
    flat = pk.input_ids[0]
    rows_resp = ids[:, pw:]
    rmask = mask[:, pw:].bool()
    assert torch.equal(pk.response_mask, rmask)
    assert torch.equal(pk.response_ids, torch.where(rmask, rows_resp, 0))
    assert torch.equal(torch.where(rmask, flat[pk.response_index], 0), pk.response_ids)
    # each scored token: its label is the row's token, its source is the row's previous token
    b = pk.token_rows // pk.max_response_len
    j = pk.token_rows % pk.max_response_len
    assert torch.equal(pk.token_labels, ids[b, pw + j])
    assert torch.equal(flat[pk.token_sources], ids[b, pw + j - 1])
    assert torch.equal(
        pk.position_ids[0][pk.token_sources] + 1, pk.position_ids[0][pk.response_index[b, j]]
    )


def test_pack_rows_matches_lists(seed):
    rng = random.Random(seed)
    prompts, responses = random_groups(
        rng, groups=4, p_range=(1, 9), n_range=(1, 4), r_range=(0, 7)
    )
    ids, mask, pw, gid = shuffled_rows(rng, prompts, responses)
    pk = pack(ids, mask, pw, gid)

    # expected order: groups by first row, rows of a group in row order
    seen, rows_of = [], {}
    for b, g in enumerate(gid):
        gi = int(g.split("-")[1])
        if gi not in rows_of:
            seen.append(gi)
            rows_of[gi] = []
        rows_of[gi].append(b)
    resp_tokens = {b: ids[b, pw:][mask[b, pw:].bool()].tolist() for b in range(ids.shape[0])}
    exp_ids, exp_pos = [], []
    for g in seen:
        exp_ids += prompts[g]
        exp_pos += list(range(len(prompts[g])))
        for b in rows_of[g]:
            exp_ids += resp_tokens[b]
            exp_pos += list(range(len(prompts[g]), len(prompts[g]) + len(resp_tokens[b])))
    assert pk.input_ids.shape == (1, len(exp_ids)) and pk.input_ids.dtype == torch.int64
    assert pk.input_ids[0].tolist() == exp_ids
    assert pk.position_ids[0].tolist() == exp_pos
    assert list(pk.layout.prefix_lens) == [len(prompts[g]) for g in seen]
    assert [list(r) for r in pk.layout.response_lens] == [
        [len(resp_tokens[b]) for b in rows_of[g]] for g in seen
    ]
    assert pk.group_rows == tuple(tuple(rows_of[g]) for g in seen)
    assert pk.total_tokens == len(exp_ids) == pk.layout.total_tokens
    assert pk.num_response_tokens == int(mask[:, pw:].sum())
    assert pk.token_reduction == pytest.approx(pk.layout.token_reduction)
    _check_maps(pk, ids, mask, pw)

    # token lists in group order pack to the same stream as rows sorted by group
    pl = pack(prompts=prompts, responses=responses)
    n = sum(len(p) + sum(len(r) for r in rs) for p, rs in zip(prompts, responses, strict=True))
    assert pl.total_tokens == n
    ids2, mask2, pw2, _ = rows_from_lists(prompts, responses)
    _check_maps(pl, ids2, mask2, pw2)


def test_pack_int_group_ids_positions_and_gather(seed):
    rng = random.Random(seed)
    prompts, responses = random_groups(rng, groups=3, p_range=(2, 6), r_range=(1, 5))
    ids, mask, pw, _ = rows_from_lists(prompts, responses)
    gid = torch.tensor([g for g, rs in enumerate(responses) for _ in rs]) * 7 + 100
    # the rows' own positions (here offset by 3) are what the packed stream carries
    pos = (mask.cumsum(-1) - 1).clamp(min=0) + 3
    pk = pack(ids, mask, pw, gid, position_ids=pos)
    assert torch.equal(pk.position_ids[0], pk.layout.position_ids + 3)
    x = torch.randn(pk.total_tokens, 5, requires_grad=True)
    rows = pk.gather_responses(x)
    assert rows.shape == (ids.shape[0], ids.shape[1] - pw, 5)
    assert torch.equal(rows[pk.response_mask], x[pk.response_index[pk.response_mask]])
    assert (rows[~pk.response_mask] == 0).all()
    rows.sum().backward()
    assert x.grad is not None
    assert torch.equal(pk.gather_responses(x.unsqueeze(0)), rows)
    # padding gathers packed token 0: a non-finite value there stays out of the padding
    y = x.detach().clone()
    y[0] = math.nan
    rows_nan = pk.gather_responses(y)
    assert (rows_nan[~pk.real_mask] == 0).all()
    inputs = pk.model_inputs()
    assert inputs["dualkv_layout"] is pk.layout and inputs["input_ids"] is pk.input_ids


def test_pack_edge_cases():
    # singleton group, an empty response, an empty prompt (its first token has no prediction)
    prompts = [[5, 6, 7], [], [9]]
    responses = [[[1, 2], []], [[3, 4, 8]], [[11]]]
    pk = pack(prompts=prompts, responses=responses)
    assert pk.layout.prefix_lens == (3, 0, 1)
    assert [list(r) for r in pk.layout.response_lens] == [[2, 0], [3], [1]]
    assert pk.input_ids[0].tolist() == [5, 6, 7, 1, 2, 3, 4, 8, 9, 11]
    assert pk.position_ids[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 0, 1]
    # row 2 (empty prompt): token 0 is not scored; tokens 1, 2 are
    assert pk.token_rows.tolist() == [0, 1, 7, 8, 9]
    assert pk.token_sources.tolist() == [2, 3, 5, 6, 8]
    assert pk.token_labels.tolist() == [1, 2, 4, 8, 11]
    # empty batch pieces: no responses at all
    empty = pack(prompts=[], responses=[])
    assert empty.total_tokens == 0 and empty.num_rows == 0


def test_pack_groups_split_across_calls(seed):
    rng = random.Random(seed)
    prompts, responses = random_groups(rng, groups=2, n_range=(4, 4))
    ids, mask, pw, gid = rows_from_lists(prompts, responses)
    a = pack(ids[::2], mask[::2], pw, gid[::2])
    b = pack(ids[1::2], mask[1::2], pw, gid[1::2])
    full = pack(ids, mask, pw, gid)
    assert a.layout.prefix_lens == b.layout.prefix_lens == full.layout.prefix_lens
    assert a.total_tokens + b.total_tokens == full.total_tokens + sum(full.layout.prefix_lens)


def test_pack_errors():
    ids, mask, pw, gid = rows_from_lists([[1, 2, 3], [4, 5]], [[[6], [7, 8]], [[9]]])
    bad = ids.clone()
    bad[1, pw - 1] = 99  # second row of group 0 has a different last prompt token
    with pytest.raises(ValueError, match="different prompts"):
        pack(bad, mask, pw, gid)
    # same tokens but different prompt lengths in one group
    with pytest.raises(ValueError, match="different prompts"):
        pack(ids, mask, pw, torch.tensor([0, 0, 0]))
    hole = mask.clone()
    hole[1, pw] = 0  # response not right-padded
    with pytest.raises(ValueError, match="right-padded"):
        pack(ids, hole, pw, gid)
    hole = mask.clone()
    hole[0, pw - 1] = 0  # prompt not left-padded
    with pytest.raises(ValueError, match="left-padded"):
        pack(ids, hole, pw, gid)
    with pytest.raises(ValueError, match="attention_mask"):
        pack(ids, mask[:, 1:], pw, gid)
    with pytest.raises(ValueError, match="one id per row"):
        pack(ids, mask, pw, gid[:2])
    with pytest.raises(ValueError, match="prompt_width"):
        pack(ids, mask, ids.shape[1] + 1, gid)
    with pytest.raises(ValueError, match="not both"):
        pack(ids, mask, pw, gid, prompts=[[1]], responses=[[[2]]])
    with pytest.raises(ValueError, match="one list of responses per prompt"):
        pack(prompts=[[1]], responses=[])


def test_pack_pad_ids_never_read(seed):
    rng = random.Random(seed)
    prompts, responses = random_groups(rng, groups=3)
    ids, mask, pw, gid = shuffled_rows(rng, prompts, responses)
    pk1 = pack(ids, mask, pw, gid)
    ids2 = torch.where(mask.bool(), ids, torch.randint(0, VOCAB, ids.shape))
    pk2 = pack(ids2, mask, pw, gid)
    assert torch.equal(pk1.input_ids, pk2.input_ids)
    assert torch.equal(pk1.response_ids, pk2.response_ids)
    assert isinstance(pk1.layout, dualkv.Layout)


def test_pack_without_group_ids_groups_identical_prompts(seed):
    rng = random.Random(seed)
    prompts, responses = random_groups(rng, groups=4, p_range=(1, 9), r_range=(0, 7))
    prompts = [[g + 1, *p] for g, p in enumerate(prompts)]  # distinct first tokens
    prompts[3] = list(prompts[1])  # two groups with the same prompt: one group without ids
    prompts[2] = [*prompts[0], 5]  # an extension of another prompt is a different prompt
    ids, mask, pw, gid = shuffled_rows(rng, prompts, responses)
    by_content = pack(ids, mask, pw)  # group_ids=None
    # the same packing as explicit ids that merge the two equal prompts
    merged = ["uid-1" if g == "uid-3" else g for g in gid]
    explicit = pack(ids, mask, pw, merged)
    for name in ("input_ids", "position_ids", "response_index", "token_sources", "token_labels"):
        assert torch.equal(getattr(by_content, name), getattr(explicit, name)), name
    assert by_content.layout.prefix_lens == explicit.layout.prefix_lens
    assert by_content.group_rows == explicit.group_rows
    assert len(by_content.group_rows) == 3
    _check_maps(by_content, ids, mask, pw)
    # pad ids never decide a group; an empty prompt (prompt_width 0) is one group
    noisy = torch.where(mask.bool(), ids, torch.randint(0, VOCAB, ids.shape))
    assert pack(noisy, mask, pw).group_rows == by_content.group_rows
    resp_only = pack(ids[:, pw:], mask[:, pw:], 0)
    assert resp_only.layout.prefix_lens == (0,) and resp_only.num_rows == ids.shape[0]


def test_pack_rows_sharing_a_prompt_need_its_positions():
    # The packed prompt carries one row's positions: a row of the group whose prompt position
    # ids differ was computed at the wrong positions, silently (a tiny Qwen3's log-probs moved
    # by up to 8.75 nats against that row run alone)
    ids, mask, pw, gid = rows_from_lists([[1, 2, 3], [4, 5]], [[[6], [7, 8]], [[9]]])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    moved = pos.clone()
    moved[1, :pw] += 2  # row 1's prompt (group 0, whose positions come from row 0)
    with pytest.raises(ValueError, match="prompt position ids differ"):
        pack(ids, mask, pw, gid, position_ids=moved)
    # positions on padding are never read
    noisy = pos.clone()
    noisy[2, 0] = 77
    assert torch.equal(pack(ids, mask, pw, gid, position_ids=noisy).position_ids,
                       pack(ids, mask, pw, gid, position_ids=pos).position_ids)  # fmt: skip
    # without group ids, equal prompts at different positions are different groups
    by_content = pack(ids, mask, pw, position_ids=moved)
    assert by_content.group_rows == ((0,), (1,), (2,))
    assert by_content.position_ids[0, 4:7].tolist() == [2, 3, 4]  # row 1's own prompt
    assert pack(ids, mask, pw, position_ids=pos).group_rows == ((0, 1), (2,))


def test_group_ids_as_a_list_of_tensor_elements():
    # list(ids_tensor) holds 0-d tensors, which hash by identity: each row was its own group, so
    # group_advantages returned the raw rewards ([1, 0, 1, 0.5] instead of +-0.71) and pack
    # shared no prompt
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.5])
    gid = torch.tensor([3, 3, 8, 8])
    want = dualkv.group_advantages(rewards, gid)
    assert torch.equal(dualkv.group_advantages(rewards, list(gid)), want)
    assert torch.equal(dualkv.group_advantages(rewards, [g.reshape(1) for g in gid]), want)
    ids, mask, pw, gid2 = rows_from_lists([[1, 2], [3]], [[[4], [5]], [[6], [7]]])
    assert pack(ids, mask, pw, list(gid2)).group_rows == ((0, 1), (2, 3))
    with pytest.raises(ValueError, match=r"group_ids\[1\] must be one id"):
        dualkv.group_advantages(rewards, [gid[0], gid[:2], gid[2], gid[3]])
