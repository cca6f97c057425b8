"""pack(..., tree=True): rows packed as a prefix tree give the rows' own results.

The reference is each row run alone through the HF model (SDPA on the unshared rows); the packed
tree shares every common prefix (across groups, turns and branches) and must give the same
response log-probs and the same gradients (a shared token's gradient is the sum over its rows).
"""

from __future__ import annotations

import random

import pytest
import torch

import dualkv
from dualkv.integrations import transformers as dkt
from dualkv.packing import pack, pack_rows, rows_from_lists
from hf_helpers import VOCAB, Float64Throughout, tiny_model, tree_rows


def _distinct_groups(rng: random.Random, groups: int) -> tuple[list, list]:
    """Prompts and responses where no two responses of a group (and no two prompts) begin alike,
    so that the prefix tree is exactly the prompt/response layout (two responses or more: a
    prompt with one response is one row, packed as one segment)."""
    firsts = rng.sample(range(VOCAB), groups)
    prompts = [
        [firsts[g]] + [rng.randrange(VOCAB) for _ in range(rng.randint(2, 20))]
        for g in range(groups)
    ]
    responses = []
    for _ in range(groups):
        n = rng.randint(2, 5)
        starts = rng.sample(range(VOCAB), n)
        responses.append(
            [[s] + [rng.randrange(VOCAB) for _ in range(rng.randint(0, 12))] for s in starts]
        )
    return prompts, responses


def test_prompt_groups_pack_as_the_prompt_response_layout(seed):
    rng = random.Random(seed)
    prompts, responses = _distinct_groups(rng, rng.randint(1, 4))
    ids, mask, pw, gid = rows_from_lists(prompts, responses)
    flat = pack_rows(ids, mask, pw, gid)
    tree = pack(ids, mask, pw, tree=True, min_shared=1)
    assert tree.layout.is_tree
    for name in (
        "input_ids", "position_ids", "response_index", "response_mask", "real_mask",
        "response_ids", "token_rows", "token_sources", "token_labels",
    ):  # fmt: skip
        assert torch.equal(getattr(tree, name), getattr(flat, name)), name
    assert torch.equal(tree.layout.segments[:, :3], flat.layout.segments[:, :3])


@pytest.mark.parametrize("min_shared", [1, 4])
def test_multi_turn_tree_step_equals_rows_fp64(seed, min_shared):
    rng = random.Random(seed)
    model = tiny_model("qwen3", torch.float64, seed=seed % 1000)
    ids, mask, pw = tree_rows(rng)
    pk = dualkv.pack(ids, mask, pw, tree=True, min_shared=min_shared)
    assert pk.total_tokens <= int(mask.sum())  # never more tokens than the rows
    weights = torch.randn(ids.shape[0], ids.shape[1] - pw, dtype=torch.float64)

    def step(packed: bool):
        model.zero_grad(set_to_none=True)
        with Float64Throughout():
            if packed:
                model.set_attn_implementation("dualkv")
                lp = dkt.packed_response_logprobs(model, pk)
            else:
                model.set_attn_implementation("sdpa")
                lp = dkt.rows_response_logprobs(model, ids, mask, pw)
            (lp * weights * pk.response_mask).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return lp.detach() * pk.response_mask, grads

    lp_t, g_t = step(True)
    lp_r, g_r = step(False)
    torch.testing.assert_close(lp_t, lp_r, rtol=0, atol=1e-10)
    assert g_t.keys() == g_r.keys()
    for name in g_r:
        scale = g_r[name].abs().max().item() + 1e-30
        err = (g_t[name] - g_r[name]).abs().max().item()
        assert err <= 1e-9 * scale, (name, err, scale)


def test_tree_packing_shares_across_groups():
    system = list(range(1, 70))
    prompts = [system + [100, 101], system + [102]]
    responses = [[[7, 8], [9]], [[7]]]
    pk = pack(prompts=prompts, responses=responses, tree=True)
    # the system prompt (69 tokens >= min_shared 64) is shared by both groups' rows; group 0's
    # own prompt tokens [100, 101] (2 < 64) are repeated in its two responses' segments
    assert pk.total_tokens == len(system) + (2 + 2) + (2 + 1) + (1 + 1)
    assert pk.layout.lengths == (len(system), 4, 3, 2)
    assert pk.layout.parents[0] == -1 and pk.layout.lengths[0] == len(system)


def test_min_shared_needs_tree():
    ids, mask, pw, gid = rows_from_lists([[1, 2]], [[[3]]])
    with pytest.raises(ValueError, match="tree=True"):
        pack(ids, mask, pw, gid, min_shared=8)


# --- explicit trees from nested token lists ------------------------------------------------------


def _random_tree(rng: random.Random, root_token: int, depth: int) -> tuple[list, list]:
    """A random (tokens, children) tree; siblings start with distinct tokens (so that the trie of
    its paths is the tree itself), inner segments non-empty, leaves sometimes empty."""

    def node(level: int, first: int) -> tuple[list, list]:
        kids: list = []
        if level < depth and rng.random() < 0.8:
            firsts = rng.sample(range(2, VOCAB), rng.randint(1, 3))
            kids = [node(level + 1, f) for f in firsts]
        if not kids and level > 0 and rng.random() < 0.2:
            return [], []  # an empty leaf: its row is its parent's path
        tokens = [first] + [rng.randrange(2, VOCAB) for _ in range(rng.randint(0, 6))]
        return tokens, kids

    return node(0, root_token)


def _leaf_paths(node: tuple[list, list]) -> list[list[int]]:
    """The paths below ``node`` to each leaf, depth first (the oracle: plain recursion)."""
    tokens, kids = node
    if not kids:
        return [list(tokens)]
    return [list(tokens) + p for k in kids for p in _leaf_paths(k)]


def _tokens(node: tuple[list, list]) -> int:
    return len(node[0]) + sum(_tokens(k) for k in node[1])


def test_explicit_trees_pack_their_leaf_paths(seed):
    rng = random.Random(seed)
    trees = [_random_tree(rng, root_token=t + 2, depth=rng.randint(0, 4)) for t in range(3)]
    pk = dualkv.pack(trees=trees, min_shared=1)
    assert pk.layout.is_tree
    # one row per leaf, tree by tree, depth first: prompt = the root, response = the path below
    expected = [
        (root, path[len(root) :]) for root, kids in trees for path in _leaf_paths((root, kids))
    ]
    assert pk.num_rows == len(expected)
    for b, (root, response) in enumerate(expected):
        got = pk.response_ids[b][pk.real_mask[b]].tolist()
        assert got == response, (b, got, response)
        # the response's tokens sit in the packed stream where the maps say
        assert pk.input_ids[0, pk.response_index[b][pk.real_mask[b]]].tolist() == response
        if response and root:  # the first response token is predicted from the root's last
            first = pk.input_ids[0, pk.token_sources[pk.token_rows == b * pk.max_response_len]]
            assert first.tolist() == [root[-1]]
    # siblings differ in their first token and the roots too, so the packed tree is the given
    # one: every node's tokens once
    assert pk.total_tokens == sum(_tokens(t) for t in trees)
    assert pk.layout.unshared_tokens >= pk.total_tokens


def test_explicit_tree_step_equals_rows_fp64(seed):
    rng = random.Random(seed)
    model = tiny_model("qwen3", torch.float64, seed=seed % 1000)
    trees = [_random_tree(rng, root_token=t + 2, depth=3) for t in range(2)]
    ids, mask, pw, _ = dualkv.rows_from_trees(trees)
    pk = dualkv.pack(trees=trees, min_shared=1)
    with Float64Throughout():
        model.set_attn_implementation("dualkv")
        lp_t = dkt.packed_response_logprobs(model, pk) * pk.response_mask
        model.set_attn_implementation("sdpa")
        lp_r = dkt.rows_response_logprobs(model, ids, mask, pw) * pk.response_mask
    torch.testing.assert_close(lp_t, lp_r, rtol=0, atol=1e-10)


def test_explicit_trees_errors():
    with pytest.raises(TypeError, match=r"trees\[0\]\[1\]\[1\] must be a node"):
        dualkv.pack(trees=[([1, 2], [([3], []), [4, 5, 6]])])
    with pytest.raises(TypeError, match=r"trees\[0\]\[1\]\[1\]\[0\] must be a list of token"):
        dualkv.pack(trees=[([1, 2], [([3], []), [4, 5]])])  # (a pair of ints, not a node)
    with pytest.raises(TypeError, match=r"trees\[0\]\[1\]\[0\]\[0\]\[1\] must be an int"):
        dualkv.pack(trees=[([1, 2], [([3, "b"], [])])])
    with pytest.raises(TypeError, match=r"trees\[1\]\[1\] must be a list of child nodes"):
        dualkv.pack(trees=[([1], []), ([2], 7)])
    with pytest.raises(ValueError, match="trees= alone.*prompts, responses"):
        dualkv.pack(prompts=[[1]], responses=[[[2]]], trees=[([1], [])])
    with pytest.raises(ValueError, match="trees= alone.*position_ids"):
        dualkv.pack(trees=[([1, 2], [([3], [])])], position_ids=torch.tensor([[9, 9, 9]]))
    with pytest.raises(ValueError, match="at least one"):
        dualkv.pack(trees=[])
    # a root alone is one row with an empty response
    pk = dualkv.pack(trees=[([1, 2, 3], [])], min_shared=1)
    assert pk.num_rows == 1 and not pk.real_mask.any() and pk.total_tokens == 3
