"""TRL 1.16 GRPOTrainer: the DualKV trainer equals TRL's own unpacked path on the same batch.

Tiny random Qwen3 (and Qwen3-MoE, with its load-balancing loss) saved to a temporary folder, a
tokenizer built locally (a ``tokenizers`` WordLevel model: no hub access), an in-memory dataset
and a simple reward. Compared in float32: per-token log-probs and entropies of the policy and the
reference model, TRL's loss for several loss types and every parameter gradient; one optimizer
step of ``trainer.train()`` (generation by transformers) leaves the same parameters; micro-batches
hold whole prompt groups.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import types

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("datasets")

from datasets import Dataset  # noqa: E402
from transformers import set_seed  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

import dualkv  # noqa: E402
from dualkv.integrations import trl as dktrl  # noqa: E402
from dualkv.integrations import trl_lm_head  # noqa: E402
from dualkv.integrations.trl import (  # noqa: E402
    DualKVGRPOTrainer,
    group_microbatches,
    prefix_families,
    prompt_groups,
)
from hf_helpers import VOCAB, tiny_config  # noqa: E402

PAD, EOS = 0, 1
TEMPERATURE = 0.9


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD, "<eos>": EOS, "<unk>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
        padding_side="left",
    )  # fmt: skip


def _init_weights(model, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08 if "embed" not in name else 0.15)
            elif "bias" in name:
                p.normal_(0.0, 0.05)
            else:
                p.add_(torch.randn_like(p) * 0.1)


def moe_config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, norm_topk_prob=True,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=512, router_aux_loss_coef=0.05, tie_word_embeddings=True,
    )  # fmt: skip


def gpt2_config():
    """Absolute position embeddings: TRL's rows number the left padding too (0..L-1), and so
    must the packed positions."""
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128, attn_pdrop=0.0,
        resid_pdrop=0.0, embd_pdrop=0.0,
    )  # fmt: skip


def opt_config():
    """Learned absolute positions numbered by the attention mask (cumsum - 1): TRL's left-padded
    rows start their real tokens at 0, and so must the packed positions."""
    from transformers import OPTConfig

    return OPTConfig(
        vocab_size=VOCAB, hidden_size=64, ffn_dim=96, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=128, word_embed_proj_dim=64, dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """Saved tiny random models (loaded by path, so TRL builds its reference model from it)."""
    from transformers import AutoModelForCausalLM

    weights_seed = int(os.environ.get("DUALKV_SEED", int.from_bytes(os.urandom(4), "little")))
    print(f"[model_dirs] weights seed={weights_seed}")
    dirs = {}
    for family, cfg in (
        ("qwen3", tiny_config("qwen3")), ("qwen3-moe", moe_config()), ("gpt2", gpt2_config()),
        ("opt", opt_config()),
    ):  # fmt: skip
        cfg.eos_token_id = EOS
        cfg.pad_token_id = PAD
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
        _init_weights(model, seed=weights_seed % 2**31)
        with torch.no_grad():  # make EOS likely enough that completions end at different lengths
            model.get_input_embeddings().weight[EOS] *= 4.0
        path = tmp_path_factory.mktemp(family)
        model.save_pretrained(path)
        dirs[family] = str(path)
    return dirs


def reward_distinct(completions, **kwargs):
    """Distinct words over length, plus 1e-3 x a checksum of the text: varies within a group unless
    two completions are the same. (Distinct words over length alone tie often, e.g. 5 / 7 for two
    6-word completions with one repeat: on seed 3087755361 every group tied, every advantage was 0
    and test_train_step_equals_trl had no step to compare, 'assert moved > 0'.)"""
    return [
        len(set(c.split())) / (1 + len(c.split())) + 1e-3 * (sum(map(ord, c)) % 997) / 997
        for c in completions
    ]


def dataset(rng, n):
    prompts = set()
    while len(prompts) < n:
        prompts.add(" ".join(f"w{rng.randrange(3, VOCAB)}" for _ in range(rng.randint(2, 9))))
    return Dataset.from_dict({"prompt": sorted(prompts)})


def config(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2,
        gradient_accumulation_steps=2, max_completion_length=6, max_steps=1,
        learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", report_to=[],
        logging_steps=1, save_strategy="no", use_cpu=True, bf16=False, seed=1234,
        temperature=TEMPERATURE,
        model_init_kwargs={"attn_implementation": "sdpa", "dtype": torch.float32},
        dataloader_num_workers=0,
    )  # fmt: skip
    base.update(kw)
    return GRPOConfig(**base)


def trainers(path, tmp_path, data, dualkv=None, **kw):
    """TRL's GRPOTrainer and DualKVGRPOTrainer (with the extra arguments ``dualkv``) on the same
    GRPOConfig options ``kw``."""
    made = []
    for cls in (GRPOTrainer, DualKVGRPOTrainer):
        extra = (dualkv or {}) if cls is DualKVGRPOTrainer else {}
        made.append(
            cls(
                model=path,
                reward_funcs=reward_distinct,
                args=config(tmp_path / cls.__name__, **kw),
                train_dataset=data,
                processing_class=tokenizer(),
                **extra,
            )  # fmt: skip
        )
    return made


def random_batch(seed, width=7):
    """TRL's batch layout: left-padded prompts, right-padded completions; groups of identical
    prompts (sizes 1..4, rows shuffled), a masked (truncated) completion, junk in the padding."""
    rng = random.Random(seed)
    groups = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 9))] for _ in range(4)]
    rows = []
    for g, p in enumerate(groups):
        for _ in range(rng.randint(1, 4) if g else 1):  # group 0 is a singleton
            rows.append((p, [rng.randrange(1, VOCAB) for _ in range(rng.randint(0, width))]))
    rows.append((groups[1], []))  # an empty (masked) completion in a shared group
    rng.shuffle(rows)
    b, pw = len(rows), max(len(p) for p in groups)
    junk = torch.randint(0, VOCAB, (b, pw + width), generator=torch.Generator().manual_seed(seed))
    pids, pmask = junk[:, :pw].clone(), torch.zeros(b, pw, dtype=torch.int64)
    cids, cmask = junk[:, pw:].clone(), torch.zeros(b, width, dtype=torch.int64)
    for i, (p, c) in enumerate(rows):
        pids[i, pw - len(p) :], pmask[i, pw - len(p) :] = torch.tensor(p), 1
        if c:
            cids[i, : len(c)], cmask[i, : len(c)] = torch.tensor(c), 1
    g = torch.Generator().manual_seed(seed + 1)
    old = (torch.randn(b, width, generator=g) * 0.2 - 4.5) * cmask
    ref = (torch.randn(b, width, generator=g) * 0.2 - 4.5) * cmask
    return {
        "prompt_ids": pids, "prompt_mask": pmask, "completion_ids": cids, "completion_mask": cmask,
        "advantages": torch.randn(b, generator=g), "old_per_token_logps": old,
        "ref_per_token_logps": ref, "num_items_in_batch": cmask.sum(),
    }  # fmt: skip


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_grads_close(got, want):
    """Each gradient within 2e-4 of its own scale, plus float32 noise of the largest gradient
    (a gradient that is zero in exact arithmetic, e.g. a key bias under the softmax, is noise)."""
    assert got.keys() == want.keys() and want
    noise = 1e-6 * max(w.abs().max().item() for w in want.values()) + 1e-7
    for name, w in want.items():
        scale = w.abs().max().item()
        err = (got[name] - w).abs().max().item()
        assert err <= 2e-4 * scale + noise, (name, err, scale)


@contextlib.contextmanager
def _loss_inputs(tr):
    """Inside: the trainer's loss keeps the per-token log-probs and entropies it is computed from.
    Yields a list, filled after the block with (tensor, dL/dtensor or None) for both."""
    kept, out = [], []
    inner = tr._get_per_token_logps_and_entropies

    def keep(*args, **kwargs):
        res = inner(*args, **kwargs)
        for x in res[:2]:
            if x is not None and x.requires_grad:
                x.retain_grad()
        kept[:] = res[:2]
        return res

    tr._get_per_token_logps_and_entropies = keep
    try:
        yield out
    finally:
        del tr._get_per_token_logps_and_entropies
    out.extend((x, x.grad if x is not None else None) for x in kept)


def _entropy_atol(model, ids, mask, width, cmask):
    """The float32 error two entropies of the same logits x = z / T may differ by, beyond the
    logits' own difference: DualKV's H = lse(x) - E_p[x] (include/dualkv/logits.h) cancels two
    numbers of the logits' size, and so does TRL's fused kernel (log_z - sum e x / sum e), so
    their errors grow with max|x|. Against a float64 oracle (the entropies of the float64 model's
    logits), over 600 draws (150 seeds x 4 families, max|x| up to 46) DualKV's per-token error
    reached 18 eps max|x|, TRL's 7, their difference 18; on seed 80795794 (a peaked tiny OPT: mean
    entropy 0.19, max|x| = 21) DualKV's entropies erred by up to 2.5e-5 with a mean of 3.2e-6,
    which moved the entropy metric by 3.5e-6, over the fixed 1e-6 + 1e-5 relative. Allowed:
    32 eps max|x| per entropy, and so for their mean."""
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits[:, -width - 1 : -1]
    x = logits[cmask] / TEMPERATURE
    return 32 * torch.finfo(torch.float32).eps * x.abs().max().item()


@pytest.mark.parametrize(
    "family,loss_type,extra",
    [
        ("qwen3", "dapo", {"beta": 0.04}),
        # per-micro-batch normalised terms: one micro-batch per generation batch (refused
        # otherwise, test_composition_dependent_options_raise)
        (
            "qwen3",
            "grpo",
            {
                "beta": 0.04,
                "top_entropy_quantile": 0.5,
                "entropy_coef": 0.01,
                "gradient_accumulation_steps": 1,
            },
        ),
        (
            "qwen3",
            "bnpo",
            {
                "beta": 0.0,
                "importance_sampling_level": "sequence",
                "gradient_accumulation_steps": 1,
            },
        ),
        ("qwen3-moe", "dapo", {"beta": 0.04}),
        ("gpt2", "dapo", {"beta": 0.04}),
        ("opt", "dapo", {"beta": 0.04}),
    ],
)
def test_logps_loss_and_grads_equal_trl(model_dirs, tmp_path, seed, family, loss_type, extra):
    data = dataset(random.Random(seed), 4)
    ref_tr, dk_tr = trainers(model_dirs[family], tmp_path, data, loss_type=loss_type, **extra)
    assert dk_tr.model.config._attn_implementation == "dualkv"
    assert ref_tr.model.config._attn_implementation == "sdpa"
    if extra["beta"]:
        assert dk_tr.ref_model.config._attn_implementation == "dualkv"
    if family == "qwen3-moe":
        assert dk_tr.aux_loss_enabled and ref_tr.aux_loss_enabled
    _assert_paths_equal(ref_tr, dk_tr, random_batch(seed), seed, batch_size=3)
    assert max(dk_tr._metrics["eval"]["dualkv/token_reduction"]) > 1.0
    assert set(dk_tr._metrics["eval"]["dualkv/tree"]) == {0.0}  # (nothing shared beyond prompts)


def _assert_paths_equal(ref_tr, dk_tr, batch, seed, batch_size):
    """TRL's trainer ``ref_tr`` and DualKV's ``dk_tr`` (same weights) on one TRL batch: the
    old-policy and reference passes (chunks of ``batch_size`` rows), then TRL's loss (with the
    batch's ``tool_mask`` when it has one) and every gradient."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    width = batch["completion_ids"].shape[1]
    cmask = batch["completion_mask"].bool()

    # the old-policy / reference passes (no grad, chunked by batch_size rows of whole groups)
    outs = {}
    for name, tr in (("trl", ref_tr), ("dualkv", dk_tr)):
        tr.model.eval()
        with torch.no_grad():
            lp, ent, _ = tr._get_per_token_logps_and_entropies(
                tr.model, ids, mask, width, batch_size=batch_size, compute_entropy=True
            )
            ref_lp = None
            if tr.ref_model is not None:
                ref_lp = tr._get_per_token_logps_and_entropies(
                    tr.ref_model, ids, mask, width, batch_size
                )[0]
        outs[name] = (lp, ent, ref_lp)
    lp_t, ent_t, ref_t = outs["trl"]
    lp_d, ent_d, ref_d = outs["dualkv"]
    assert lp_d.shape == lp_t.shape == cmask.shape
    assert (lp_d[~cmask] == 0).all() and (ent_d[~cmask] == 0).all()
    # (a token whose probability rounds to 1 in float32 has log-prob 0: seed 792571311's peaked
    # tiny models gave one, which failed a strict < 0)
    assert (lp_t[cmask] <= 0).all() and (lp_t[cmask] < 0).any()
    torch.testing.assert_close(lp_d, lp_t, rtol=0, atol=1e-4)
    ent_atol = _entropy_atol(ref_tr.model, ids, mask, width, cmask)
    torch.testing.assert_close(ent_d, ent_t, rtol=0, atol=1e-4 + ent_atol)
    if ref_t is not None:
        torch.testing.assert_close(ref_d, ref_t, rtol=0, atol=1e-4)

    # the loss (TRL's _compute_loss, unchanged) and every gradient, with old-policy and reference
    # log-probs near the current ones, as after a rollout: importance ratios around 1, some clipped
    # and some not. (random_batch's fixed -4.5 +- 0.2 put a peaked model's confident tokens,
    # log-prob -1e-3, at ratios of e^4.5: their large dL/dlogp met the float32 rounding of
    # 1 - p = 1 - exp(x - lse), ~eps |lse| in TRL's kernel and DualKV's alike; on seed 3859433193
    # DualKV's gradients came out 3.4e-4 of their scale off a float64 oracle, TRL's 7e-6.)
    g = torch.Generator().manual_seed(seed + 2)
    for key in ("old_per_token_logps", "ref_per_token_logps"):
        batch[key] = (lp_t + 0.15 * torch.randn(lp_t.shape, generator=g)) * cmask
    results = {}
    for name, tr in (("trl", ref_tr), ("dualkv", dk_tr)):
        tr.model.train()
        tr.current_gradient_accumulation_steps = 1
        tr.model.zero_grad(set_to_none=True)
        with _loss_inputs(tr) as inputs:
            loss = tr._compute_loss(tr.model, batch)
            loss.backward()
        results[name] = (loss.detach(), _grads(tr.model), dict(tr._metrics["train"]), inputs)
    (loss_t, g_t, m_t, in_t), (loss_d, g_d, m_d, in_d) = results["trl"], results["dualkv"]
    # the loss is one function of the per-token log-probs (and entropies) on both paths, so its
    # difference is bounded by theirs: |dL| <= sum |dL/dlogp| max|dlogp| + the same for the
    # entropies (first order; x2 for the loss's own rounding). The difference reached 0.79 of a
    # fixed 1e-6 + 1e-5 relative in 300 seeds (seed 2879432805: 1.5e-6 on a loss of 0.096).
    torch.testing.assert_close(in_d[0][0].detach(), in_t[0][0].detach(), rtol=0, atol=1e-4)
    bound = 0.0
    for (x_t, dx), (x_d, _) in zip(in_t, in_d, strict=True):
        if dx is not None:
            bound += dx.abs().sum().item() * (x_d - x_t).detach()[cmask].abs().max().item()
    assert (loss_d - loss_t).abs().item() <= 2 * bound + 1e-7, (float(loss_d), float(loss_t), bound)
    _assert_grads_close(g_d, g_t)
    for key in ("entropy", "kl", "aux_loss", "clip_ratio/region_mean"):
        if key in m_t:  # (a mean of entropies is within what each entropy is)
            atol = 1e-6 + (ent_atol if key == "entropy" else 0.0)
            torch.testing.assert_close(
                torch.tensor(m_d[key][-1]), torch.tensor(m_t[key][-1]), rtol=1e-5, atol=atol
            )
    if ref_tr.aux_loss_enabled:
        assert "aux_loss" in m_t and m_t["aux_loss"][-1] > 0


def multi_turn_batch(seed):
    """TRL's batch layout for multi-turn / tool-calling rows, with TRL's ``tool_mask`` (0 on the
    tool outputs inside a completion, 1 elsewhere and on padding): every prompt starts with one
    system prompt (tool descriptions); each group's completions share a first turn (a tool call)
    and the tool's output, then diverge; a later turn of a trajectory is a row of its own (its
    prompt holds the earlier turns); a single-turn row; a masked (truncated) completion; junk in
    the padding."""
    rng = random.Random(seed)

    def tokens(lo, hi):
        return [rng.randrange(3, VOCAB) for _ in range(rng.randint(lo, hi))]

    system = tokens(8, 14)
    rows = []  # (prompt, completion, tool mask of the completion)
    for g in range(3):
        prompt = system + tokens(1, 5)
        call, output = tokens(2, 4), tokens(2, 4)
        for _ in range(rng.randint(2, 3)):
            answer = tokens(0, 4) + [EOS]
            rows.append((prompt, call + output + answer, [1] * len(call) + [0] * len(output)))
        if g == 0:  # the next turn, trained as a row of its own
            reply = tokens(1, 4) + [EOS]
            rows.append((prompt + call + output + answer, reply, []))
    rows.append((system + tokens(1, 3), tokens(1, 4) + [EOS], []))
    rows.append((rows[0][0], [], []))  # a masked completion in a shared group
    rng.shuffle(rows)
    b = len(rows)
    pw, width = max(len(r[0]) for r in rows), max(len(r[1]) for r in rows)
    junk = torch.randint(0, VOCAB, (b, pw + width), generator=torch.Generator().manual_seed(seed))
    pids, pmask = junk[:, :pw].clone(), torch.zeros(b, pw, dtype=torch.int64)
    cids, cmask = junk[:, pw:].clone(), torch.zeros(b, width, dtype=torch.int64)
    tool_mask = torch.ones(b, width, dtype=torch.int64)
    for i, (p, c, tm) in enumerate(rows):
        pids[i, pw - len(p) :], pmask[i, pw - len(p) :] = torch.tensor(p), 1
        if c:
            cids[i, : len(c)], cmask[i, : len(c)] = torch.tensor(c), 1
        if tm:
            tool_mask[i, : len(tm)] = torch.tensor(tm)
    g = torch.Generator().manual_seed(seed + 1)
    return {
        "prompt_ids": pids, "prompt_mask": pmask, "completion_ids": cids, "completion_mask": cmask,
        "tool_mask": tool_mask, "advantages": torch.randn(b, generator=g),
        "num_items_in_batch": (cmask * tool_mask).sum(),
    }  # fmt: skip


def _prompt_group_tokens(batch):
    """Packed tokens of the batch's rows packed by prompt groups (the depth-two packing)."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    return dualkv.pack(ids, mask, batch["prompt_ids"].shape[1]).total_tokens


@pytest.mark.parametrize(
    "family,tree",
    [("qwen3", None), ("qwen3-moe", None), ("opt", None), ("gpt2", True), ("qwen3", False)],
)
def test_multi_turn_tree_equals_trl(model_dirs, tmp_path, seed, family, tree):
    """Multi-turn / tool-calling rows that share earlier turns (and a system prompt across
    groups): DualKV packs them as a prefix tree (automatically, or forced; by prompt groups when
    told) and its log-probs, entropies, TRL's loss with the tool outputs masked, the MoE
    load-balancing loss and every gradient equal TRL's rows path. Qwen3 (RoPE only) shares the
    system prompt across prompts of different lengths (rows numbered from 0 on the tree); GPT-2
    (learned absolute positions) keeps TRL's left-padded positions, so only rows of equal
    positions share."""
    data = dataset(random.Random(seed), 4)
    dk = {"tree_packing": tree, "tree_min_shared": 4}
    ref_tr, dk_tr = trainers(model_dirs[family], tmp_path, data, dualkv=dk, beta=0.04)
    batch = multi_turn_batch(seed)
    _assert_paths_equal(ref_tr, dk_tr, batch, seed, batch_size=5)
    rows = int(batch["prompt_mask"].sum() + batch["completion_mask"].sum())
    used_tree = dk_tr._metrics["train"]["dualkv/tree"][-1]  # the loss pass: one chunk
    packed = rows / dk_tr._metrics["train"]["dualkv/token_reduction"][-1]
    flat = _prompt_group_tokens(batch)
    if tree is False:
        assert used_tree == 0.0 and packed == pytest.approx(flat)
    else:
        assert used_tree == 1.0
        assert packed < flat  # rows sharing earlier turns: fewer tokens than by prompt groups
        if family != "gpt2":  # the system prompt shared across groups
            assert packed <= 0.9 * flat
    chunks = set(dk_tr._metrics["eval"]["dualkv/tree"])  # (auto: chunk by chunk)
    assert chunks == {float(tree)} if tree is not None else 1.0 in chunks


# --- TRL's own tool-calling loop ------------------------------------------------------------------
# Phrases of the Qwen3 chat template's tool prompt, one token each (a real tokenizer takes a few
# characters per token; byte by byte the prompts would be 5x longer and the test slower).
TOOL_PHRASES = [
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are "
    "provided with function signatures within <tools></tools> XML tags:\n<tools>\n",
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "
    '<function-name>, \"arguments\": <args-json-object>}\n</tool_call>',
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>",
    '{"type": "function", "function": {"name": ', '"description": ',
    '"parameters": {"type": "object", "properties": {', '{"type": "integer", ', '"required": [',
    '"return": {"type": "integer"}}}', '"arguments": ', '{"name": ',
]  # fmt: skip


def tool_tokenizer():
    """A byte-level tokenizer (any text round-trips; no hub access) with TRL's Qwen3 chat
    template, which TRL knows how to parse tool calls from."""
    import trl
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"], padding_side="left",
    )  # fmt: skip
    template = os.path.join(os.path.dirname(trl.__file__), "chat_templates", "qwen3.jinja")
    with open(template) as f:
        fast.chat_template = f.read()
    fast.add_tokens(TOOL_PHRASES)
    return fast


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def scripted_turn(self, prompt_ids, images, multimodal_fields, num_generations, **kwargs):
    """Stands in for ``GRPOTrainer._generate_single_turn`` (a tiny random model never writes a
    tool call): the assistant's next turn, a function of the conversation so far and of the
    row's index in the call. A question "What is a + b [+ c]?" is answered by calling ``add``
    once per ``+`` (the same calls on every completion of the prompt), then with the result and
    a tail that differs between completions; "Say hi" by text alone."""
    tok = self.processing_class
    self._script_calls = getattr(self, "_script_calls", 0) + 1
    out = []
    for i, ids in enumerate(prompt_ids):
        text = tok.decode(ids)
        question = text.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
        numbers = [int(w) for w in question.rstrip("?").split() if w.isdigit()]
        results = [int(r) for r in re.findall(r"<tool_response>\n(-?\d+)\n</tool_response>", text)]
        if numbers and len(results) < len(numbers) - 1:
            a = results[-1] if results else numbers[0]
            args = f'{{"a": {a}, "b": {numbers[len(results) + 1]}}}'
            reply = f'<tool_call>\n{{"name": "add", "arguments": {args}}}\n</tool_call>'
        else:
            tail = " Sure." * ((i + self._script_calls) % 3)
            reply = (f"It is {results[-1]}." if results else "Hi.") + tail
        out.append(tok.encode(reply, add_special_tokens=False) + [tok.eos_token_id])
    return out, None


def reward_text(completions, **kwargs):
    """reward_distinct on the completion's messages (tool outputs included) as text."""
    return reward_distinct([" ".join(str(m.get("content", "")) for m in c) for c in completions])


@pytest.fixture(scope="module")
def tool_model_dir(tmp_path_factory):
    from transformers import AutoModelForCausalLM, Qwen3Config

    tok = tool_tokenizer()
    cfg = Qwen3Config(
        vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, num_hidden_layers=2,
        tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    _init_weights(model, seed=int.from_bytes(os.urandom(4), "little") % 2**31)
    path = tmp_path_factory.mktemp("qwen3-tools")
    model.save_pretrained(path)
    return str(path)


def test_tool_calling_step_equals_trl(tool_model_dir, tmp_path, seed):
    """TRL's own tool-calling loop (``tools=[add]``, its Qwen3 chat template, tool-call parsing,
    tool execution, the tool outputs in the completions under ``tool_mask`` = 0), with scripted
    turns for sampling: one ``trainer.train()`` step of DualKVGRPOTrainer equals TRL's (same
    rows and tool masks, loss, gradient norm, parameters after the step), each micro-batch packed
    as a tree (the tool prompt shared across groups, each group's tool calls and outputs by its
    completions) with fewer tokens than by prompt groups; on a micro-batch of it, with the same
    weights, the log-probs, loss and every gradient equal TRL's."""
    rng = random.Random(seed)
    questions = ["Say hi"] + [
        "What is " + " + ".join(str(rng.randint(1, 99)) for _ in range(rng.randint(2, 3))) + "?"
        for _ in range(3)
    ]
    rng.shuffle(questions)
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": q}] for q in questions]})
    made = []
    for cls in (GRPOTrainer, DualKVGRPOTrainer):
        tr = cls(
            model=tool_model_dir, reward_funcs=reward_text, train_dataset=data, tools=[add],
            args=config(tmp_path / cls.__name__, max_completion_length=160, beta=0.04),
            processing_class=tool_tokenizer(),
        )  # fmt: skip
        tr._generate_single_turn = types.MethodType(scripted_turn, tr)
        made.append(tr)
    ref_tr, dk_tr = made
    before = {n: p.detach().clone() for n, p in ref_tr.model.named_parameters()}
    for tr in made:
        set_seed(tr.args.seed)
        tr.train()

    def rows(tr):
        out = []
        for mb in tr._buffered_inputs:
            for key, tm, m in zip(
                _row_keys(mb), mb["tool_mask"], mb["completion_mask"], strict=True
            ):
                out.append((key, tuple(tm[m.bool()].tolist())))
        return sorted(out)

    assert rows(ref_tr) == rows(dk_tr)  # the same turns, tool calls and tool outputs
    tok = dk_tr.processing_class
    outputs = [
        tok.decode(
            mb["completion_ids"][i][(mb["tool_mask"][i] == 0) & mb["completion_mask"][i].bool()]
        )
        for mb in dk_tr._buffered_inputs
        for i in range(mb["completion_ids"].shape[0])
    ]
    assert sum("<tool_response>" in o for o in outputs) >= 2  # tool outputs are masked
    assert ref_tr.state.log_history[0]["tools/call_frequency"] > 0
    _assert_same_step(ref_tr, dk_tr, before)
    assert dk_tr.state.log_history[0]["dualkv/tree"] == 1.0  # every pass of the step: a tree

    # log-probs, loss and gradients on one micro-batch, both trainers at TRL's weights
    dk_tr.model.load_state_dict(ref_tr.model.state_dict())
    batch = dict(dk_tr._buffered_inputs[0])
    _assert_paths_equal(ref_tr, dk_tr, batch, seed, batch_size=2)
    # the loss pass (the micro-batch in one chunk): a tree of fewer tokens than prompt groups
    assert dk_tr._metrics["train"]["dualkv/tree"][-1] == 1.0
    rows = int(batch["prompt_mask"].sum() + batch["completion_mask"].sum())
    packed = rows / dk_tr._metrics["train"]["dualkv/token_reduction"][-1]
    assert packed <= 0.9 * _prompt_group_tokens(batch)


def rollout_turns(prompts, trainer):
    """A ``rollout_func`` of multi-turn rollouts in an environment: every completion of a prompt
    takes the same first turn and gets the same feedback (``env_mask`` 0), then answers on its
    own; the last prompt's rows are instead the next turn of the first prompt's trajectory,
    whose prompt holds its first turn and feedback. A function of the prompts and of the row's
    index (no model involved: the same on both trainers)."""
    tok = trainer.processing_class

    def first_turn(ids):
        rng = random.Random(sum(ids))
        turn = [rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 5))]
        return turn, [rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 4))]

    first = tok(prompts[0])["input_ids"]
    out: dict[str, list] = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": []}
    for i, prompt in enumerate(prompts):
        ids = tok(prompt)["input_ids"]
        turn, feedback = first_turn(ids)
        if i >= len(prompts) - trainer.num_generations:
            ids, turn, feedback = first + sum(first_turn(first), []), [], []
        answer = [3 + (7 * i + k) % (VOCAB - 3) for k in range(1 + i % 3)] + [EOS]
        out["prompt_ids"].append(ids)
        out["completion_ids"].append(turn + feedback + answer)
        out["env_mask"].append([1] * len(turn) + [0] * len(feedback) + [1] * len(answer))
        out["logprobs"].append([0.0] * len(out["completion_ids"][-1]))
    return out


def test_rollout_func_env_mask_step_equals_trl(model_dirs, tmp_path, seed):
    """TRL's ``rollout_func`` path with an ``env_mask`` (environment feedback inside a completion,
    out of the loss as TRL's tool_mask) and rows sharing earlier turns: one ``train()`` step of
    DualKVGRPOTrainer, packing trees, equals TRL's."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    data = dataset(random.Random(seed), 4)
    made = []
    for cls in (GRPOTrainer, DualKVGRPOTrainer):
        extra = {"tree_min_shared": 2} if cls is DualKVGRPOTrainer else {}
        made.append(
            cls(
                model=model_dirs["qwen3"],
                reward_funcs=reward_distinct,
                train_dataset=data,
                args=config(tmp_path / cls.__name__, beta=0.04, gradient_accumulation_steps=1),
                processing_class=tokenizer(),
                rollout_func=rollout_turns,
                **extra,
            )  # fmt: skip
        )
    ref_tr, dk_tr = made
    before = {n: p.detach().clone() for n, p in ref_tr.model.named_parameters()}
    for tr in made:
        set_seed(tr.args.seed)
        tr.train()
    (mb,) = dk_tr._buffered_inputs
    assert (mb["tool_mask"] == 0).any()  # the environment's feedback is out of the loss
    _assert_same_step(ref_tr, dk_tr, before)
    assert dk_tr.state.log_history[0]["dualkv/tree"] == 1.0
    rows = int(mb["prompt_mask"].sum() + mb["completion_mask"].sum())
    assert rows / dk_tr.state.log_history[0]["dualkv/token_reduction"] < _prompt_group_tokens(mb)


@pytest.mark.parametrize("fp32_head", [False, True])
def test_bf16_autocast_within_trl_error(model_dirs, tmp_path, seed, fp32_head):
    """TRL's bf16=True (autocast, float32 weights; optionally cast_lm_head_to_fp32): the packed
    log-probs' and entropies' mean error against the float32 rows is at most 3x TRL's own bf16
    error (+ slack): two bf16 computations in different orders, of similar error (the ratio
    seen over 24 seeds: 0.5-2.2)."""
    data = dataset(random.Random(seed), 4)
    path = model_dirs["qwen3"]
    want_tr = GRPOTrainer(
        model=path, reward_funcs=reward_distinct, args=config(tmp_path / "fp32"),
        train_dataset=data, processing_class=tokenizer(),
    )  # fmt: skip
    bf = dict(bf16=True, cast_lm_head_to_fp32=fp32_head)
    ref_tr, dk_tr = trainers(path, tmp_path, data, **bf)
    batch = random_batch(seed)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    width = batch["completion_ids"].shape[1]
    got = {}
    for name, tr in (("want", want_tr), ("trl", ref_tr), ("dualkv", dk_tr)):
        with torch.no_grad():
            lp, ent, _ = tr._get_per_token_logps_and_entropies(
                tr.model, ids, mask, width, compute_entropy=True
            )
        got[name] = (lp.float(), ent.float())
    real = batch["completion_mask"].bool()
    for i, what in enumerate(("logprobs", "entropy")):
        # mean error over the real tokens (the max over ~30 tokens is a noisy extreme)
        e_trl = (got["trl"][i] - got["want"][i])[real].abs().mean().item()
        e_dk = (got["dualkv"][i] - got["want"][i])[real].abs().mean().item()
        assert e_trl > 0  # autocast was on
        assert e_dk <= 3 * e_trl + 2e-3, (what, e_dk, e_trl)


def test_float64_model_with_bf16_true(model_dirs, tmp_path, seed):
    """A float64 model with TRL's default bf16=True: autocast never casts float64, so the DualKV
    trainer's log-probs and entropies are those of the model without autocast (TRL's with
    bf16=False, to its float32 outputs' rounding). The DualKV trainer crashed ('expected m1 and
    m2 to have the same dtype, but got: c10::BFloat16 != double'). (TRL's own scoring under
    bf16=True casts the float64 hidden states to float32, which autocast then takes to bf16.)"""
    data = dataset(random.Random(seed), 4)
    f64 = {"attn_implementation": "sdpa", "dtype": torch.float64}
    path = model_dirs["qwen3"]
    want_tr = GRPOTrainer(
        model=path, reward_funcs=reward_distinct, train_dataset=data, processing_class=tokenizer(),
        args=config(tmp_path / "no_bf16", model_init_kwargs=f64),
    )  # fmt: skip
    _, dk_tr = trainers(path, tmp_path, data, bf16=True, model_init_kwargs=f64)
    batch = random_batch(seed)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    width = batch["completion_ids"].shape[1]
    got = []
    for tr in (want_tr, dk_tr):
        assert next(tr.model.parameters()).dtype == torch.float64
        with torch.no_grad():
            lp, ent, _ = tr._get_per_token_logps_and_entropies(
                tr.model, ids, mask, width, compute_entropy=True
            )
        got.append((lp.double(), ent.double()))
    real = batch["completion_mask"].bool()
    for want, dk in zip(*got, strict=True):
        torch.testing.assert_close(dk[real], want[real], rtol=1e-5, atol=1e-5)  # (float32 TRL)


def _row_keys(batch):
    """(prompt tokens, completion tokens) of each row, as a sorted list (order-free comparison)."""
    keys = []
    for i in range(batch["prompt_ids"].shape[0]):
        p = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()].tolist()
        c = batch["completion_ids"][i][batch["completion_mask"][i].bool()].tolist()
        keys.append((tuple(p), tuple(c)))
    return keys


def _assert_whole_groups(micro_batches, num_generations):
    seen = set()
    for mb in micro_batches:
        prompts = [k[0] for k in _row_keys(mb)]
        for p in set(prompts):
            assert prompts.count(p) == num_generations, "a micro-batch holds part of a group"
            assert p not in seen, "a group is spread over micro-batches"
            seen.add(p)


@pytest.mark.parametrize(
    "loss_type,extra",
    [
        ("grpo", {"beta": 0.04, "gradient_checkpointing": True}),
        ("dapo", {"beta": 0.0, "num_generations": 4, "per_device_train_batch_size": 8}),
    ],
)
def test_train_step_equals_trl(model_dirs, tmp_path, seed, loss_type, extra):
    """trainer.train(), one optimizer step over 2 micro-batches: same completions and rewards,
    same loss, same parameters after the step; every micro-batch holds whole groups."""
    data = dataset(random.Random(seed), 12)
    ref_tr, dk_tr = trainers(model_dirs["qwen3"], tmp_path, data, loss_type=loss_type, **extra)
    before = {n: p.detach().clone() for n, p in ref_tr.model.named_parameters()}
    for tr in (ref_tr, dk_tr):
        set_seed(tr.args.seed)  # both generate from the same random state
        tr.train()
    buf_t, buf_d = ref_tr._buffered_inputs, dk_tr._buffered_inputs
    rows_t = sorted(k for mb in buf_t for k in _row_keys(mb))
    rows_d = sorted(k for mb in buf_d for k in _row_keys(mb))
    assert rows_t == rows_d  # the same generations (same seed, same sampling attention)
    assert any(len(k[1]) > 0 for k in rows_d)
    _assert_whole_groups(buf_d, dk_tr.num_generations)
    assert dk_tr.dualkv_groups_cut == 0
    _assert_same_step(ref_tr, dk_tr, before)
    assert dk_tr.state.log_history[0]["dualkv/token_reduction"] > 1.0


def _assert_same_step(ref_tr, dk_tr, before):
    """After one ``train()`` step of each trainer from the parameters ``before``: the same
    reward, loss and gradient norm, and the same parameter step."""
    log_t, log_d = ref_tr.state.log_history[0], dk_tr.state.log_history[0]
    assert log_t["reward"] == log_d["reward"]
    # (TRL logs the entropy as a mean of per-micro-batch means: it depends on which rows share a
    # micro-batch, so it is compared in test_logps_loss_and_grads_equal_trl instead)
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(
            torch.tensor(log_d[key]), torch.tensor(log_t[key]), rtol=2e-4, atol=1e-6
        )
    params_d = dict(dk_tr.model.named_parameters())
    steps = {n: p.detach() - before[n] for n, p in ref_tr.model.named_parameters()}
    moved = max(s.abs().max().item() for s in steps.values())
    for name, step_t in steps.items():  # within 2e-4 of each step, plus float32 noise of the
        step_d = params_d[name].detach() - before[name]  # largest (as _assert_grads_close)
        scale = step_t.abs().max().item()
        assert (step_d - step_t).abs().max().item() <= 2e-4 * scale + 1e-6 * moved + 1e-7, name
    assert moved > 0


def test_old_logps_pass_equals_trl(model_dirs, tmp_path, seed):
    """steps_per_generation > gradient_accumulation_steps: TRL computes old-policy log-probs of
    the whole generation batch (in chunks of per_device_train_batch_size rows)."""
    data = dataset(random.Random(seed), 12)
    ref_tr, dk_tr = trainers(
        model_dirs["qwen3"], tmp_path, data, steps_per_generation=4, per_device_train_batch_size=3,
        num_generations=3,
    )  # fmt: skip
    for tr in (ref_tr, dk_tr):
        set_seed(tr.args.seed)  # both generate from the same random state
        tr.train()
    old = []
    for tr in (ref_tr, dk_tr):
        table = {}
        for mb in tr._buffered_inputs:
            assert "old_per_token_logps" in mb
            for key, lp, m in zip(
                _row_keys(mb), mb["old_per_token_logps"], mb["completion_mask"], strict=True
            ):
                table.setdefault(key, []).append(lp[m.bool()])
        old.append(table)
    assert old[0].keys() == old[1].keys()
    for key, lps in old[0].items():
        for a, b in zip(
            sorted(lps, key=torch.Tensor.sum), sorted(old[1][key], key=torch.Tensor.sum)
        ):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-4)
    _assert_whole_groups(dk_tr._buffered_inputs, 3)


@pytest.mark.parametrize("trial", range(20))
def test_group_microbatches(trial):
    rng = random.Random(trial)
    chunks = rng.randint(1, 5)
    size = rng.randint(1, 9)
    n = chunks * size
    if trial % 2:  # groups of one size that divides the micro-batch: never cut
        g = rng.choice([d for d in range(1, size + 1) if size % d == 0])
        sizes = [g] * (n // g)
    else:
        sizes = []
        while sum(sizes) < n:
            sizes.append(min(rng.randint(1, 2 * size), n - sum(sizes)))
    codes = torch.tensor([i for i, s in enumerate(sizes) for _ in range(s)])
    codes = codes[torch.randperm(n)]
    parts, cut = group_microbatches(codes, chunks, torch.Generator().manual_seed(trial))
    assert len(parts) == chunks and all(p.numel() == size for p in parts)
    assert sorted(torch.cat(parts).tolist()) == list(range(n))
    pieces = [sum(int(codes[p].eq(c).any()) for p in parts) for c in range(len(sizes))]
    if trial % 2:
        assert cut == 0 and pieces == [1] * len(sizes)
    over = sum(k > s // size + (s % size > 0) for k, s in zip(pieces, sizes, strict=True))
    assert over <= cut
    assert cut == sum(k > 1 for k in pieces)  # the groups in more than one micro-batch, once each


def test_group_microbatches_fits_uneven_groups():
    codes = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 3, 3, 4, 4])
    parts, cut = group_microbatches(codes, 2)
    assert cut == 0
    assert sorted(sorted(set(codes[p].tolist())) for p in parts) == [[0, 1], [2, 3, 4]]
    with pytest.raises(ValueError, match="equal micro-batches"):
        group_microbatches(codes, 5)
    # a group larger than a micro-batch (num_generations > per_device_train_batch_size)
    parts, cut = group_microbatches(torch.tensor([0] * 8 + [1] * 4), 3)
    assert cut == 1
    assert sorted(sorted({0 if r < 8 else 1 for r in p.tolist()}) for p in parts) == [[0], [0], [1]]
    # a group larger than a micro-batch whose remainder is cut too: still one group cut
    parts, cut = group_microbatches(torch.tensor([0] * 6 + [1] * 3 + [2] * 3), 3)
    assert cut == 1
    assert sum(int(p.lt(6).any()) for p in parts) == 3


@pytest.mark.parametrize("trial", range(20))
def test_group_microbatches_with_families(trial):
    """Families change where groups go, never the guarantees: equal micro-batches of every row,
    the same random draw, and no more groups cut than without them."""
    rng = random.Random(1000 + trial)
    chunks, size = rng.randint(1, 5), rng.randint(1, 9)
    n = chunks * size
    sizes = []
    while sum(sizes) < n:
        sizes.append(min(rng.randint(1, 2 * size), n - sum(sizes)))
    codes = torch.tensor([i for i, s in enumerate(sizes) for _ in range(s)])[torch.randperm(n)]
    family_of = torch.tensor([rng.randrange(max(1, len(sizes) // 2)) for _ in sizes])
    gen, plain_gen = torch.Generator().manual_seed(trial), torch.Generator().manual_seed(trial)
    parts, cut = group_microbatches(codes, chunks, gen, family_of[codes])
    _, plain_cut = group_microbatches(codes, chunks, plain_gen)
    assert torch.equal(gen.get_state(), plain_gen.get_state())
    assert len(parts) == chunks and all(p.numel() == size for p in parts)
    assert sorted(torch.cat(parts).tolist()) == list(range(n))
    assert cut <= plain_cut
    pieces = [sum(int(codes[p].eq(c).any()) for p in parts) for c in range(len(sizes))]
    assert cut == sum(k > 1 for k in pieces)


def test_group_microbatches_keeps_families_together():
    # 8 groups of 2 rows, families {g, g + 4}: 4 micro-batches of 4 rows, one family each
    codes = torch.arange(16) // 2
    families = codes % 4
    for trial in range(10):
        gen = torch.Generator().manual_seed(trial)
        parts, cut = group_microbatches(codes, 4, gen, families)
        assert cut == 0
        assert all(len(set(families[p].tolist())) == 1 for p in parts)
    with pytest.raises(ValueError, match="different families"):
        group_microbatches(codes, 4, families=torch.arange(16) % 3)


def _left_padded(prompts, width=None):
    width = width or max(len(p) for p in prompts)
    ids = torch.randint(0, VOCAB, (len(prompts), width))  # junk in the padding
    mask = torch.zeros(len(prompts), width, dtype=torch.int64)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
    return ids, mask


def test_prefix_families():
    rng = random.Random(5)

    def tokens(n):
        return [rng.randrange(3, VOCAB) for _ in range(n)]

    system, x = tokens(10), tokens(6)
    a, b, c, d = (system + x + tokens(1), system + x + tokens(3), system + tokens(5), tokens(12))
    e = system + x  # an earlier turn of a and b: a prefix of both
    prompts = [a, c, b, a, e, c, b, d, e, d]  # groups of 2 rows
    ids, mask = _left_padded(prompts)
    groups = prompt_groups(ids, mask)

    def family_sets(max_rows, min_shared=4):
        fam = prefix_families(ids, mask, groups, max_rows, min_shared).tolist()
        sets = {}
        for p, f in zip(prompts, fam, strict=True):
            sets.setdefault(f, set()).add(tuple(p))
        return sorted(sorted(len(p) for p in v) for v in sets.values())

    la, lb, lc, ld, le = (len(p) for p in (a, b, c, d, e))
    # system + x (a, b, e: 6 rows) fits in 6; system's subtree (8 rows) does not; d shares nothing
    assert family_sets(6) == sorted([sorted([la, lb, le]), [lc], [ld]])
    assert family_sets(8) == sorted([sorted([la, lb, lc, le]), [ld]])
    # 4 rows: system + x is split into e (ending on it) and its children a, b
    assert family_sets(4) == sorted([[la], [lb], [lc], [ld], [le]])
    # shared prefixes shorter than min_shared tie nothing
    assert family_sets(8, min_shared=20) == sorted([[la], [lb], [lc], [ld], [le]])


def test_split_keeps_groups_sharing_a_prefix_together(model_dirs, tmp_path):
    """Groups whose prompts share earlier turns go to the same micro-batch (so the tree packs
    them together) when they fit; prompt groups stay whole."""
    data = dataset(random.Random(0), 4)
    dk_tr = DualKVGRPOTrainer(
        model=model_dirs["qwen3"], reward_funcs=reward_distinct, args=config(tmp_path),
        train_dataset=data, processing_class=tokenizer(), tree_min_shared=4,
    )  # fmt: skip
    rng = random.Random(1)
    turn1, turn2 = (
        [rng.randrange(3, VOCAB) for _ in range(9)],
        [rng.randrange(3, VOCAB) for _ in range(9)],
    )
    prompts = [turn1 + [5], turn2 + [5, 6], turn1 + [7, 8, 9], turn2 + [9]]
    rows = [p for p in prompts for _ in range(2)]  # 4 groups of 2 rows
    ids, mask = _left_padded(rows)
    ones = torch.ones(8, 3, dtype=torch.int64)
    batch = {
        "prompt_ids": ids, "prompt_mask": mask, "completion_ids": ones, "completion_mask": ones,
        "advantages": torch.randn(8),
    }  # fmt: skip
    for trial in range(6):
        torch.manual_seed(trial)
        parts = dk_tr.split_generation_batch(batch, 2)
        for mb in parts:
            firsts = {
                tuple(r[m.bool()][:9].tolist())
                for r, m in zip(mb["prompt_ids"], mb["prompt_mask"], strict=True)
            }
            assert len(firsts) == 1  # one shared earlier turn per micro-batch
        _assert_whole_groups(parts, 2)
    assert dk_tr.dualkv_groups_cut == 0


def test_tree_weights_and_relative_positions(model_dirs):
    """A tree layout does not tell how many rows each packed token stands for (the trainer
    passes it); the models whose positions are shifted on a tree are those read only through
    RoPE."""
    from transformers import AutoModelForCausalLM

    from dualkv.integrations import transformers as dkt

    ids, mask, pw, _ = dualkv.packing.rows_from_lists([[3, 4, 5]], [[[6, 7], [6, 8]]])
    tree = dualkv.pack(ids, mask, pw, tree=True, min_shared=1)
    assert tree.layout.is_tree
    with pytest.raises(ValueError, match="dualkv_token_weights"):
        trl_lm_head.token_weights(tree)
    relative = {
        family: dkt.relative_positions_only(AutoModelForCausalLM.from_pretrained(path))
        for family, path in model_dirs.items()
    }
    assert relative == {"qwen3": True, "qwen3-moe": True, "gpt2": False, "opt": False}


def test_group_shuffle_draws_what_trls_shuffle_draws():
    """The group shuffle takes the same random draw as TRL's row shuffle, so the next
    generation samples from the same random state as in TRL's own run."""
    from trl.trainer.utils import shuffle_sequence_dict

    codes = torch.arange(24) // 4
    torch.manual_seed(7)
    shuffle_sequence_dict({"x": torch.zeros(24, 3), "y": list(range(24))})
    after_trl = torch.get_rng_state()
    torch.manual_seed(7)
    parts, cut = group_microbatches(codes, 3)
    assert torch.equal(torch.get_rng_state(), after_trl)
    assert cut == 0 and all(len(set(codes[p].tolist())) == 2 for p in parts)


@pytest.mark.parametrize(
    "extra",
    [
        {"loss_type": "bnpo"},
        {"top_entropy_quantile": 0.5},
        {"entropy_coef": 0.01},
        {"use_adaptive_entropy": True},
    ],
)
def test_composition_dependent_options_raise(model_dirs, tmp_path, extra):
    """Terms normalised per micro-batch differ in expectation between TRL's shuffled-row
    micro-batches and DualKV's whole groups: refused when a generation batch is split."""
    data = dataset(random.Random(0), 4)
    name = next(iter(extra))
    with pytest.raises(NotImplementedError, match=f"{name}=.*steps_per_generation=2"):
        DualKVGRPOTrainer(
            model=model_dirs["qwen3"], reward_funcs=reward_distinct,
            args=config(tmp_path, **extra), train_dataset=data, processing_class=tokenizer(),
        )  # fmt: skip
    # one micro-batch per generation batch: the same rows as TRL's, accepted
    DualKVGRPOTrainer(
        model=model_dirs["qwen3"], reward_funcs=reward_distinct,
        args=config(tmp_path, gradient_accumulation_steps=1, **extra), train_dataset=data,
        processing_class=tokenizer(),
    )  # fmt: skip


def test_unsupported_options_raise(model_dirs, tmp_path):
    data = dataset(random.Random(0), 4)
    for bad, error in (({"tree_packing": "auto"}, ValueError), ({"tree_min_shared": 0}, ValueError),
                       ({"tree_min_shared": 2.0}, TypeError)):  # fmt: skip
        with pytest.raises(error, match="tree_"):
            DualKVGRPOTrainer(
                model=model_dirs["qwen3"], reward_funcs=reward_distinct, args=config(tmp_path),
                train_dataset=data, processing_class=tokenizer(), **bad,
            )  # fmt: skip
    with pytest.raises(NotImplementedError, match="use_vllm"):
        DualKVGRPOTrainer(
            model=model_dirs["qwen3"], reward_funcs=reward_distinct,
            args=config(tmp_path, use_vllm=True), train_dataset=data,
            processing_class=tokenizer(),
        )  # fmt: skip
    tr = DualKVGRPOTrainer(
        model=model_dirs["qwen3"], reward_funcs=reward_distinct, args=config(tmp_path),
        train_dataset=data, processing_class=tokenizer(),
    )  # fmt: skip
    batch = random_batch(0)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    with pytest.raises(NotImplementedError, match="pixel_values"):
        tr._get_per_token_logps_and_entropies(
            tr.model, ids, mask, 7, pixel_values=torch.zeros(1, 3)
        )
    bad = mask.clone()
    bad[:, -7] = 0  # a hole at the start of every completion: not right-padded
    bad[:, -6] = 1
    with pytest.raises(ValueError, match="right-padded"):
        tr._get_per_token_logps_and_entropies(tr.model, ids, bad, 7)
    no_prompt = mask.clone()
    no_prompt[1, :-7] = 0  # row 1's prompt fully padded
    with pytest.raises(NotImplementedError, match=r"rows \[1\] have an empty prompt"):
        tr._get_per_token_logps_and_entropies(tr.model, ids, no_prompt, 7)
    # the packed model cannot be called on rows by mistake (no silent fallback)
    with pytest.raises((RuntimeError, ValueError), match=r"dualkv\.Layout|dualkv\.pack"):
        tr.model(input_ids=ids, attention_mask=mask)
    assert dktrl.UNSUPPORTED_OPTIONS
