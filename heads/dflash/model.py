"""The DFlash block drafter's modules: Qwen3-style draft layers over the target's fused context features.

The function (vLLM `qwen3_dflash.py` / z-lab `dflash/model.py` / speculators `DFlashDraftModel`, the layer
names theirs; the equations in heads/dflash/__init__.py's docstring):

    c_p = hidden_norm(fc(A_p))        A_p = the captured target layers at position p; once, for every layer
    per layer l: K/V of the context   k_norm(k_proj_l(c_p)), v_proj_l(c_p), RoPE at p   (no input_layernorm)
                 K/V of the block     k_norm(k_proj_l(x_i)), v_proj_l(x_i), x = input_layernorm(h)
                 queries              q_norm(q_proj_l(x_i)) (per-head RMSNorm, then RoPE)
    h <- h + o_proj(attn(q; context keys, block keys));  h <- h + mlp(post_attention_layernorm(h))
    logits = lm_head(norm(h))         lm_head: the target's rows of the draft vocab (trained: head.train_lm_head)
             (+ markov_head.markov_w2(markov_w1[the token before the drafted one]) with head.markov_rank:
             DSpark's transition bias, vLLM `qwen3_dspark.py`)
             (with head.prev_mlp, h first <- h + prev_mlp.down(silu(prev_mlp.up([prev_mlp.norm(h),
             prev_mlp.emb_norm(embed(the token before the drafted one))]))): Hydra's sequential dependence)
    with head.plain_first_slot, the first drafting slot's logits are lm_head(norm(h)) alone (no refinement, no bias)
    with head.anchor_feature, every slot's input is anchor_proj([its embedding, c_{a-1}]) (c at the position
             before the anchor; EAGLE-3's fc of its first step's [embedding, feature]): served by no engine's
             DFlash/DSpark layout

The Llama pieces are EAGLE's (heads/eagle/model.py: RMSNorm, Attention's projections, MLP, rotary); drafting's
attention (one block) is SDPA with grouped KV heads (enable_gqa), training's (many blocks side by side) is
`block_attention`; q_norm/k_norm are what the engines' Qwen3-style layer adds.

    build(cfg, target) -> DFlashHead
    prepare(cfg, dataset, target) -> {d2t, t2d, lm_head.weight, norm.weight}   draft vocab, target's rows
        context(aux) -> c                                           the fused context features
        context_kv(c, positions, target) -> [(k, v) per layer]     the context's keys/values
        block_embeddings(anchors, target, before=None) -> emb       [anchor, mask x (B-1)] (or anchor_proj([., before]))
        block_states(emb, positions, ctx_kv, ctx_mask, target) -> h    the blocks through every layer
        logits(h, prev=None, target=None)                          over the draft vocab (prev_mlp's refinement by
                                                                   prev's embedding, + Markov bias of prev):
            add_markov_bias(base_logits(refine(h, prev, target)), prev)
        slot_logits(h, prev, target, slots)                        each block slot's: `logits`, or base_logits alone
                                                                   for a plain one (head.plain_first_slot)
    block_attention(q, ctx, kb, vb, ctx_mask, block_size)   training's attention (context + each block's square)

Tests: `.venv/bin/python -m pytest -q tests/test_dflash.py`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from heads.base import HeadConfig
from heads.dflash.config import (
    DFlashConfig,
    check,
    feature_layers,
    first_slot,
    loss_weights,
    resolved_mask_token,
)
from heads.eagle.config import resolved_draft_vocab
from heads.eagle.model import (  # _rope: reused, not copied
    MLP,
    Attention,
    Eagle3Head,
    RMSNorm,
    _rope,
    layer_sizes,
    rotary,
)
from heads.eagle.vocab import draft_vocab_from_counts, final_norm_scale, token_counts
from heads.types import TargetIO


class DFlashAttention(Attention):
    """EAGLE's q/k/v/o projections plus the per-head q_norm/k_norm of the engines' Qwen3-style layer."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float):
        super().__init__(hidden, hidden, heads, kv_heads, head_dim)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)

    def _split(self, x: torch.Tensor, n: int) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, n, self.head_dim).transpose(1, 2)

    def query(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return _rope(self.q_norm(self._split(self.q_proj(x), self.heads)), cos, sin)

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = _rope(self.k_norm(self._split(self.k_proj(x), self.kv_heads)), cos, sin)
        return k, self._split(self.v_proj(x), self.kv_heads)


def block_attention(q: torch.Tensor, ctx: tuple[torch.Tensor, torch.Tensor], kb: torch.Tensor, vb: torch.Tensor,
                    ctx_mask: torch.Tensor, block_size: int) -> torch.Tensor:
    """Training's attention: n blocks of `block_size` queries, each over the context keys it may see and its
    own block's keys (both ways), in one softmax per query. q [B, heads, N, d] with N = n * block_size;
    ctx (k, v) [B, kv, T, d]; kb, vb [B, kv, N, d] (the blocks' own keys/values, block after block);
    ctx_mask [B, 1, N, T] bool (True = may attend). Returns [B, heads, N, d].

    Equal to SDPA over [context, all blocks] with the mask "context < anchor, or the same block", without
    scoring the N x N block-to-block square, of which only n squares of block_size^2 are kept: that is what
    lets a training step use every position of an answer as an anchor (speculators' and SpecForge's DFlash
    recipes sample up to 512 per sequence) at the cost of the context scores alone."""
    b, heads, n_q, d = q.shape
    kv = ctx[0].shape[1]
    g, n = heads // kv, n_q // block_size
    qg = q.reshape(b, kv, g, n_q, d) * d**-0.5  # query head i reads kv head i // g (SDPA's enable_gqa)
    s_ctx = (qg @ ctx[0][:, :, None].transpose(-1, -2)).masked_fill(~ctx_mask[:, :, None], float("-inf"))
    qb = qg.reshape(b, kv, g, n, block_size, d)
    s_blk = qb @ kb.reshape(b, kv, 1, n, block_size, d).transpose(-1, -2)  # [.., n, bs, bs]
    t = ctx[0].shape[2]
    att = torch.cat([s_ctx, s_blk.reshape(b, kv, g, n_q, block_size)], dim=-1).softmax(-1)
    out = att[..., :t] @ ctx[1][:, :, None]
    own = att[..., t:].reshape(b, kv, g, n, block_size, block_size) @ vb.reshape(b, kv, 1, n, block_size, d)
    return (out + own.reshape(b, kv, g, n_q, d)).reshape(b, heads, n_q, d)


class DFlashLayer(nn.Module):
    """One draft layer: pre-norm attention over [context keys, block keys], then the MLP."""

    def __init__(self, config: Any, inter: int):
        super().__init__()
        h, heads, kv, head_dim, eps = layer_sizes(config)
        self.self_attn = DFlashAttention(h, heads, kv, head_dim, eps)
        self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = MLP(h, inter, getattr(config, "hidden_act", "silu"))

    def forward(self, h: torch.Tensor, ctx: tuple[torch.Tensor, torch.Tensor], cos: torch.Tensor,
                sin: torch.Tensor, ctx_mask: torch.Tensor | None, block_size: int) -> torch.Tensor:
        """h [B, N, H] block states (N = n * block_size, block after block); ctx (k, v) [B, kv, T, d];
        ctx_mask [B, 1, N, T] (True = may attend; training, `block_attention`), or None: drafting's one block
        over the whole context, plain SDPA with no mask built or applied."""
        x = self.input_layernorm(h)
        attn = self.self_attn
        kb, vb = attn.key_value(x, cos, sin)
        q = attn.query(x, cos, sin)
        if ctx_mask is None:
            # grouped KV heads attended in place (enable_gqa), not repeated: the block pass is a few rows
            k, v = torch.cat([ctx[0], kb], dim=2), torch.cat([ctx[1], vb], dim=2)
            a = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        else:
            a = block_attention(q, ctx, kb, vb, ctx_mask, block_size)
        h = h + attn.out(a)
        return h + self.mlp(self.post_attention_layernorm(h))


class MarkovHead(nn.Module):
    """DSpark's low-rank transition bias: markov_w2(markov_w1[row]) over the draft vocab, row a token's
    (DFlashHead.markov_row: a target id, or with markov_rows draft its draft id)."""

    def __init__(self, rows: int, draft_vocab: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(rows, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab, bias=False)

    def forward(self, prev: torch.Tensor) -> torch.Tensor:
        return self.markov_w2(self.markov_w1(prev))


class PrevTokenMLP(nn.Module):
    """Hydra's sequential dependence (head.prev_mlp): h + down(silu(up([norm(h), emb_norm(e)]))) with e the target's
    embedding of the token before the drafted one; `down` starts at zero, so training starts from the state."""

    def __init__(self, hidden: int, width: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(hidden, eps)
        self.emb_norm = RMSNorm(hidden, eps)
        self.up = nn.Linear(2 * hidden, width, bias=False)
        self.down = nn.Linear(width, hidden, bias=False)

    def forward(self, h: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.norm(h), self.emb_norm(emb.to(h.dtype))], dim=-1)
        return h + self.down(F.silu(self.up(x)))


class DFlashHead(nn.Module):
    """fc, hidden_norm, layers.{l}, norm, lm_head (the target's rows, trained with head.train_lm_head) and the
    draft vocab maps d2t / t2d."""

    family = "dflash"
    # The draft-vocab maps are EAGLE-3's (same d2t/t2d convention): target id = draft id + d2t[draft id].
    draft_ids = Eagle3Head.draft_ids
    to_target_ids = Eagle3Head.to_target_ids
    to_target_probs = Eagle3Head.to_target_probs

    def __init__(self, cfg: DFlashConfig, config: Any, layer_ids: list[int]):
        super().__init__()
        h, vocab = int(config.hidden_size), int(config.vocab_size)
        draft_vocab = resolved_draft_vocab(cfg, vocab)
        eps = float(getattr(config, "rms_norm_eps", 1e-6))
        self.layer_ids = list(layer_ids)
        self.block_size, self.anchors = cfg.block_size, cfg.anchors
        self.first_slot = first_slot(cfg)  # slot i >= first_slot drafts x_{a + i + 1 - first_slot}
        self.weights = loss_weights(cfg)  # per block slot (heads.dflash.losses)
        self.mask_token_id = resolved_mask_token(cfg, vocab)
        self.fc = nn.Linear(len(layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, eps)
        inter = int(cfg.intermediate_size or config.intermediate_size)
        self.layers = nn.ModuleList([DFlashLayer(config, inter) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(h, eps)
        self.markov_rows = cfg.markov_rows
        self.plain_first_slot = cfg.plain_first_slot
        rows = draft_vocab + 1 if cfg.markov_rows == "draft" else vocab
        self.markov_head = MarkovHead(rows, draft_vocab, cfg.markov_rank) if cfg.markov_rank else None
        # [slot embedding, c_{a-1}] -> H, EAGLE-3's fc of its [embedding, feature]: held-out tau_sim 1.607 against
        # 1.586 for embedding + a projection of c_{a-1} alone (the same 340 steps and time; docs/results.md)
        self.anchor_proj = nn.Linear(2 * h, h, bias=False) if cfg.anchor_feature else None
        # Hydra's refinement by the previous token: held-out tau_sim 1.629 against 1.607 at the same 340 steps, the
        # later slots +0.02-0.03 (docs/experiments.md)
        self.prev_mlp = PrevTokenMLP(h, cfg.prev_mlp, eps) if cfg.prev_mlp else None
        # The target's LM head restricted to the draft vocab (`prepare` copies the rows): frozen unless
        # head.train_lm_head; stored so that an export carries exactly the rows drafted with.
        self.lm_head = nn.Linear(h, draft_vocab, bias=False).requires_grad_(cfg.train_lm_head)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[:draft_vocab] = True
        self.register_buffer("t2d", t2d)

    def context(self, aux: torch.Tensor) -> torch.Tensor:
        """The fused context features c = hidden_norm(fc(aux)) [B, T, H] of captured layers aux [B, T, n*H]."""
        return self.hidden_norm(self.fc(aux.to(self.fc.weight.dtype)))

    def context_kv(self, c: torch.Tensor, positions: torch.Tensor,
                   target: TargetIO) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's keys/values of the context features c [B, T, H] (`context`) at positions [B, T]."""
        cos, sin = rotary(target, c, positions)
        return [layer.self_attn.key_value(c, cos, sin) for layer in self.layers]

    def block_states(self, emb: torch.Tensor, positions: torch.Tensor, ctx_kv: list[tuple[torch.Tensor, torch.Tensor]],
                     ctx_mask: torch.Tensor | None, target: TargetIO) -> torch.Tensor:
        """The blocks' embeddings [B, N, H] (N = n * block_size) at positions [B, N] through every layer
        (pre-norm output); ctx_mask as DFlashLayer.forward's."""
        h = emb.to(self.fc.weight.dtype)
        cos, sin = rotary(target, h, positions)
        for layer, ctx in zip(self.layers, ctx_kv):
            h = layer(h, ctx, cos, sin, ctx_mask, self.block_size)
        return h

    @property
    def sequential(self) -> bool:
        """Whether a slot's logits depend on the token drawn before it (a Markov head or head.prev_mlp): then
        drafting draws the block's slots one by one (`logits` per slot), else all at once."""
        return self.markov_head is not None or self.prev_mlp is not None

    def logits(self, h: torch.Tensor, prev: torch.Tensor | None = None, target: TargetIO | None = None) -> torch.Tensor:
        """Draft-vocab logits of states h [..., H]: lm_head(norm(h)); with head.prev_mlp, of h refined by the
        target's embedding of prev [...] (the target id of the token before each drafted one) first; with a
        Markov head, plus its bias of prev. A sequential head (`sequential`) needs prev, and prev_mlp the target."""
        if not self.sequential:
            return self.base_logits(h)
        if prev is None:
            raise ValueError("DFlash head with a Markov head or prev_mlp: logits() needs the previous tokens")
        return self.add_markov_bias(self.base_logits(self.refine(h, prev, target)), prev)

    def plain(self, slot: int) -> bool:
        """Whether block slot `slot`'s logits are base_logits alone although the head is sequential: the first
        drafting slot with head.plain_first_slot (training and drafting both ask this)."""
        return self.plain_first_slot and slot == self.first_slot

    def slot_logits(self, h: torch.Tensor, prev: torch.Tensor | None, target: TargetIO | None,
                    slots: list[int]) -> torch.Tensor:
        """Logits [..., S, DV] of block slots `slots` (block indices, one per row of dim -2) with states h
        [..., S, H] and prev [..., S] (`logits`'s), each slot's as `plain` says: training's blocks and the
        drafter's block_logits. A plain slot's state skips the refinement and its logits the Markov bias; one
        LM head product serves every slot (training's blocks: no second product for the plain ones)."""
        plain = [self.plain(s) for s in slots]
        if all(plain) or not self.sequential:
            return self.base_logits(h)
        if not any(plain):
            return self.logits(h, prev, target)
        keep = torch.tensor(plain, device=h.device)[:, None]
        if prev is None:
            raise ValueError("DFlash head with a Markov head or prev_mlp: slot_logits() needs the previous tokens")
        out = self.base_logits(torch.where(keep, h, self.refine(h, prev, target)))
        return torch.where(keep, out, self.add_markov_bias(out, prev))

    def refine(self, h: torch.Tensor, prev: torch.Tensor, target: TargetIO | None) -> torch.Tensor:
        """States h [..., H] refined by the target's embedding of prev [...] (head.prev_mlp); h itself without."""
        if self.prev_mlp is None:
            return h
        if target is None:
            raise ValueError("DFlash head with head.prev_mlp: logits() needs the target (its embeddings)")
        with torch.no_grad():
            emb = target.embed(prev.to(next(target.embed.parameters()).device)).to(h.device)
        return self.prev_mlp(h, emb)

    def base_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits of states h [..., H] before any Markov bias: lm_head(norm(h))."""
        return self.lm_head(self.norm(h))

    def add_markov_bias(self, base: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """Logits base [..., DV] plus the Markov head's bias of prev [...] (base itself without a Markov head)."""
        if self.markov_head is None:
            return base
        return base + self.markov_head(self.markov_row(prev.to(base.device))).to(base.dtype)

    def markov_row(self, ids: torch.Tensor) -> torch.Tensor:
        """The Markov table's row of each target id: the id itself (markov_rows target); with markov_rows draft,
        its draft id (draft ids are in target-id order, so a binary search of draft_ids: drafting calls this
        once per slot, where a cumsum over the target vocab cost 47 us a call) or, outside the draft vocab, the
        last row."""
        if self.markov_rows == "target":
            return ids
        return torch.where(self.t2d[ids], torch.searchsorted(self.draft_ids(), ids), self.d2t.numel())

    def block_embeddings(self, anchors: torch.Tensor, target: TargetIO,
                         before: torch.Tensor | None = None) -> torch.Tensor:
        """[anchor, mask x (B-1)] embedded by the target, per anchor token id: [*anchors.shape, B, H]; with
        head.anchor_feature, each slot's anchor_proj([its embedding, before]) instead, before [*anchors.shape, H]
        the context feature (`context`) at the position before each anchor, which must then be given."""
        dev = next(target.embed.parameters()).device
        if self.anchor_proj is None:
            ids = torch.full((*anchors.shape, self.block_size), self.mask_token_id, dtype=torch.long,
                             device=anchors.device)
            ids[..., 0] = anchors
            with torch.no_grad():
                return target.embed(ids.to(dev)).to(self.fc.weight.device)
        if before is None:
            raise ValueError("DFlash head with head.anchor_feature: block_embeddings() needs the anchors' context")
        # anchor_proj([e, c]) = W_e e + W_c c, each term computed once: W_c c once per block (every slot has the
        # same c), W_e e once per anchor and once for the mask token (every mask slot is alike): a third of the
        # concatenated projection's rows, the same function
        with torch.no_grad():
            emb = target.embed(torch.cat([anchors.reshape(-1), anchors.new_tensor([self.mask_token_id])]).to(dev))
        w_e, w_c = self.anchor_proj.weight.split(emb.shape[-1], dim=1)
        e = F.linear(emb.to(w_e), w_e)
        slots = torch.cat([e[:-1].reshape(*anchors.shape, 1, -1),
                           e[-1].expand(*anchors.shape, self.block_size - 1, e.shape[-1])], dim=-2)
        return slots + F.linear(before.to(w_c), w_c)[..., None, :]


def _init(module: nn.Module, std: float) -> None:
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=std)
    markov = getattr(module, "markov_head", None)
    if markov is not None:  # the bias starts at zero: training starts from plain DFlash's logits
        nn.init.zeros_(markov.markov_w2.weight)
    refine = getattr(module, "prev_mlp", None)
    if refine is not None:  # the refinement starts at zero: training starts from the state itself
        nn.init.zeros_(refine.down.weight)


def build(cfg: HeadConfig, target: TargetIO) -> DFlashHead:
    """A fresh DFlash head for `target` (float32; the loop casts as configured)."""
    if cfg.family != "dflash":
        raise ValueError(f"heads.dflash cannot build family '{cfg.family}'")
    check(cfg, target.vocab_size)
    head = DFlashHead(cfg, target.config, feature_layers(cfg, target.config))
    _init(head, float(getattr(target.config, "initializer_range", 0.02)))
    return head


def prepare(cfg: HeadConfig, dataset: Any, target: TargetIO) -> dict[str, torch.Tensor]:
    """The data-derived head tensors: EAGLE-3's draft vocabulary (`d2t`/`t2d`, the most frequent loss-masked
    training tokens), `lm_head.weight` = the target's lm_head rows of those ids (frozen from then on, unless
    head.train_lm_head) and `norm.weight` = the target's final-norm scale (trainable)."""
    n = resolved_draft_vocab(cfg, target.vocab_size)
    d2t, t2d = draft_vocab_from_counts(token_counts(dataset, target.vocab_size), n)
    out = {"d2t": d2t, "t2d": t2d}
    weight = getattr(target.lm_head, "weight", None)
    if weight is not None and tuple(weight.shape) == (target.vocab_size, target.hidden_size):
        out["lm_head.weight"] = weight.detach().float().cpu()[torch.arange(n) + d2t]
    scale = final_norm_scale(target)
    if scale is not None:  # so that the draft's logits start as the target's own on the same hidden state
        out["norm.weight"] = scale
    return out
