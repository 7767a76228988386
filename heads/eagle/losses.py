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


NEG = -1e9  # the logit of a copy token the pointer cannot reach yet: finite, so p = 0 there gives 0 * log q = 0


def copy_set(ids: torch.Tensor, t2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's distinct tokens outside the draft vocab and the index each first occurs at: (extra [B, M],
    first [B, M]); a sequence with fewer than M pads with token 0 at index 2T, which no index reaches.

    Called on the tokens after each position (x_{i+1} at i): at index t the pointer sees the committed positions
    i <= t, so the copy tokens it can draft there are the ones with first <= t (`copy_allowed`), at every TTT
    step alike (draft tokens are not added to a request's set)."""
    b, t = ids.shape
    found = []
    for row in ids:
        pos = (~t2d[row]).nonzero().reshape(-1)
        uniq, inv = torch.unique(row[pos], return_inverse=True)
        first = torch.full((uniq.numel(),), t, dtype=torch.long, device=ids.device)
        found.append((uniq, first.scatter_reduce(0, inv, pos, "amin")))
    m = max(1, max(u.numel() for u, _ in found))
    extra = torch.zeros(b, m, dtype=torch.long, device=ids.device)
    first = torch.full((b, m), 2 * t, dtype=torch.long, device=ids.device)
    for i, (u, f) in enumerate(found):
        extra[i, :u.numel()], first[i, :f.numel()] = u, f
    return extra, first


def copy_allowed(first: torch.Tensor, t: int) -> torch.Tensor:
    """[B, T, M] bool: copy token m of sequence b is reachable at index t (first[b, m] <= t: the pointer sees
    positions i <= t, each drafting x_{i+1})."""
    return first[:, None, :] <= torch.arange(t, device=first.device)[None, :, None]


def _loss_eagle3(head: Eagle3Head, batch: dict, target: TargetIO) -> tuple[torch.Tensor, dict[str, float]]:
    ids, lmask = batch["input_ids"], batch["loss_mask"].float()
    b, t = ids.shape
    draft_ids = head.draft_ids()
    pointer = None
    with torch.no_grad():
        t_arg = batch["target_argmax"].long()  # the target's greedy token after each position (from the store)
        tl = _draft_vocab_logits(target, batch["last"], draft_ids)  # restricted to the draft vocab
        in_vocab = head.t2d[t_arg].float()
        if head.pointer:  # the draft vocab extended by the tokens the pointer can reach (copy_set)
            nxt = shift_left(ids, 1)  # the token after each position: what pointing at that position drafts
            extra, first = copy_set(nxt, head.t2d)
            allowed = copy_allowed(first, t)
            w = next(target.lm_head.parameters())
            tl = torch.cat([tl, (batch["last"].to(w.dtype) @ w[extra].transpose(-1, -2)).float()], dim=-1)
            ext_ids = torch.cat([draft_ids.expand(b, -1), extra], dim=-1)  # target id of every logit, per sequence
            v = draft_ids.numel()
            ext = torch.where(head.t2d[nxt], torch.searchsorted(draft_ids, nxt),
                              v + (nxt[..., None] == extra[:, None, :]).int().argmax(-1))
            causal = torch.ones(t, t, dtype=torch.bool, device=ids.device).tril()[None]
        else:
            p = tl.softmax(-1)
    if head.pointer:  # the pointer's keys are trained: outside no_grad
        pointer = (head.pointer_keys(batch["last"]), ext[:, None, :], v + extra.shape[1], causal)
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
        logits = head.logits(o, target, pointer).float()
        # the soft label at index t is the target's distribution at t+1+s (it predicts x_{t+2+s})
        label = p if pointer is None else tl  # a pointer head's is normalised per index, over the set it holds there
        p_s, in_s, arg_s = shift_left(label, 1 + s), shift_left(in_vocab, 1 + s), shift_left(t_arg, 1 + s)
        if pointer is not None:  # the copy tokens reachable at index t (not at t+1+s, whose set may be larger)
            logits = _mask_copy(logits, allowed)
            with torch.no_grad():
                p_s = _mask_copy(p_s, allowed).softmax(-1)
                in_s = in_s + ((arg_s[..., None] == extra[:, None, :]) & allowed).any(-1).float()
        mask = mask_tok * in_s
        step_loss = token_loss(logits, p_s, mask, b * t, head.loss_kind, head.loss_tv_weight)
        total = total + head.ttt_decay**s * step_loss
        with torch.no_grad():
            pick = logits.argmax(-1)
            drafted = draft_ids[pick] if pointer is None else ext_ids.gather(1, pick)
            hit = (drafted == arg_s).float() * mask_tok
            n = float(mask_tok.sum())
            metrics[f"loss/{s}"] = float(step_loss.detach())
            metrics[f"top1/{s}"] = float(hit.sum()) / max(n, 1.0)
            metrics[f"n/{s}"] = n
            hits.append(hit)
        hidden = o  # the next step reads this step's PRE-norm output
    metrics.update(chain_metrics(hits, step_alignment(ids, lmask, 0)[1]))
    return total, metrics


def _mask_copy(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Logits [B, T, V + M] with the copy tokens the pointer cannot reach yet (allowed [B, T, M] false) at NEG."""
    v = logits.shape[-1] - allowed.shape[-1]
    return torch.cat([logits[..., :v], logits[..., v:].masked_fill(~allowed, NEG)], dim=-1)


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
