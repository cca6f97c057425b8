"""The edges around the op (issue 14): each case either gives the right answer or raises a clear
error naming the argument; none returns a silently wrong number."""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys

import pytest
import torch

import dualkv
from dualkv import dapo_loss, grpo_loss, pack, policy_loss

LAYOUT = dualkv.Layout([5, 2], [[3, 1], [4]])  # T = 15


def qkv(dtype: torch.dtype = torch.float32, d: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    T = LAYOUT.total_tokens
    return tuple(torch.randn(T, h, d, generator=g, dtype=dtype) for h in (4, 2, 2))


# --- 6. options whose float32 value overflows ---
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "kw,match",
    [
        ({"softmax_scale": 1e39}, "softmax_scale=1e\\+39 overflows"),
        ({"softmax_scale": -3e38}, "softmax_scale=-3e\\+38 overflows"),
        ({"softcap": 1e39}, "softcap=1e\\+39 is outside float32"),
        ({"softcap": 1e-50}, "softcap=1e-50 is outside float32"),
    ],
)
def test_overflowing_options_are_refused(dtype, kw, match) -> None:  # noqa: ANN001
    q, k, v = qkv(dtype)
    with pytest.raises(ValueError, match=match):
        dualkv.attention(q, k, v, LAYOUT, **kw)


@pytest.mark.parametrize("name", ["softmax_scale", "softcap"])
def test_option_beyond_float64_names_the_argument(name: str) -> None:
    # Before: float()'s bare "OverflowError: int too large to convert to float".
    q, k, v = qkv(torch.float64)
    for value in (10**400, -(10**400)):
        with pytest.raises(ValueError, match=f"{name}=-?1000.* is outside float64's range"):
            dualkv.attention(q, k, v, LAYOUT, **{name: value})


def test_large_scale_float64_is_computed() -> None:
    """float64 computes in float64: a scale beyond float32 is a valid (hard-max) attention."""
    q, k, v = qkv(torch.float64)
    out = dualkv.attention(q, k, v, LAYOUT, softmax_scale=1e39)
    assert torch.isfinite(out).all()
    from oracle import dense_attention

    ref, _ = dense_attention(q, k, v, [5, 2], [[3, 1], [4]], 1e39)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)


# --- 8. unclear messages ---
def test_head_dim_zero() -> None:
    q, k, v = (t[..., :0] for t in qkv())
    with pytest.raises(ValueError, match="head dim must be positive"):
        dualkv.attention(q, k, v, LAYOUT)


def test_softcap_none_is_no_softcap() -> None:
    q, k, v = qkv()
    assert torch.equal(
        dualkv.attention(q, k, v, LAYOUT, softcap=None), dualkv.attention(q, k, v, LAYOUT)
    )


@pytest.mark.parametrize(
    "kw,exc,match",
    [
        ({"deterministic": "no"}, TypeError, "deterministic must be True or False, got 'no'"),
        ({"return_lse": 1}, TypeError, "return_lse must be True or False"),
        ({"softcap": "3"}, TypeError, "softcap must be a real number"),
        ({"softmax_scale": True}, TypeError, "softmax_scale must be a real number"),
        ({"window": 2.5}, TypeError, "window must be None or an int"),
        ({"window": True}, TypeError, "window must be None or an int"),
    ],
)
def test_option_types(kw, exc, match) -> None:  # noqa: ANN001
    q, k, v = qkv()
    with pytest.raises(exc, match=match):
        dualkv.attention(q, k, v, LAYOUT, **kw)


def test_numpy_bool_flag() -> None:
    np = pytest.importorskip("numpy")
    q, k, v = qkv()
    out = dualkv.attention(q, k, v, LAYOUT, return_lse=np.True_)
    assert isinstance(out, tuple)


def test_pack_refuses_string_tokens_and_fractional_width() -> None:
    with pytest.raises(TypeError, match=r"prompts\[0\]\[1\] must be an int token id"):
        pack(prompts=[[1, "a"]], responses=[[[2]]])
    with pytest.raises(TypeError, match=r"responses\[0\]\[0\] must be a list of token ids"):
        pack(prompts=[[1]], responses=[["hello"]])
    ids = torch.ones(2, 6, dtype=torch.int64)
    mask = torch.ones(2, 6, dtype=torch.int64)
    with pytest.raises(TypeError, match="prompt_width must be an int"):
        pack(ids, mask, 2.7, [0, 0])
    with pytest.raises(TypeError, match="input_ids must be an integer tensor"):
        pack(ids.float(), mask, 3, [0, 0])
    # integer tensors as token lists are fine
    a = pack(prompts=[torch.tensor([1, 2])], responses=[[torch.tensor([3])]])
    b = pack(prompts=[[1, 2]], responses=[[[3]]])
    assert torch.equal(a.input_ids, b.input_ids)


@pytest.mark.parametrize(
    "prompts,responses,where",
    [
        ([[1, 2, 3]], [[4, 5]], r"responses\[0\]\[0\] is a token id \(4\), not a response"),
        ([[1, 2, 3]], [[[4, 5], 6]], r"responses\[0\]\[1\] is a token id \(6\), not a response"),
        ([[1, 2, 3]], [4, 5], r"responses\[0\] is a token id \(4\), not a list of responses"),
        ([1, 2, 3], [[[4, 5]]], r"prompts\[0\] is a token id \(1\), not a prompt"),
    ],
)
def test_pack_names_responses_not_nested_per_prompt(prompts, responses, where) -> None:  # noqa: ANN001
    # responses given flat (not one list of responses per prompt) failed with a raw
    # "TypeError: object of type 'int' has no len()" or a group-count mismatch
    with pytest.raises(TypeError, match=where) as e:
        pack(prompts=prompts, responses=responses)
    assert "responses=[[[4, 5], [6]]]" in str(e.value)  # the expected nesting
    pk = pack(prompts=[[1, 2, 3]], responses=[[[4, 5]]])  # nested: one response of prompt 0
    assert pk.input_ids.tolist() == [[1, 2, 3, 4, 5]]


# --- 7. P = 0: the first response token has no prediction and is no loss token ---
def test_empty_prompt_first_token_is_not_scored() -> None:
    pk = pack(prompts=[[], [7, 8]], responses=[[[1, 2, 3], [4]], [[5, 6]]])
    assert pk.real_mask.tolist() == [
        [True, True, True], [True, False, False], [True, True, False]
    ]  # fmt: skip
    assert pk.response_mask.tolist() == [
        [False, True, True], [False, False, False], [True, True, False]
    ]  # fmt: skip
    assert pk.num_response_tokens == int(pk.response_mask.sum()) == 4
    hidden = torch.randn(1, pk.total_tokens, 8, requires_grad=True)
    weight = torch.randn(11, 8)
    logp = dualkv.response_logprobs(hidden, weight, pk)
    old = logp.detach() + 0.1
    adv = torch.tensor([1.0, -1.0, 0.5])
    loss, _ = dapo_loss(logp, old, adv, pk.response_mask)
    # token-mean over the 4 scored tokens only (the two unpredicted first tokens excluded)
    ratio = torch.exp(logp - old)
    per_tok = torch.maximum(-adv[:, None] * ratio, -adv[:, None] * ratio.clamp(0.8, 1.28))
    want = per_tok[pk.response_mask].sum() / 4
    torch.testing.assert_close(loss, want)
    # the gathered hidden states keep every real token
    g = pk.gather_responses(hidden)
    assert torch.equal(g[0, 0], hidden[0, 0])


# --- 5. losses ---
def _loss_batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    B, R = 5, 7
    mask = torch.arange(R)[None, :] < torch.tensor([7, 3, 1, 5, 0])[:, None]
    logp = (-torch.rand(B, R, generator=g) * 3).requires_grad_()
    old = logp.detach() + 0.2 * torch.randn(B, R, generator=g)
    ref = logp.detach() + 0.2 * torch.randn(B, R, generator=g)
    adv = torch.randn(B, generator=g)
    return logp, old, ref, adv, mask


def test_advantage_shapes(seed) -> None:
    logp, old, _, adv, mask = _loss_batch(seed)
    a, _ = grpo_loss(logp, old, adv, mask)
    b, _ = grpo_loss(logp, old, adv[:, None], mask)
    c, _ = grpo_loss(logp, old, adv[:, None].expand_as(logp), mask)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(a, c)
    for bad in (adv[:, None, None], adv[:3], adv[None, :], torch.randn(5, 3)):
        with pytest.raises(ValueError, match="advantages must have shape"):
            grpo_loss(logp, old, bad, mask)


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("mode", dualkv.losses.LOSS_AGG_MODES)
def test_padding_poison_cannot_reach_loss_or_grad(poison, mode, seed) -> None:  # noqa: ANN001
    logp, old, ref, adv, mask = _loss_batch(seed)
    adv_tok = adv[:, None].expand(-1, logp.shape[1]).clone()
    clean = policy_loss(logp, old, adv_tok, mask, loss_agg_mode=mode, ref_logprobs=ref,
                        kl_coef=0.1)[0]  # fmt: skip
    (g_clean,) = torch.autograd.grad(clean, logp)
    pad = ~mask
    poisoned = [t.detach().masked_fill(pad, poison) for t in (logp, old, ref, adv_tok)]
    lp = poisoned[0].requires_grad_()
    loss, stats = policy_loss(lp, poisoned[1], poisoned[3], mask, loss_agg_mode=mode,
                              ref_logprobs=poisoned[2], kl_coef=0.1)  # fmt: skip
    (g,) = torch.autograd.grad(loss, lp)
    assert torch.isfinite(loss) and torch.isfinite(g).all()
    torch.testing.assert_close(loss, clean)
    torch.testing.assert_close(g, g_clean)
    assert all(torch.isfinite(v) for v in stats.values())


def test_loss_option_checks() -> None:
    logp, old, _, adv, mask = _loss_batch(0)
    for n in (0, -3, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="num_tokens must be"):
            dapo_loss(logp, old, adv, mask, num_tokens=n)
    with pytest.raises(ValueError, match="num_tokens must be > 0"):
        dapo_loss(logp, old, adv, mask, num_tokens=torch.tensor(0))
    with pytest.raises(ValueError, match=r"clip_eps must be in \[0, 1\)"):
        grpo_loss(logp, old, adv, mask, clip_eps=-0.2)
    with pytest.raises(ValueError, match="clip_low"):
        policy_loss(logp, old, adv, mask, clip_low=1.0)
    with pytest.raises(ValueError, match="clip_high"):
        policy_loss(logp, old, adv, mask, clip_high=-0.1)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        policy_loss(logp, old, adv, mask, clip_ratio_c=0.5)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        policy_loss(logp, old, adv, mask, loss_agg_mode="mean")
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(logp, old, adv, mask, ref_logprobs=logp[:, :2], kl_coef=0.1)
    # a valid num_tokens divides the token sum
    a, _ = dapo_loss(logp, old, adv, mask, num_tokens=int(mask.sum()))
    b, _ = dapo_loss(logp, old, adv, mask)
    torch.testing.assert_close(a, b)


# --- 4. double backward and functorch ---
def test_double_backward_raises_first_order_with_graph_works(seed) -> None:
    g = torch.Generator().manual_seed(seed)
    T = LAYOUT.total_tokens
    q, k, v = (torch.randn(T, h, 8, generator=g, dtype=torch.float64, requires_grad=True)
               for h in (4, 2, 2))  # fmt: skip
    out = dualkv.attention(q, k, v, LAYOUT)
    (dq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    (dq_plain,) = torch.autograd.grad(dualkv.attention(q, k, v, LAYOUT).square().sum(), q)
    torch.testing.assert_close(dq, dq_plain)  # create_graph alone gives the first derivative
    with pytest.raises(NotImplementedError, match="double backward"):
        dq.sum().backward()
    tiny = dualkv.Layout([2], [[1]])
    small = [t[:3, :2, :2].detach().clone().requires_grad_() for t in (q, k, v)]
    with pytest.raises(NotImplementedError, match="double backward"):
        torch.autograd.gradgradcheck(lambda a, b, c: dualkv.attention(a, b, c, tiny), small)


def test_functorch_transforms_raise() -> None:
    q, k, v = qkv(torch.float64, d=8)
    for transform in (torch.func.jacrev, torch.func.grad, torch.func.vmap):
        with pytest.raises(NotImplementedError, match="torch.func transforms"):
            transform(lambda x: dualkv.attention(x, k, v, LAYOUT).sum())(q)


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("which", [0, 1, 2], ids=["q", "k", "v"])
def test_forward_mode_ad_raises(seed, which, requires_grad) -> None:  # noqa: ANN001
    # A dual tensor that does not require grad went below autograd and came out without a
    # tangent: a jvp through attention silently left out attention's part.
    import torch.autograd.forward_ad as fwAD

    inputs = list(qkv(torch.float64, d=8, seed=seed))
    g = torch.Generator().manual_seed(seed + 1)
    tangent = torch.randn(inputs[which].shape, generator=g, dtype=torch.float64)
    inputs[which].requires_grad_(requires_grad)
    with fwAD.dual_level():
        args = list(inputs)
        args[which] = fwAD.make_dual(inputs[which], tangent)
        with pytest.raises(NotImplementedError, match="forward-mode AD"):
            dualkv.attention(*args, LAYOUT)
        # Dual tensors elsewhere in the program do not disturb a call on plain tensors.
        out = dualkv.attention(*inputs, LAYOUT)
    torch.testing.assert_close(out, dualkv.attention(*inputs, LAYOUT), rtol=0, atol=0)


@pytest.mark.parametrize("which", ["hidden", "weight", "bias"])
def test_forward_mode_ad_raises_in_logprobs(seed, which) -> None:  # noqa: ANN001
    # The same for the chunked log-prob op: its tangent was None (finite differences: nonzero).
    import torch.autograd.forward_ad as fwAD

    from dualkv.logprobs import score_tokens

    g = torch.Generator().manual_seed(seed)
    T, H, V = 6, 4, 10
    args = {
        "hidden": torch.randn(T, H, generator=g, dtype=torch.float64),
        "weight": torch.randn(V, H, generator=g, dtype=torch.float64),
        "bias": torch.randn(V, generator=g, dtype=torch.float64),
    }
    labels = torch.randint(0, V, (T,), generator=g)
    with fwAD.dual_level():
        args[which] = fwAD.make_dual(args[which], torch.randn_like(args[which]))
        with pytest.raises(NotImplementedError, match="forward-mode AD"):
            score_tokens(args["hidden"], args["weight"], args["bias"], torch.arange(T), labels,
                         T, 1.0, None, None, False)  # fmt: skip


# --- 9. the demo without transformers ---
def _run_without_transformers(code: str) -> subprocess.CompletedProcess[str]:
    prelude = "import sys; sys.modules['transformers'] = None\n"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run(
        [sys.executable, "-c", prelude + code], capture_output=True, text=True, env=env,
        timeout=300, cwd="/",
    )  # fmt: skip


def test_demo_without_transformers_names_the_extra() -> None:
    r = _run_without_transformers(
        "import runpy; runpy.run_module('dualkv.demo', run_name='__main__')"
    )
    assert r.returncode == 2, r.stderr
    assert "dualkv[transformers]" in r.stderr and "Traceback" not in r.stderr
    r = _run_without_transformers("import dualkv.integrations.transformers")
    assert r.returncode != 0 and "pip install 'dualkv[transformers]'" in r.stderr
    r = _run_without_transformers("import dualkv; print(dualkv.__version__)")
    assert r.returncode == 0, r.stderr  # the core package does not need it


# --- 1-3. the HF backend: positions, other backends, masks ---
transformers = pytest.importorskip("transformers")

import dualkv.integrations.transformers as dkt  # noqa: E402
from hf_helpers import VOCAB, random_groups, tiny_config, tiny_model  # noqa: E402


def _packed(seed: int):
    rng = random.Random(seed)
    prompts, responses = random_groups(rng, groups=3, p_range=(3, 10), n_range=(2, 3))
    return pack(prompts=prompts, responses=responses)


def test_missing_position_ids_raise(seed) -> None:
    model = tiny_model("qwen3", seed=seed % 1000)
    model.set_attn_implementation("dualkv")
    pk = _packed(seed)
    with pytest.raises(ValueError, match="position_ids are not the layout's logical positions"):
        model.model(input_ids=pk.input_ids, dualkv_layout=pk.layout)
    with pytest.raises(ValueError, match="position_ids"):  # 0..T-1 given explicitly
        model(input_ids=pk.input_ids, position_ids=torch.arange(pk.total_tokens)[None],
              dualkv_layout=pk.layout)  # fmt: skip
    # the layout's own positions, a copy of them, and a constant shift per group are accepted
    # (RoPE is relative: the same function)
    ref = model.model(**pk.model_inputs()).last_hidden_state
    copy = model.model(input_ids=pk.input_ids, position_ids=pk.position_ids.clone(),
                       dualkv_layout=pk.layout).last_hidden_state  # fmt: skip
    assert torch.equal(ref, copy)
    counts = [p + sum(r) for p, r in zip(pk.layout.prefix_lens, pk.layout.response_lens)]
    shift = torch.tensor([3, 0, 11]).repeat_interleave(torch.tensor(counts))
    shifted = model.model(input_ids=pk.input_ids, position_ids=pk.position_ids + shift,
                          dualkv_layout=pk.layout).last_hidden_state  # fmt: skip
    torch.testing.assert_close(shifted, ref, rtol=1e-4, atol=1e-4)
    # an accepted tensor is remembered until it changes in place (then it is checked again)
    pos = pk.position_ids.clone()
    model.model(input_ids=pk.input_ids, position_ids=pos, dualkv_layout=pk.layout)
    pos.copy_(torch.arange(pk.total_tokens)[None])
    with pytest.raises(ValueError, match="position_ids are not the layout's logical positions"):
        model.model(input_ids=pk.input_ids, position_ids=pos, dualkv_layout=pk.layout)
    with torch.inference_mode():  # an inference tensor has no version counter: checked each time
        inf = pk.position_ids.clone()
        model.model(input_ids=pk.input_ids, position_ids=inf, dualkv_layout=pk.layout)
        inf.copy_(torch.arange(pk.total_tokens)[None])
        with pytest.raises(ValueError, match="position_ids are not the layout's logical"):
            model.model(input_ids=pk.input_ids, position_ids=inf, dualkv_layout=pk.layout)


def test_missing_position_ids_raise_with_one_response_per_group(seed) -> None:
    # numbering the stream 0..T-1 is a constant shift per group here, which RoPE would not see,
    # but absolute embeddings (GPT-2) and length-dependent RoPE scaling do: it is refused too
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed % 1000)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2)).eval()
    model.set_attn_implementation("dualkv")
    rng = random.Random(seed)
    prompts, responses = random_groups(rng, groups=3, p_range=(3, 10), n_range=(1, 1))
    pk = pack(prompts=prompts, responses=responses)
    with pytest.raises(ValueError, match="position_ids are not the layout's logical positions"):
        model(input_ids=pk.input_ids, dualkv_layout=pk.layout)
    model(**pk.model_inputs())  # the layout's positions
    one = pack(prompts=prompts[:1], responses=responses[:1])  # one group: 0..T-1 is right
    model(input_ids=one.input_ids, dualkv_layout=one.layout)


@pytest.mark.parametrize("whole", [False, True], ids=["layers", "model"])
def test_missing_position_ids_raise_under_compile(seed, whole) -> None:  # noqa: ANN001
    # traced, the rule is a device-side assert (the eager check, skipped while tracing, let the
    # compiled call run with positions 0..T-1: log-probs off by up to 1.1)
    import torch._dynamo

    model = tiny_model("qwen3", seed=seed % 1000)
    model.set_attn_implementation("dualkv")
    pk = _packed(seed)
    want = model.model(**pk.model_inputs()).last_hidden_state
    torch._dynamo.reset()
    try:
        if whole:
            run = torch.compile(model.model, backend="aot_eager")
        else:
            for layer in model.model.layers:
                layer.compile(backend="aot_eager")
            run = model.model
        torch.testing.assert_close(run(**pk.model_inputs()).last_hidden_state, want)
        shifted = pk.position_ids.clone()
        torch.testing.assert_close(
            run(input_ids=pk.input_ids, position_ids=shifted + 0, dualkv_layout=pk.layout)
            .last_hidden_state, want,
        )  # fmt: skip
        with pytest.raises(RuntimeError, match="position_ids are not the layout's logical"):
            run(input_ids=pk.input_ids, dualkv_layout=pk.layout)
    finally:
        torch._dynamo.reset()


def _traced_rule_graphs(pk, dynamic: bool) -> list:  # noqa: ANN001
    """The forward graphs torch.compile makes of check_positions (aten ops after inductor's
    decompositions, what inductor lowers)."""
    import torch._dynamo
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._inductor.decomposition import select_decomp_table

    graphs = []

    def capture(gm, example_inputs):  # noqa: ANN001, ANN202
        def keep(g, _inputs):  # noqa: ANN001, ANN202
            graphs.append(g)
            return g

        return aot_module_simplified(
            gm, example_inputs, fw_compiler=keep, decompositions=select_decomp_table()
        )

    torch._dynamo.reset()
    try:
        check = torch.compile(dkt.check_positions, backend=capture, fullgraph=True, dynamic=dynamic)
        check(pk.position_ids.clone(), pk.layout)
    finally:
        torch._dynamo.reset()
    return graphs


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_traced_position_rule_reduces_over_one_length(seed, dynamic) -> None:  # noqa: ANN001
    # every reduction of the traced rule runs over the same number of elements: on CUDA,
    # inductor's mix-order-reduction fusion asserted ("24575 v.s. 24576", torch 2.11-2.13) on
    # the rule's reductions over T-1 and T tokens once they were large enough to be split
    # (bench/model_step.py --compile at 16, 2048, 512 and beyond)
    graphs = _traced_rule_graphs(_packed(seed), dynamic)
    sizes = [
        str(node.args[0].meta["val"].numel())
        for g in graphs
        for node in g.graph.nodes
        if node.op == "call_function" and torch.Tag.reduction in getattr(node.target, "tags", ())
    ]
    assert len(sizes) >= 2, [g.code for g in graphs]  # the rule was traced
    assert len(set(sizes)) == 1, sizes


def _rule_oracle(pos: list[int], own: list[int]) -> bool:
    """check_positions' rule restated on lists: on each stretch that attention never crosses (it
    starts at logical position 0) the positions differ from the layout's by one constant, and
    they are not 0..T-1 unless that is the layout's own numbering."""
    shift: int | None = None
    for p, o in zip(pos, own, strict=True):
        if o == 0:
            shift = p - o
        elif p - o != shift:
            return False
    return pos != list(range(len(pos))) or pos == own


def test_position_rule_matches_its_oracle(seed) -> None:
    # eager and traced, the rule gives the oracle's verdict on right positions (a constant shift
    # per stretch), positions off by one token, 0..T-1, and other batches' positions
    import torch._dynamo

    rng = random.Random(seed)
    torch._dynamo.reset()
    traced = torch.compile(dkt.check_positions, backend="aot_eager", fullgraph=True)
    try:
        for trial in range(6):
            prompts, responses = random_groups(rng, groups=rng.randint(1, 4), p_range=(0, 6),
                                               n_range=(1, 3), r_range=(1, 5))  # fmt: skip
            pk = pack(prompts=prompts, responses=responses)
            own = pk.position_ids[0].tolist()
            t = len(own)
            cands = [list(range(t)), [x + 1 for x in own]]
            for _ in range(6):
                shift, cand = 0, []
                for o in own:
                    shift = rng.randrange(-3, 9) if o == 0 else shift
                    cand.append(o + shift)
                cands.append(cand)
                bad = list(cand)
                bad[rng.randrange(t)] += rng.choice([-2, -1, 1, 3])
                cands.append(bad)
            other = pack(prompts=[[1] * rng.randint(0, t)], responses=[[[2] * 1]])
            cands.append((other.position_ids[0].tolist() + list(range(t)))[:t])
            for cand in cands:
                want = _rule_oracle(cand, own)
                pos = torch.tensor([cand])
                try:
                    dkt.check_positions(pos, pk.layout)
                except ValueError:
                    got = False
                else:
                    got = True
                assert got == want, (trial, cand, own)
                try:
                    traced(pos.clone(), pk.layout)
                except RuntimeError:
                    got = False
                else:
                    got = True
                assert got == want, ("traced", trial, cand, own)
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("use_cache", [False, True])
def test_position_ids_of_another_length_name_it(seed, use_cache) -> None:  # noqa: ANN001
    # one token short (or long) of the packed stream: RoPE failed on them with a broadcasting
    # error ("The size of tensor a (11) must match the size of tensor b (10)") before the
    # attention could check them
    model = tiny_model("qwen3", seed=seed % 1000)
    model.set_attn_implementation("dualkv")
    pk = _packed(seed)
    t = pk.total_tokens
    longer = torch.cat([pk.position_ids, pk.position_ids[:, -1:] + 1], 1)
    for pos in (pk.position_ids[:, :-1], longer):
        with pytest.raises(ValueError, match=rf"position_ids has {pos.shape[1]} positions .* {t}"):
            model(input_ids=pk.input_ids, position_ids=pos, dualkv_layout=pk.layout,
                  use_cache=use_cache)  # fmt: skip


def test_positions_of_another_layout_say_so(seed) -> None:
    # a layout of another batch with as many tokens, called with this batch's positions: the
    # error said "the model was probably called without position_ids"; it says now that the
    # positions do not follow the layout, and where
    import torch._dynamo

    model = tiny_model("qwen3", seed=seed % 1000)
    model.set_attn_implementation("dualkv")
    pk = pack(prompts=[[1, 2, 3], [7, 8]], responses=[[[4, 5], [6]], [[9, 10, 11]]])
    other = pack(prompts=[[1, 2], [7, 8, 3]], responses=[[[4, 5], [6]], [[9, 10, 11]]])
    assert other.total_tokens == pk.total_tokens
    call = dict(input_ids=pk.input_ids, position_ids=pk.position_ids, dualkv_layout=other.layout)
    with pytest.raises(ValueError, match="do not follow the layout's prompts and responses") as e:
        model.model(**call)
    msg = str(e.value)
    assert "without position_ids" not in msg
    # positions 0 1 2 | 3 4 | 3 ... against the layout's 0 1 | 2 3 | 2 ...: token 4 (the second
    # response of group 0 in the layout) is shifted by 2 against its prompt
    assert (
        "first at packed token 4, the first of a segment: position_ids 4 there and 0 at packed "
        "token 0, the first of its group's prompt, where the layout has 2 and 0; the layout's "
        "prefix_lens=[2, 3]"
    ) in msg, msg
    # within a segment: the two tokens where the positions leave the layout's
    bad = pk.position_ids.clone()
    bad[0, 1] += 1
    with pytest.raises(ValueError, match="do not follow") as e:
        model.model(input_ids=pk.input_ids, position_ids=bad, dualkv_layout=pk.layout)
    assert (
        "first at packed token 1: position_ids [..., 0, 2, ...] where the layout has "
        "[..., 0, 1, ...] within a group" in str(e.value)
    ), str(e.value)
    # a call without position_ids is still named as such
    with pytest.raises(ValueError, match="probably called without position_ids"):
        model.model(input_ids=pk.input_ids, dualkv_layout=pk.layout)
    # traced: the same rule and message (an assert in the graph, no location)
    torch._dynamo.reset()
    try:
        run = torch.compile(model.model, backend="aot_eager")
        with pytest.raises(RuntimeError, match="do not follow the layout's prompts") as e:
            run(**call)
        assert "without position_ids" not in str(e.value)
        with pytest.raises(RuntimeError, match="probably called without position_ids"):
            run(input_ids=pk.input_ids, dualkv_layout=pk.layout)
    finally:
        torch._dynamo.reset()


def test_empty_batch_through_the_model() -> None:
    # transformers' forward cannot run on 0 tokens: an empty batch gives empty log-probs
    model = tiny_model("qwen3")
    model.set_attn_implementation("dualkv")
    pk = pack(torch.zeros(0, 6, dtype=torch.long), torch.zeros(0, 6, dtype=torch.long), 3)
    lp, ent = dkt.packed_response_logprobs(model, pk, return_entropy=True)
    assert lp.shape == ent.shape == (0, 3)


def test_multimodal_inputs_refused_by_the_packed_forward() -> None:
    # the packed forward runs the text decoder, whose **kwargs would swallow them (a
    # Gemma 3 vision model's log-probs were off by up to 3.0)
    model = tiny_model("qwen3")
    model.set_attn_implementation("dualkv")
    pk = _packed(0)
    for name in ("pixel_values", "token_type_ids", "input_features", "video_grid_thw"):
        with pytest.raises(NotImplementedError, match=name):
            dkt.packed_response_logprobs(model, pk, **{name: torch.zeros(1)})
    dkt.packed_response_logprobs(model, pk, pixel_values=None)  # None is no input

    with pytest.raises(NotImplementedError, match="pixel_values"):  # the sharded forward too
        dkt.sequence_parallel_logprobs(model, pk, None, pixel_values=torch.zeros(1))


def test_positions_shift_per_response_without_prompt(seed) -> None:
    # the responses of a group without a prompt never see each other: each may carry its own
    # shift (RoPE is relative); a shift inside a stretch is refused
    model = tiny_model("qwen3", seed=seed % 1000)
    model.set_attn_implementation("dualkv")
    pk = pack(prompts=[[], [5, 6, 7]], responses=[[[1, 2, 3], [4, 5]], [[8, 9]]])
    ref = model.model(**pk.model_inputs()).last_hidden_state
    shift = torch.tensor([[0, 0, 0, 7, 7, 2, 2, 2, 2, 2]])
    got = model.model(input_ids=pk.input_ids, position_ids=pk.position_ids + shift,
                      dualkv_layout=pk.layout).last_hidden_state  # fmt: skip
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    bad = torch.tensor([[0, 0, 1, 7, 7, 2, 2, 2, 2, 2]])
    with pytest.raises(ValueError, match="position_ids are not the layout's logical positions"):
        model.model(input_ids=pk.input_ids, position_ids=pk.position_ids + bad,
                    dualkv_layout=pk.layout)  # fmt: skip


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_layout_reaching_another_backend_raises(impl, seed) -> None:  # noqa: ANN001
    model = tiny_model("qwen3", seed=seed % 1000)
    model.set_attn_implementation(impl)
    pk = _packed(seed)
    with pytest.raises(ValueError, match=f"reached attn_implementation='{impl}'"):
        model.model(**pk.model_inputs())
    # without a layout the backend works as before
    out = model(input_ids=pk.input_ids[:, :5])
    assert out.logits.shape == (1, 5, VOCAB)


def test_shared_config_switch_is_caught(seed) -> None:
    from transformers import AutoModelForCausalLM

    first = tiny_model("qwen3", seed=seed % 1000)
    first.set_attn_implementation("dualkv")
    pk = _packed(seed)
    first.model(**pk.model_inputs())  # fine
    AutoModelForCausalLM.from_config(first.config, attn_implementation="sdpa")
    if first.config._attn_implementation != "dualkv":  # the shared config switched `first`
        with pytest.raises(ValueError, match="reached attn_implementation='sdpa'"):
            first.model(**pk.model_inputs())
        with pytest.raises(ValueError, match="attn_implementation"):
            dkt.packed_hidden_states(first, pk)
    else:  # transformers copied the config: the packed path must still be right
        dkt.packed_hidden_states(first, pk)


def test_attention_mask_with_zeros_raises(seed) -> None:
    model = tiny_model("qwen3", seed=seed % 1000)
    model.set_attn_implementation("dualkv")
    pk = _packed(seed)
    mask = torch.ones_like(pk.input_ids)
    ref = model(**pk.model_inputs()).logits
    ones = model(**pk.model_inputs(), attention_mask=mask).logits
    assert torch.equal(ref, ones)
    mask[0, 4] = 0
    with pytest.raises(ValueError, match="attention_mask with zeros"):
        model(**pk.model_inputs(), attention_mask=mask)
    with pytest.raises(ValueError, match="explicit attention_mask"):  # a prepared 4-D mask
        model(
            **pk.model_inputs(),
            attention_mask=torch.ones(1, 1, pk.total_tokens, pk.total_tokens, dtype=torch.bool),
        )


# --- the self-test ---
def test_self_test_passes_and_can_fail(seed, monkeypatch) -> None:
    import io

    from dualkv import check

    model = tiny_model("qwen3", seed=seed % 1000)
    out = io.StringIO()
    report = check.self_test(model, seed=seed % 1000, out=out)
    assert report.passed, out.getvalue()
    assert "PASSED" in out.getvalue()
    assert report.value("max log-prob error") < 1e-4
    assert report.value("max grad error / scale") < 1e-3
    assert model.config._attn_implementation == "sdpa"  # restored
    # a packed path that is wrong by 1% is reported as a failure
    real = dkt.attention_backend.attention
    monkeypatch.setattr(dkt.attention_backend, "attention", lambda *a, **kw: real(*a, **kw) * 1.01)
    bad = check.self_test(model, seed=seed % 1000, out=None)
    assert not bad.passed and bad.value("max log-prob error") > report.measures[0][2]
    monkeypatch.setattr(dkt.attention_backend, "attention", real)
    # a NaN in one parameter's packed gradient is a failure, whichever parameters follow it
    emb = model.get_input_embeddings().weight

    def poison(g: torch.Tensor) -> torch.Tensor:
        if model.config._attn_implementation == "dualkv":
            g = g.clone()
            g[3, 0] = float("nan")
        return g

    handle = emb.register_hook(poison)
    try:
        nan = check.self_test(model, seed=seed % 1000, out=None)
    finally:
        handle.remove()
    assert not nan.passed and math.isnan(nan.value("max grad error / scale"))


def test_self_test_16bit_yardstick_window_and_reference(seed, monkeypatch) -> None:
    """bf16: judged against a float32 copy (check.YARDSTICK), a correct model passes (48 of 48
    seeds) and a 15% attention-scale error fails (48 of 48; a 5% one 8 of 16); a window longer
    than the batch is shrunk so that dropping it fails; a model that soft-caps attention logits
    is compared with eager rows (SDPA cannot soft-cap)."""
    from dualkv import check

    model = tiny_model("qwen3", torch.bfloat16, seed=seed % 1000)
    report = check.self_test(model, seed=seed % 1000, out=None)
    assert report.passed, report.lines
    assert next(model.parameters()).dtype == torch.bfloat16  # (the yardstick is a copy)
    real = dkt.attention_backend.attention
    monkeypatch.setattr(
        dkt.attention_backend, "attention",
        lambda q, k, v, layout, softmax_scale=None, **kw: real(
            q, k, v, layout, softmax_scale=(softmax_scale or q.shape[-1] ** -0.5) * 1.15, **kw
        ),
    )  # fmt: skip
    assert not check.self_test(model, seed=seed % 1000, out=None).passed
    monkeypatch.setattr(dkt.attention_backend, "attention", real)

    config = tiny_config("gemma3")
    config.sliding_window = 512  # longer than the batch: the check shrinks it
    gemma = tiny_model("gemma3", config=config, seed=seed % 1000)
    assert check.self_test(gemma, seed=seed % 1000, out=None).passed
    assert gemma.config.sliding_window == 512  # restored
    monkeypatch.setattr(
        dkt.attention_backend, "attention", lambda *a, **kw: real(*a, **{**kw, "window": None})
    )
    assert not check.self_test(gemma, seed=seed % 1000, out=None).passed
    monkeypatch.setattr(dkt.attention_backend, "attention", real)

    gemma2 = tiny_model("gemma2", seed=seed % 1000)
    report = check.self_test(gemma2, seed=seed % 1000, out=None)
    assert report.passed and "'eager'" in report.lines[0], report.lines


def test_check_cli(seed) -> None:
    from dualkv import check

    assert check.main(["--seed", str(seed % 1000), "--groups", "2", "--n", "2"]) == 0


@pytest.mark.parametrize("window", [2**31 - 1, 2**31, 2**63 - 1, 2**70])
def test_huge_window_is_no_window(window: int, seed: int) -> None:
    # Every logical position difference is below 2^31 - 1: such a window sees every earlier key.
    # Before: 2^31 and 2^63 - 1 were refused as not positive, 2^70 failed in the op's argument
    # parser ("Expected a value of type 'Optional[int]' ... found type 'int'").
    q, k, v = qkv(torch.float64, d=8, seed=seed)
    want = dualkv.attention(q, k, v, LAYOUT, return_lse=True)
    got = dualkv.attention(q, k, v, LAYOUT, window=window, return_lse=True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert LAYOUT.allowed_pairs(window) == LAYOUT.allowed_pairs(None)
    with pytest.raises(ValueError, match="window must be None or a positive number"):
        dualkv.attention(q, k, v, LAYOUT, window=1 - window)
