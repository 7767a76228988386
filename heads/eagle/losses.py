"""EAGLE training losses: EAGLE-1 (feature regression + token CE) and EAGLE-3 (training-time test, TTT).

The functions, masks and weights are in heads/eagle/__init__.py's docstring; `step_alignment` holds the
worked example of what step s feeds and masks at each index. tests/test_alignment.py checks the TTT steps
against the drafter's own unroll.

Tests: `.venv/bin/python -m pytest -q tests/test_eagle.py tests/test_alignment.py`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from heads.align import shift_left
from heads.eagle.model import Eagle1Head, Eagle3Head, rotary, ttt_attention
from heads.losses import chain_metrics, token_loss
from heads.types import Features, TargetIO


def step_alignment(input_ids: torch.Tensor, loss_mask: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What TTT step `step` feeds and masks at every index t: (tokens x_{t+1+s}, mask loss_mask[t+2+s]).

    At index t and step s the head reads token x_{t+1+s} and predicts x_{t+2+s} (the target's logits at
    t+1+s are its soft label), so the mask is loss_mask[t+2+s]. Worked example, T = 4,
    input_ids [x0 x1 x2 x3], loss_mask [0 1 1 1]:
      step 0: tokens [x1 x2 x3 0], mask [1 1 0 0]   (index 0 predicts x2, index 1 predicts x3)
      step 1: tokens [x2 x3 0  0], mask [1 0 0 0]   (index 0 predicts x3)
    EAGLE-1 is step 0 of this alignment (its feature target at t is f_{t+1}).
    """
    return shift_left(input_ids, 1 + step), shift_left(loss_mask, 2 + step)


def _positions(b: int, t: int, offset: int, device: torch.device) -> torch.Tensor:
    return (torch.arange(t, device=device) + offset).expand(b, t)


def loss(head: nn.Module, batch: dict, target: TargetIO) -> tuple[torch.Tensor, dict[str, float]]:
    """Training loss and metrics of an EAGLE head on a feature batch (see heads/eagle/__init__.py's docstring)."""
    if isinstance(head, Eagle3Head):
        return _loss_eagle3(head, batch, target)
    if isinstance(head, Eagle1Head):
        return _loss_eagle1(head, batch, target)
    raise TypeError(f"heads.eagle.loss: not an EAGLE head: {type(head).__name__}")


def _target_logits(target: TargetIO, last: torch.Tensor) -> torch.Tensor:
    w = next(target.lm_head.parameters())
    return target.lm_head(last.to(w.dtype)).float()


def _draft_vocab_logits(target: TargetIO, last: torch.Tensor, draft_ids: torch.Tensor) -> torch.Tensor:
    """The target's logits at the draft vocab's ids only: lm_head's rows of those ids, not the full vocab
    (SmolLM2's quickstart: 2,048 of 49,152 ids, 24x fewer multiply-adds than full logits and a gather)."""
    w = next(target.lm_head.parameters())
    bias = getattr(target.lm_head, "bias", None)
    return F.linear(last.to(w.dtype), w[draft_ids], None if bias is None else bias[draft_ids]).float()


def _loss_eagle3(head: Eagle3Head, batch: dict, target: TargetIO) -> tuple[torch.Tensor, dict[str, float]]:
    ids, lmask = batch["input_ids"], batch["loss_mask"].float()
    b, t = ids.shape
    draft_ids = head.draft_ids()
    with torch.no_grad():
        t_arg = batch["target_argmax"].long()  # the target's greedy token after each position (from the store)
        p = _draft_vocab_logits(target, batch["last"], draft_ids).softmax(-1)  # restricted to the draft vocab
        in_vocab = head.t2d[t_arg].float()
    hidden = head.project(Features(last=batch["last"], aux=batch["aux"]))
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    total = hidden.new_zeros((), dtype=torch.float32)
    metrics: dict[str, float] = {}
    hits: list[torch.Tensor] = []  # per step, at the same index t: the chain of one start position
    for s in range(head.ttt_length):
        tokens, mask_tok = step_alignment(ids, lmask, s)
        with torch.no_grad():
            emb = target.embed(tokens)
        cos, sin = rotary(target, hidden, _positions(b, t, s, ids.device))
        q, k, v, resid = head.rows(emb, hidden, cos, sin)
        keys.append(k)
        values.append(v)
        o = head.midlayer.finish(ttt_attention(q, keys, values), resid)
        logits = head.logits(o, target).float()
        # the soft label at index t is the target's distribution at t+1+s (it predicts x_{t+2+s})
        p_s, in_s, arg_s = shift_left(p, 1 + s), shift_left(in_vocab, 1 + s), shift_left(t_arg, 1 + s)
        mask = mask_tok * in_s
        step_loss = token_loss(logits, p_s, mask, b * t, head.loss_kind, head.loss_tv_weight)
        total = total + head.ttt_decay**s * step_loss
        with torch.no_grad():
            hit = (draft_ids[logits.argmax(-1)] == arg_s).float() * mask_tok
            n = float(mask_tok.sum())
            metrics[f"loss/{s}"] = float(step_loss.detach())
            metrics[f"top1/{s}"] = float(hit.sum()) / max(n, 1.0)
            metrics[f"n/{s}"] = n
            hits.append(hit)
        hidden = o  # the next step reads this step's PRE-norm output
    metrics.update(chain_metrics(hits, step_alignment(ids, lmask, 0)[1]))
    return total, metrics


def _loss_eagle1(head: Eagle1Head, batch: dict, target: TargetIO) -> tuple[torch.Tensor, dict[str, float]]:
    ids, lmask = batch["input_ids"], batch["loss_mask"].float()
    b, t = ids.shape
    last = batch["last"].to(head.fc.weight.dtype)
    f_in = last
    if head.training and head.noise > 0:
        f_in = last + (torch.rand_like(last) - 0.5) * head.noise
    tokens, mask = step_alignment(ids, lmask, 0)
    with torch.no_grad():
        emb = target.embed(tokens)
        f_next = shift_left(last, 1)  # the feature the head must predict at t is f_{t+1}
        tl = _target_logits(target, f_next)
        p = tl.softmax(-1)
        t_arg = tl.argmax(-1)
        del tl
    cos, sin = rotary(target, f_in, _positions(b, t, 0, ids.device))
    q, k, v, resid = head.rows(emb, f_in, cos, sin)
    o = head.layer.finish(ttt_attention(q, [k], [v]), resid)
    denom = mask.sum() + 1e-5
    feat = (F.smooth_l1_loss(o.float(), f_next.float(), reduction="none").mean(-1) * mask).sum() / denom
    logits = head.logits(o, target).float()
    ce = token_loss(logits, p, mask, denom, head.loss_kind, head.loss_tv_weight)  # over the full vocab here
    total = head.feature_loss_weight * feat + head.token_loss_weight * ce
    n = float(mask.sum())
    hit = (logits.argmax(-1) == t_arg).float() * mask
    metrics = {"loss/feature": float(feat.detach()), "loss/token": float(ce.detach()), "top1/0": float(hit.sum()) / max(n, 1.0), "n/0": n}
    return total, metrics
