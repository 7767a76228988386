"""Token losses every family can choose (head.loss): forward KL (the default), total variation, a mix.

    TokenLossConfig      the shared config keys head.loss and head.loss_tv_weight (a family's config inherits it)
    check_token_loss     refuse a loss_tv_weight outside [0, 1] (a family's build calls it)
    token_loss           against a soft label p [..., V] (EAGLE-1/3, Medusa with distill)
    hard_token_loss      against a token label (Medusa without distill, MTP): p is one-hot, so TV is 1 - q_gold
    chain_metrics        held-out `chain/s`: the share of start positions whose drafts at steps 0..s all hit

TV is the LK losses' acceptance objective: 0.5 * sum_v |p_v - q_v| = 1 - sum_v min(p_v, q_v), one minus the
rate at which exact verification accepts a draft sampled from q when the target samples from p. With a
token label (the target's greedy token), that rate is q_gold. Tests: `.venv/bin/python -m pytest -q
tests/test_losses.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from heads.base import HeadConfig

LOSSES = ("forward_kl", "tv", "kl_tv")


@dataclass
class TokenLossConfig(HeadConfig):
    """head.loss: forward_kl (cross-entropy to the target's distribution or token; the default), tv (total
    variation, the acceptance-rate objective) or kl_tv, (1 - loss_tv_weight) * forward_kl + loss_tv_weight * tv."""

    loss: Literal["forward_kl", "tv", "kl_tv"] = "forward_kl"
    loss_tv_weight: float = 0.5  # kl_tv only: (1 - w) * forward_kl + w * tv, w in [0, 1]


def check_token_loss(cfg: TokenLossConfig) -> None:
    """ValueError naming the key when loss_tv_weight is outside [0, 1]."""
    if not 0.0 <= cfg.loss_tv_weight <= 1.0:
        raise ValueError(f"head.loss_tv_weight {cfg.loss_tv_weight}: must be in [0, 1]")


def token_loss(logits: torch.Tensor, p: torch.Tensor, mask: torch.Tensor, denom: float, kind: str = "forward_kl",
               tv_weight: float = 0.5) -> torch.Tensor:
    """A token loss: sum over positions of mask * L(p, q), divided by `denom` (EAGLE-3: B*T per TTT step;
    EAGLE-1: the masked count).

    logits [..., V] are the head's, q = softmax(logits); p [..., V] is the target's distribution over the same
    V ids: for EAGLE-3 restricted to the draft vocab and renormalised there (softmax of the target's logits at
    the draft ids), for EAGLE-1 the full vocab. `kind` (head.loss):
        forward_kl   L = -sum_v p_v log q_v     (soft cross-entropy: KL(p || q) up to p's entropy; the default)
        tv           L = 0.5 * sum_v |p_v - q_v|  (= 1 - sum_v min(p_v, q_v) = 1 - the acceptance rate of q
                     under p at temperature 1: the total-variation objective of the LK losses)
        kl_tv        L = (1 - w) * forward_kl + w * tv  with w = tv_weight (a fixed-weight hybrid; the LK
                     paper's hybrid adapts w during training, because pure TV from scratch has small gradients)
    """
    if kind == "forward_kl":
        return _forward_kl(logits, p, mask, denom)
    tv = (mask * 0.5 * (p - logits.softmax(-1)).abs().sum(-1)).sum() / denom
    if kind == "tv":
        return tv
    if kind == "kl_tv":
        return (1.0 - tv_weight) * _forward_kl(logits, p, mask, denom) + tv_weight * tv
    raise ValueError(f"head.loss '{kind}': must be one of {', '.join(LOSSES)}")


def hard_token_loss(logits: torch.Tensor, gold: torch.Tensor, kind: str = "forward_kl",
                    tv_weight: float = 0.5) -> torch.Tensor:
    """token_loss against one-hot labels, averaged over the N rows of logits [N, V] and gold [N], without
    building the [N, V] one-hot: forward_kl is F.cross_entropy (the operations the default always ran), tv is
    1 - q_gold (0.5 * sum_v |onehot_v - q_v| = 0.5 * ((1 - q_gold) + (1 - q_gold)))."""
    if kind == "forward_kl":
        return F.cross_entropy(logits, gold)
    tv = (1.0 - logits.softmax(-1).gather(-1, gold[:, None]).squeeze(-1)).mean()
    if kind == "tv":
        return tv
    if kind == "kl_tv":
        return (1.0 - tv_weight) * F.cross_entropy(logits, gold) + tv_weight * tv
    raise ValueError(f"head.loss '{kind}': must be one of {', '.join(LOSSES)}")


def _forward_kl(logits: torch.Tensor, p: torch.Tensor, mask: torch.Tensor, denom: float) -> torch.Tensor:
    # the expression as it always was: the default loss's floating-point operations, in the same order
    return -(mask * (p * logits.log_softmax(-1)).sum(-1)).sum() / denom


def chain_metrics(hits: Sequence[torch.Tensor], start: torch.Tensor) -> dict[str, float]:
    """`chain/s`: the share of start positions whose top-1 drafts at steps 0..s ALL equal their labels; `n/chain`:
    the start positions (`start`, 1 where step 0 is supervised). hits[s] is step s's hit (0/1, 0 where step s is
    masked out) at the same start index as `start`.

    Under teacher forcing step s reads the sequence's own tokens, which are the head's drafts exactly when steps
    < s hit (MTP's and Medusa's labels are those tokens; EAGLE-3's and DFlash's are the target's greedy tokens,
    the same where the answers were regenerated greedily, as the quickstart's are), so 1 + sum_s chain/s is the
    acceptance length of a greedy K-step chain drafted from every start position (train.metrics' tau_chain).
    The per-step top-1 treats the steps as independent (tau_sim); they are not: hits cluster.
    Example: hits [1 1 0 1], [1 0 0 1], start all 1 -> chain/0 0.75, chain/1 0.5."""
    run = start.float()
    n = float(run.sum())
    out: dict[str, float] = {}
    for s, h in enumerate(hits):
        run = run * h.float()
        out[f"chain/{s}"] = float(run.sum()) / max(n, 1.0)
    out["n/chain"] = n
    return out
