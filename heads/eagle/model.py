"""The EAGLE heads' modules: a re-implemented Llama decoder layer sized like the target, and the two heads.

Both heads are one Llama-style decoder layer sized like the target (attention heads, KV heads, head_dim,
MLP width and activation, RMSNorm eps; RoPE from the target's own rotary module), trained on frozen target
features, with the target's embedding (and, for EAGLE-1, its lm_head) used but never stored in the head.
The functions computed are in heads/eagle/__init__.py's docstring (SGLang/vLLM `LlamaForCausalLMEagle3` and
SafeAILab `cnets1`). The layer is re-implemented (not transformers' LlamaDecoderLayer) because training-time
test attends over per-step key sets (`ttt_attention`) and drafting over a tree mask (`masked_attention`).

    build(cfg, target) -> Eagle1Head | Eagle3Head   a fresh head; each has
        project(features) -> hidden    step-0 hidden input from the target's features
        rows(emb, hidden, cos, sin) -> (q, k, v, residual)    the layer up to attention
        layer.finish(attention, residual) -> o                 the layer after attention (PRE-norm output)
        logits(o, target[, pointer])                           over the head's vocab (EAGLE-3 with head.pointer:
                                                               log-probs of its mixture with a pointer)
        to_target_ids / to_target_probs                        head vocab -> target vocab

Tests: `.venv/bin/python -m pytest -q tests/test_eagle.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from heads.base import HeadConfig
from heads.eagle.config import Eagle1Config, Eagle3Config, feature_layers, resolved_draft_vocab
from heads.losses import check_token_loss
from heads.types import Features, TargetIO


# ----------------------------------------------------------------------------------------------- layers
class RMSNorm(nn.Module):
    """Llama RMSNorm (computed in float32, scaled by `weight`)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on x [B, heads, T, d] with cos/sin [B, T, d] (half-split rotation, as Llama)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


class Attention(nn.Module):
    """q/k/v/o projections (no bias) with grouped KV heads; the attention itself is done by the caller."""

    def __init__(self, in_dim: int, hidden: int, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(in_dim, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(in_dim, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(in_dim, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def qkv(self, u: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        b, t, _ = u.shape
        q = self.q_proj(u).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(u).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(u).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        return _rope(q, cos, sin), _rope(k, cos, sin), v

    def out(self, a: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = a.shape
        return self.o_proj(a.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int, act: str):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.act = ACT2FN[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def layer_sizes(config: Any) -> tuple[int, int, int, int, float]:
    """(hidden, attention heads, KV heads, head_dim, RMSNorm eps) of a draft layer sized like the target."""
    h = int(config.hidden_size)
    heads = int(config.num_attention_heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or h // heads)
    return h, heads, kv, head_dim, float(getattr(config, "rms_norm_eps", 1e-6))


class DecoderLayer(nn.Module):
    """One draft layer. `eagle3=True` adds hidden_norm/input_layernorm and a 2H attention input."""

    def __init__(self, config: Any, inter: int, eagle3: bool):
        super().__init__()
        h, heads, kv, head_dim, eps = layer_sizes(config)
        self.eagle3 = eagle3
        if eagle3:
            self.hidden_norm = RMSNorm(h, eps)
            self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = Attention(2 * h if eagle3 else h, h, heads, kv, head_dim)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = MLP(h, inter, getattr(config, "hidden_act", "silu"))

    def finish(self, attn: torch.Tensor, resid: torch.Tensor) -> torch.Tensor:
        """y = resid + o_proj(attn); o = y + mlp(post_attention_layernorm(y))."""
        y = resid + self.self_attn.out(attn)
        return y + self.mlp(self.post_attention_layernorm(y))


# ----------------------------------------------------------------------------------------------- attention
def ttt_attention(q: torch.Tensor, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> torch.Tensor:
    """Attention of TTT step s = len(keys) - 1 without materialising the (T x T(s+1)) mask.

    q [B, heads, T, d]; keys[j], values[j] [B, kv_heads, T, d] are step j's. Query t attends to step-0
    keys at t' <= t (causal) and to the keys of steps 1..s at index t only (one diagonal per extra step).
    Worked example, T = 4, s = 1, query index 0: keys {k^0_0, k^1_0}; query 2: {k^0_0, k^0_1, k^0_2, k^1_2}.
    Right padding needs no extra mask: real queries never see later (padded) keys.
    """
    b, heads, t, d = q.shape
    groups = heads // keys[0].shape[1]
    scale = d**-0.5
    scores = (q @ _repeat_kv(keys[0], groups).transpose(-1, -2)) * scale
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    diag = [(q * _repeat_kv(k, groups)).sum(-1, keepdim=True) * scale for k in keys[1:]]
    probs = torch.cat([scores, *diag], dim=-1).float().softmax(-1).to(q.dtype)
    out = probs[..., :t] @ _repeat_kv(values[0], groups)
    for j, v in enumerate(values[1:]):
        out = out + probs[..., t + j : t + j + 1] * _repeat_kv(v, groups)
    return out


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Drafting attention: q [1, heads, N, d] over k, v [1, kv_heads, M, d] where mask [N, M] (bool) allows."""
    groups = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, _repeat_kv(k, groups), _repeat_kv(v, groups), attn_mask=mask)


def rotary(target: TargetIO, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, T, head_dim] at `positions` [B, T] from the target's rotary module (its RoPE scaling)."""
    if target.rotary is None:
        raise ValueError(f"target '{target.name}' exposes no rotary embedding module; EAGLE heads need one")
    cos, sin = target.rotary(x, positions)
    return cos.to(x.dtype), sin.to(x.dtype)


# ----------------------------------------------------------------------------------------------- heads
class _EagleHead(nn.Module):
    """Shared by both heads. Each defines `layer`, `project(features)` (step-0 hidden input from target
    features), `rows(emb, hidden, cos, sin) -> (q, k, v, residual)` and `logits(o, target)`."""

    layer_ids: list[int]
    family: str  # "eagle1" | "eagle3" (the head holds no config; drafter_factory's messages name it)

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Head-vocab ids -> target ids (the identity unless the head has a draft vocab)."""
        return ids

    def to_target_probs(self, probs: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """A distribution over the head's vocab -> the same distribution over the target vocab."""
        return probs


class Eagle1Head(_EagleHead):
    family = "eagle1"

    def __init__(self, cfg: Eagle1Config, config: Any):
        super().__init__()
        h = int(config.hidden_size)
        self.layer_ids = []
        self.noise = cfg.noise
        self.feature_loss_weight, self.token_loss_weight = cfg.feature_loss_weight, cfg.token_loss_weight
        self.loss_kind, self.loss_tv_weight = cfg.loss, cfg.loss_tv_weight
        self.fc = nn.Linear(2 * h, h, bias=True)
        self.layers = nn.ModuleList([DecoderLayer(config, int(config.intermediate_size), eagle3=False)])

    @property
    def layer(self) -> DecoderLayer:
        return self.layers[0]

    def project(self, feats: Features) -> torch.Tensor:
        return feats.last.to(self.fc.weight.dtype)

    def rows(self, emb, hidden, cos, sin):
        h = self.fc(torch.cat([emb.to(hidden.dtype), hidden], dim=-1))
        q, k, v = self.layer.self_attn.qkv(h, cos, sin)
        return q, k, v, h

    def logits(self, o: torch.Tensor, target: TargetIO) -> torch.Tensor:
        # the target's own lm_head, in the target's dtype (the head may draft in another: eval.draft_dtype)
        return target.lm_head(o.to(target.lm_head.weight.dtype))


class Eagle3Head(_EagleHead):
    family = "eagle3"

    def __init__(self, cfg: Eagle3Config, config: Any, layer_ids: list[int]):
        super().__init__()
        h = int(config.hidden_size)
        vocab = int(config.vocab_size)
        draft_vocab = resolved_draft_vocab(cfg, vocab)
        self.layer_ids = list(layer_ids)
        self.ttt_length, self.ttt_decay = cfg.ttt_length, cfg.ttt_decay
        self.loss_kind, self.loss_tv_weight = cfg.loss, cfg.loss_tv_weight
        self.norm_before_residual = cfg.norm_before_residual
        self.fc = nn.Linear(len(layer_ids) * h, h, bias=False)
        self.midlayer = DecoderLayer(config, int(cfg.intermediate_size or config.intermediate_size), eagle3=True)
        self.norm = RMSNorm(h, float(getattr(config, "rms_norm_eps", 1e-6)))
        self.lm_head = nn.Linear(h, draft_vocab, bias=False)
        self.pointer = cfg.pointer
        if cfg.pointer:  # a pointer over the request's positions: query from the head's state, keys from the target's
            self.ptr_q = nn.Linear(h, h, bias=False)
            self.ptr_k = nn.Linear(h, h, bias=False)
            self.ptr_gate = nn.Linear(h, 1, bias=True)  # the pointer's share of the mixture, per position
        # Until `prepare` sets them from data: the first draft_vocab target ids.
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[:draft_vocab] = True
        self.register_buffer("t2d", t2d)

    @property
    def layer(self) -> DecoderLayer:
        return self.midlayer

    def project(self, feats: Features) -> torch.Tensor:
        if feats.aux is None:
            raise ValueError("EAGLE-3 needs `aux` features (the captured layers)")
        return self.fc(feats.aux.to(self.fc.weight.dtype))

    def rows(self, emb, hidden, cos, sin):
        m = self.midlayer
        normed = m.hidden_norm(hidden)
        u = torch.cat([m.input_layernorm(emb.to(hidden.dtype)), normed], dim=-1)
        q, k, v = m.self_attn.qkv(u, cos, sin)
        # norm_before_residual: the residual is the normalised state too, so neither the fused features nor
        # the fed-back PRE-norm output carries its scale into the next step (training and drafting both use rows)
        return q, k, v, normed if self.norm_before_residual else hidden

    def logits(self, o: torch.Tensor, target: TargetIO, pointer: tuple | None = None) -> torch.Tensor:
        """Logits over the draft vocab; with `pointer` (head.pointer: keys [.., N, H] from `pointer_keys`, ext [.., N]
        the extended-vocab index of the token after each key's position (broadcastable to the scores [.., Q, N]),
        size V + M, mask [.., Q, N] or None) the log-probs of (1 - g) softmax(logits) + g * pointer over V + M."""
        x = self.norm(o)
        out = self.lm_head(x)
        if pointer is None:
            return out
        keys, ext, size, mask = pointer
        pv = out.float().softmax(-1)
        g = torch.sigmoid(self.ptr_gate(x).float())
        scores = (self.ptr_q(x) @ keys.to(x.dtype).transpose(-1, -2)).float() * keys.shape[-1] ** -0.5
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        a = scores.softmax(-1)
        pc = a.new_zeros(*a.shape[:-1], size).scatter_add(-1, ext.expand_as(a), a) * g
        v = pv.shape[-1]
        return torch.cat([pc[..., :v] + (1 - g) * pv, pc[..., v:]], dim=-1).clamp_min(1e-30).log()

    def pointer_keys(self, last: torch.Tensor) -> torch.Tensor:
        """head.pointer: the pointer's key of each position from the target's last hidden state there."""
        return self.ptr_k(last.to(self.ptr_k.weight.dtype))

    def draft_ids(self) -> torch.Tensor:
        """Target id of every draft id: arange(draft_vocab) + d2t."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return ids + self.d2t[ids]

    def to_target_probs(self, probs: torch.Tensor, vocab_size: int) -> torch.Tensor:
        out = probs.new_zeros(*probs.shape[:-1], vocab_size)
        out[..., self.draft_ids()] = probs
        return out


def _init(module: nn.Module, std: float) -> None:
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


def build(cfg: HeadConfig, target: TargetIO) -> nn.Module:
    """A fresh EAGLE-1 or EAGLE-3 head for `target` (float32; the loop casts as configured)."""
    std = float(getattr(target.config, "initializer_range", 0.02))
    if cfg.family not in ("eagle1", "eagle3"):
        raise ValueError(f"heads.eagle cannot build family '{cfg.family}'")
    check_token_loss(cfg)
    if cfg.family == "eagle1":
        head: _EagleHead = Eagle1Head(cfg, target.config)
    else:
        if cfg.ttt_length < 1:
            raise ValueError(f"head.ttt_length {cfg.ttt_length}: must be >= 1")
        head = Eagle3Head(cfg, target.config, feature_layers(cfg, target.config))
    _init(head, std)
    if getattr(head, "pointer", False):
        with torch.no_grad():
            head.ptr_gate.bias.fill_(-2.0)  # the pointer starts with a small share (g = 0.12)
    return head
