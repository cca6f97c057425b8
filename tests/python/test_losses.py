"""GRPO/DAPO losses: against a plain per-token reference (veRL's formulas), and advantages."""

from __future__ import annotations

import math

import pytest
import torch

from dualkv.losses import (
    LOSS_AGG_MODES,
    aggregate,
    dapo_loss,
    group_advantages,
    grpo_loss,
    policy_loss,
)


def _batch(seed: int, b: int = 6, r: int = 9):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, r + 1, (b,), generator=g)
    lens[int(torch.randint(0, b, (1,), generator=g))] = 0  # a fully masked row (veRL skips it)
    mask = torch.arange(r)[None, :] < lens[:, None]
    logp = (-torch.rand(b, r, generator=g, dtype=torch.float64) * 3).requires_grad_(True)
    old = (logp.detach() + torch.randn(b, r, generator=g, dtype=torch.float64) * 0.3) * mask
    ref = (logp.detach() + torch.randn(b, r, generator=g, dtype=torch.float64) * 0.2) * mask
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    return logp, old, ref, adv, mask


def _reference(logp, old, adv, mask, lo, hi, c, mode, ref=None, kl_coef=0.0):
    """Token-by-token reference of the clipped surrogate and its aggregation."""
    b, r = logp.shape
    per_tok = [[None] * r for _ in range(b)]
    for i in range(b):
        for j in range(r):
            ratio = torch.exp(torch.clamp(logp[i, j] - old[i, j], -20, 20))
            a = adv[i]
            l1, l2 = -a * ratio, -a * torch.clamp(ratio, 1 - lo, 1 + hi)
            v = torch.maximum(l1, l2)
            if c is not None and a < 0:
                v = torch.minimum(v, -a * c)
            if ref is not None and kl_coef:
                d = torch.clamp(ref[i, j] - logp[i, j], -20, 20)
                v = v + kl_coef * torch.clamp(torch.exp(d) - d - 1, -10, 10)
            per_tok[i][j] = v
    toks = [[per_tok[i][j] for j in range(r) if mask[i, j]] for i in range(b)]
    toks = [row for row in toks if row]  # the seq-mean modes average the rows with a token
    if mode == "token-mean":
        flat = [t for row in toks for t in row]
        return sum(flat) / len(flat)
    if mode == "seq-mean-token-mean":
        return sum(sum(row) / len(row) for row in toks) / len(toks)
    if mode == "seq-mean-token-sum":
        return sum(sum(row) for row in toks) / len(toks)
    return sum(sum(row) / r for row in toks) / len(toks)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("clip", [(0.2, 0.2, None), (0.2, 0.28, None), (0.1, 0.3, 3.0)])
def test_policy_loss_matches_reference(seed, mode, clip):
    logp, old, ref, adv, mask = _batch(seed)
    lo, hi, c = clip
    loss, stats = policy_loss(logp, old, adv, mask, lo, hi, c, mode, ref, kl_coef=0.05)
    want = _reference(logp, old, adv, mask, lo, hi, c, mode, ref, 0.05)
    torch.testing.assert_close(loss, want.float(), rtol=1e-6, atol=1e-6)
    (g,) = torch.autograd.grad(loss, logp)
    (gw,) = torch.autograd.grad(want, logp)
    torch.testing.assert_close(g, gw, rtol=1e-5, atol=1e-7)
    assert (g[~mask] == 0).all()
    assert set(stats) == {"pg_loss", "clipfrac", "approx_kl", "kl"}
    assert all(not v.requires_grad and v.dim() == 0 for v in stats.values())
    assert 0.0 <= float(stats["clipfrac"]) <= 1.0


def test_grpo_and_dapo_defaults(seed):
    logp, old, ref, adv, mask = _batch(seed)
    loss, _ = grpo_loss(logp, old, adv, mask, ref_logprobs=ref, kl_coef=0.04)
    want = _reference(logp, old, adv, mask, 0.2, 0.2, None, "seq-mean-token-mean", ref, 0.04)
    torch.testing.assert_close(loss, want.float(), rtol=1e-6, atol=1e-6)
    loss, stats = dapo_loss(logp, old, adv, mask)
    want = _reference(logp, old, adv, mask, 0.2, 0.28, None, "token-mean")
    torch.testing.assert_close(loss, want.float(), rtol=1e-6, atol=1e-6)
    assert "kl" not in stats
    # per-token advantages broadcast the same way as per-response ones
    loss_tok, _ = dapo_loss(logp, old, adv[:, None].expand_as(logp), mask)
    torch.testing.assert_close(loss_tok, loss)
    # on-policy (old == current): ratio 1, loss = -mean(A) over tokens, nothing clipped
    loss, stats = dapo_loss(logp, logp.detach(), adv, mask)
    want = -(adv[:, None] * mask).sum() / mask.sum()
    torch.testing.assert_close(loss, want.float(), rtol=1e-6, atol=1e-6)
    assert float(stats["clipfrac"]) == 0.0


def test_token_mean_global_count_and_errors(seed):
    logp, old, _, adv, mask = _batch(seed)
    loss, _ = dapo_loss(logp, old, adv, mask)
    loss2, _ = dapo_loss(logp, old, adv, mask, num_tokens=2 * mask.sum())
    torch.testing.assert_close(loss2, loss / 2)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        aggregate(logp, mask, "bogus")
    with pytest.raises(ValueError, match="one shape"):
        policy_loss(logp, old[:, 1:], adv, mask)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        policy_loss(logp, old, adv, mask, clip_ratio_c=0.5)


def test_group_advantages(seed):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.rand(9, generator=g)
    gids = ["a", "b", "a", "c", "b", "a", "b", "a", "d"]
    adv = group_advantages(rewards, gids)
    adv_nostd = group_advantages(rewards, gids, normalize_std=False)
    for i, gi in enumerate(gids):
        members = [rewards[j].item() for j, gj in enumerate(gids) if gj == gi]
        if len(members) == 1:
            assert adv[i].item() == pytest.approx(rewards[i].item())
            continue
        mean = sum(members) / len(members)
        std = math.sqrt(sum((x - mean) ** 2 for x in members) / (len(members) - 1))
        assert adv_nostd[i].item() == pytest.approx(rewards[i].item() - mean, abs=1e-6)
        # The float32 deviation is good to ~1e-6 absolute (checked above), so the normalised one to
        # 1e-6 / std: a reward next to its group mean cannot meet a relative bound alone.
        want = (rewards[i].item() - mean) / (std + 1e-6)
        assert adv[i].item() == pytest.approx(want, rel=1e-4, abs=1e-6 / (std + 1e-6))
    # int tensor group ids give the same result
    codes = torch.tensor([ord(x) for x in gids])
    torch.testing.assert_close(group_advantages(rewards, codes), adv)
