"""DFlash training: several anchors per sequence per step, each a block [anchor, mask x (B-1)] trained in one pass.

The alignment (speculators' DFlash recipe, `sample_from_anchor` false; see `block_alignment`): a block anchored
at position a holds token x_a at slot 0 and the mask token at slots 1..B-1, at RoPE positions a..a+B-1. It
attends to the context features at positions < a (what the target has processed when x_a is the newly
sampled token) and, bidirectionally, to its own B slots; no block sees another block. Slot k >= 1 predicts
x_{a+k}: its soft label is the target's draft-vocab distribution at position a+k-1, its mask
loss_mask[a+k] times t2d[the target's argmax at a+k-1] (the EAGLE-3 rule), its weight w_k =
exp(-(k-1)/gamma) (heads.dflash.config.loss_weights; slot 0 predicts nothing).

    loss = sum_{b, anchors, k} w_k * mask * CE(p, q) / (number of masked-in slots)

With `sample_from_anchor` (DSpark's layout) every slot drafts, one position later: slot k predicts
x_{a+k+1} against the target's distribution at a+k, weight exp(-k/gamma). With a Markov head, slot k's logits
add the bias of the token before the one it predicts (the sequence's own token at the label position: the
draft that an accepted chain would have fed it); with head.prev_mlp, slot k's state is refined by that same
token's embedding. With `anchor_feature`, every slot's input is a projection of
its embedding and the context feature at a-1 (the position before the anchor: the newest one the drafter has at
drafting time).

Anchors: `anchors` positions per sequence drawn uniformly, without replacement, among a in 1..T-2 with
loss_mask[a+1] = 1 (the first drafted token is supervised; a >= 1 leaves a context); a sequence with fewer
such positions has its extra anchors flagged invalid (masked out of the loss), and a batch whose rows all
have fewer than `anchors` takes them all (no all-invalid column is computed).

Metrics: `top1/{k-1}` = share of masked-in slots k (target argmax outside the draft vocab counted as misses)
where the draft's argmax equals the target's argmax; `n/{k-1}` their count; `chain/{k-1}` the share of blocks whose
slots up to k all hit (heads.losses.chain_metrics).

Tests: `.venv/bin/python -m pytest -q tests/test_dflash.py`.
"""

from __future__ import annotations

import torch

from heads.dflash.model import DFlashHead
from heads.eagle.losses import _draft_vocab_logits  # EAGLE-3's soft labels (draft-vocab rows only)
from heads.losses import chain_metrics
from heads.types import TargetIO


def sample_anchors(loss_mask: torch.Tensor, n: int, generator: torch.Generator | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(anchors [B, m] ascending, valid [B, m]): up to n distinct positions a in 1..T-2 with loss_mask[a+1] per
    row, m = min(n, the most eligible positions of any row) (a larger n takes every eligible position; no
    column is all padding).

    Worked example, loss_mask [[0 0 1 1 0], [0 1 1 1 1]], n = 3: eligible a = {1, 2} and {1, 2, 3} ->
    anchors [[1, 2, 1], [1, 2, 3]], valid [[T, T, F], [T, T, T]] (the padding anchor is 1, masked out)."""
    b, t = loss_mask.shape
    ok = torch.zeros(b, t, dtype=torch.bool, device=loss_mask.device)
    if t >= 3:
        ok[:, 1 : t - 1] = loss_mask[:, 2:] > 0
    m = max(1, min(n, int(ok.sum(1).max())))
    score = torch.rand(b, t, generator=generator, device="cpu").to(loss_mask.device)
    score = torch.where(ok, score, torch.full_like(score, -1.0))
    top = score.topk(m, dim=1)
    valid = top.values >= 0
    anchors = torch.where(valid, top.indices, torch.ones_like(top.indices))
    order = torch.where(valid, anchors, anchors.new_full(anchors.shape, t)).argsort(dim=1)
    return anchors.gather(1, order), valid.gather(1, order)


def block_alignment(anchors: torch.Tensor, block_size: int, first: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot positions a + k, label positions a + k - first), each [B, n, block_size]; `first` is the first
    drafting slot (heads.dflash.config.first_slot). The label position is also the position of the token
    before the predicted one (the Markov head's input).

    Worked examples, anchor 5, B = 4: slots at positions [5 6 7 8] (tokens x5, mask, mask, mask) predict
    x6, x7, x8 from the target's distributions at [_ 5 6 7] (slot 0 predicts nothing); with first = 0
    (sample_from_anchor) they predict x6, x7, x8, x9 from the distributions at [5 6 7 8]."""
    slots = anchors[..., None] + torch.arange(block_size, device=anchors.device)
    return slots, slots - first


def context_mask(anchors: torch.Tensor, block_size: int, context: int) -> torch.Tensor:
    """[B, 1, n*bs, context] bool: every slot of the block anchored at a sees the context positions < a.
    (Inside its own block a slot sees every slot, both ways, and no other block: heads.dflash.model's
    block_attention.)"""
    q_anchor = anchors.repeat_interleave(block_size, dim=1)  # [B, n*bs]
    return (torch.arange(context, device=anchors.device)[None, None, :] < q_anchor[..., None])[:, None]


def block_logits(head: DFlashHead, batch: dict, target: TargetIO, anchors: torch.Tensor) -> torch.Tensor:
    """Draft-vocab logits [B, n, block_size, DV] of the blocks anchored at `anchors` [B, n] (one pass; with a
    Markov head, each slot biased by the sequence's token at its label position)."""
    ids, aux = batch["input_ids"], batch["aux"]
    b, t = ids.shape
    n, bs = anchors.shape[1], head.block_size
    c = head.context(aux)
    ctx_kv = head.context_kv(c, torch.arange(t, device=ids.device).expand(b, t), target)
    before = None
    if head.anchor_proj is not None:  # the context feature at a - 1 (a >= 1: sample_anchors)
        before = c.gather(1, (anchors - 1)[..., None].expand(-1, -1, c.shape[-1]))
    emb = head.block_embeddings(ids.gather(1, anchors), target, before).reshape(b, n * bs, -1)
    slots, labels = block_alignment(anchors, bs, head.first_slot)
    h = head.block_states(emb, slots.reshape(b, n * bs), ctx_kv, context_mask(anchors, bs, t), target)
    prev = ids.gather(1, labels.clamp(0, t - 1).reshape(b, -1)) if head.sequential else None
    return head.slot_logits(h, prev, target, list(range(bs)) * n).float().reshape(b, n, bs, -1)


def block_loss(head: DFlashHead, batch: dict, target: TargetIO, anchors: torch.Tensor, valid: torch.Tensor,
               weights: list[float]) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss and metrics of the blocks at `anchors` (see the module docstring)."""
    ids, lmask = batch["input_ids"], batch["loss_mask"].float()
    b, t = ids.shape
    bs, first = head.block_size, head.first_slot
    slots, labels = block_alignment(anchors, bs, first)
    predicted = labels + 1
    inside = (predicted < t) & valid[..., None]
    lab = labels.clamp(0, t - 1).reshape(b, -1)
    draft_ids = head.draft_ids()
    with torch.no_grad():
        # the target's draft-vocab distribution once per position, then each slot's row: the blocks' label
        # positions overlap (every position is up to block_size slots' label), so not once per slot
        p = _draft_vocab_logits(target, batch["last"], draft_ids).softmax(-1)
        p = p.gather(1, lab[..., None].expand(-1, -1, p.shape[-1])).reshape(b, -1, bs, draft_ids.numel())
        t_arg = batch["target_argmax"].long().gather(1, lab).reshape(b, -1, bs)
        mask_tok = lmask.gather(1, predicted.clamp(max=t - 1).reshape(b, -1)).reshape(b, -1, bs) * inside
        mask_tok[..., :first] = 0  # DFlash's slot 0 holds the anchor: it predicts nothing
        mask = mask_tok * head.t2d[t_arg].float()
    logits = block_logits(head, batch, target, anchors)
    ce = -(p * logits.log_softmax(-1)).sum(-1)
    w = torch.tensor(weights, device=ce.device)
    total = (w * mask * ce).sum() / mask.sum().clamp(min=1.0)
    metrics: dict[str, float] = {}
    with torch.no_grad():
        hit = (draft_ids[logits.argmax(-1)] == t_arg).float() * mask_tok
        for k in range(first, bs):
            cnt = float(mask_tok[..., k].sum())
            metrics[f"top1/{k - first}"] = float(hit[..., k].sum()) / max(cnt, 1.0)
            metrics[f"n/{k - first}"] = cnt
        metrics.update(chain_metrics([hit[..., k] for k in range(first, bs)], mask_tok[..., first]))
    return total, metrics


def loss(head: DFlashHead, batch: dict, target: TargetIO) -> tuple[torch.Tensor, dict[str, float]]:
    """Training loss and metrics on a feature batch: `head.anchors` random anchors per sequence."""
    if not isinstance(head, DFlashHead):
        raise TypeError(f"heads.dflash.loss: not a DFlash head: {type(head).__name__}")
    if batch.get("aux") is None:
        raise ValueError("DFlash needs `aux` features (the captured layers)")
    anchors, valid = sample_anchors(batch["loss_mask"], head.anchors)
    return block_loss(head, batch, target, anchors, valid, head.weights)
