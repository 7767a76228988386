"""EAGLE heads: EAGLE-1 (feature regression) and EAGLE-3 (fused low/mid/high features, training-time test).

Both heads are one Llama-style decoder layer sized like the target (attention heads, KV heads, head_dim,
MLP width and activation, RMSNorm eps; RoPE from the target's own rotary module), trained on frozen target
features, with the target's embedding (and, for EAGLE-1, its lm_head) used but never stored in the head.
The functions computed are the ones in the project's format notes (SGLang/vLLM `LlamaForCausalLMEagle3`
and SafeAILab `cnets1`):

EAGLE-1 (`Eagle1Head`, parameters `fc`, `layers.0.*`):
    h = fc(cat(emb(x_{t+1}), f_t))                   f_t = target last hidden AFTER its final norm; fc has a bias
    y = h + o_proj(attn(h));  o = y + mlp(post_attention_layernorm(y))      (no input_layernorm, no final norm)
    o predicts f_{t+1}; logits = target.lm_head(o) predict x_{t+2}
    loss = 1.0 * SmoothL1(o, f_{t+1}) + 0.1 * CE(softmax(target.lm_head(f_{t+1})), log_softmax(target.lm_head(o)))
    with U(-noise/2, noise/2) added to f_t during training (the EAGLE paper's U(-0.1, 0.1) at noise 0.2).

EAGLE-3 (`Eagle3Head`, parameters named like SGLang's layout: `fc`, `midlayer.*`, `norm`, `lm_head`, buffers
`d2t`, `t2d`):
    g = fc(A_t)   A_t = cat(hidden_states[i] for the layer ids), ascending; no bias; step 0 only
    u = cat(input_layernorm(emb(x)), hidden_norm(g));   y = g + o_proj(attn(u));   o = y + mlp(post_ln(y))
    logits_draft = lm_head(norm(o)) over the draft vocab; target_id = draft_id + d2t[draft_id]
    next step's hidden = o (PRE-norm)
  Training-time test, step s at index t (s = 0 .. ttt_length-1), see `step_alignment` for a worked example:
    token x_{t+1+s}, hidden fc(A_t) at s = 0 else o^{s-1}_t, RoPE position t+s,
    keys: step-0 keys at t' <= t (causal) plus the keys of steps 1..s at the same index t (`ttt_attention`),
    target: draft-vocab softmax of the target's logits at t+1+s (they predict x_{t+2+s}),
    mask: loss_mask[t+2+s] (the project convention: predicting token j uses loss_mask[j]; SpecForge's
    `loss_mask[t+s]` is the same rule under its own, shifted, mask) times t2d[argmax of those logits],
    loss_s = -sum(mask * sum_v p log q) / (B*T);  loss = sum_s ttt_decay**s * loss_s.
  Metrics: `top1/s` = share of loss-masked positions (target argmax outside the draft vocab counted as
  misses) where the draft's argmax equals the target's argmax at step s; `n/s` their count.

Draft vocabulary (`prepare`): the N most frequent tokens among loss-masked training tokens (ties: lower id
first), sorted by id; `d2t[i] = id_i - i`, `t2d[id] = True` for chosen ids (vLLM/SGLang convention).

Drafting (`drafter`): chains, or EAGLE-2 dynamic trees (`tree="dynamic"`, `top_k`, `total_tokens`), with
the head's own KV cache rolled back to the accepted path on every commit. Run the unit tests with
`.venv/bin/python -m pytest -q tests/test_eagle.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from heads.base import DraftTree, Features, HeadConfig, TargetIO

DEFAULT_DRAFT_VOCAB = 32000


@dataclass
class Eagle1Config(HeadConfig):
    family: str = "eagle1"
    noise: float = 0.2  # width of the uniform input-feature noise: U(-noise/2, noise/2) (EAGLE: U(-0.1, 0.1))
    feature_loss_weight: float = 1.0  # SmoothL1 on the predicted feature
    token_loss_weight: float = 0.1  # cross-entropy of the target's lm_head on the predicted feature


@dataclass
class Eagle3Config(HeadConfig):
    family: str = "eagle3"
    layer_ids: list[int] | None = None  # hidden_states indices; null = [2, L//2, L-3] (EAGLE/SpecForge)
    draft_vocab_size: int | None = None  # null = min(32000, target vocab)
    ttt_length: int = 7  # training-time-test unroll steps
    ttt_decay: float = 0.8  # step s weighted decay**s
    intermediate_size: int | None = None  # draft MLP width; null = the target's


CONFIGS = {"eagle1": Eagle1Config, "eagle3": Eagle3Config}


# ----------------------------------------------------------------------------------------------- config
def default_layer_ids(num_layers: int) -> list[int]:
    """[2, L//2, L-3] (decoder layers 1, L/2-1, L-4 as outputs); [1, L//2, L-1] where those collide (L < 7)."""
    for ids in ([2, num_layers // 2, num_layers - 3], [1, num_layers // 2, num_layers - 1]):
        if ids == sorted(set(ids)) and ids[0] >= 0 and ids[-1] < num_layers:
            return ids
    raise ValueError(f"head.layer_ids: no default for a target with {num_layers} layers; set them explicitly")


def feature_layers(cfg: HeadConfig, target_config: Any) -> list[int]:
    """hidden_states indices the head reads as `aux`: none for EAGLE-1 (it reads `last`), three for EAGLE-3."""
    if cfg.family == "eagle1":
        return []
    n = int(target_config.num_hidden_layers)
    ids = list(cfg.layer_ids) if cfg.layer_ids is not None else default_layer_ids(n)
    if not ids or ids != sorted(set(ids)) or ids[0] < 0 or ids[-1] >= n:
        raise ValueError(f"head.layer_ids {ids}: must be ascending, distinct, within 0..{n - 1} for this target")
    return ids


def resolved_draft_vocab(cfg: Eagle3Config, vocab_size: int) -> int:
    n = cfg.draft_vocab_size if cfg.draft_vocab_size is not None else min(DEFAULT_DRAFT_VOCAB, vocab_size)
    if not 0 < n <= vocab_size:
        raise ValueError(f"head.draft_vocab_size {n}: must be in 1..{vocab_size} (the target vocab)")
    return n


# ----------------------------------------------------------------------------------------------- shifts
def shift_left(x: torch.Tensor, n: int) -> torch.Tensor:
    """`x` moved left by n positions along dim 1 (time), the last n positions zero-filled.

    Worked example: tokens [A0 A1 A2 A3], n = 2 -> [A2 A3 0 0]. n = 0 returns x; n >= T gives all zeros.
    Negative shifts raise (nothing in the heads looks backwards).
    """
    if n < 0:
        raise ValueError(f"shift_left: shift {n} must be >= 0")
    if n == 0:
        return x
    out = torch.zeros_like(x)
    if n < x.shape[1]:
        out[:, : x.shape[1] - n] = x[:, n:]
    return out


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


class DecoderLayer(nn.Module):
    """One draft layer. `eagle3=True` adds hidden_norm/input_layernorm and a 2H attention input."""

    def __init__(self, config: Any, inter: int, eagle3: bool):
        super().__init__()
        h = int(config.hidden_size)
        heads = int(config.num_attention_heads)
        kv = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(config, "head_dim", None) or h // heads)
        eps = float(getattr(config, "rms_norm_eps", 1e-6))
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

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Head-vocab ids -> target ids (the identity unless the head has a draft vocab)."""
        return ids

    def to_target_probs(self, probs: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """A distribution over the head's vocab -> the same distribution over the target vocab."""
        return probs


class Eagle1Head(_EagleHead):
    def __init__(self, cfg: Eagle1Config, config: Any):
        super().__init__()
        h = int(config.hidden_size)
        self.layer_ids = []
        self.noise = cfg.noise
        self.feature_loss_weight, self.token_loss_weight = cfg.feature_loss_weight, cfg.token_loss_weight
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
        return target.lm_head(o)


class Eagle3Head(_EagleHead):
    def __init__(self, cfg: Eagle3Config, config: Any, layer_ids: list[int]):
        super().__init__()
        h = int(config.hidden_size)
        vocab = int(config.vocab_size)
        draft_vocab = resolved_draft_vocab(cfg, vocab)
        self.layer_ids = list(layer_ids)
        self.ttt_length, self.ttt_decay = cfg.ttt_length, cfg.ttt_decay
        self.fc = nn.Linear(len(layer_ids) * h, h, bias=False)
        self.midlayer = DecoderLayer(config, int(cfg.intermediate_size or config.intermediate_size), eagle3=True)
        self.norm = RMSNorm(h, float(getattr(config, "rms_norm_eps", 1e-6)))
        self.lm_head = nn.Linear(h, draft_vocab, bias=False)
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
        u = torch.cat([m.input_layernorm(emb.to(hidden.dtype)), m.hidden_norm(hidden)], dim=-1)
        q, k, v = m.self_attn.qkv(u, cos, sin)
        return q, k, v, hidden

    def logits(self, o: torch.Tensor, target: TargetIO) -> torch.Tensor:
        return self.lm_head(self.norm(o))

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
    if cfg.family == "eagle1":
        head: _EagleHead = Eagle1Head(cfg, target.config)
    elif cfg.family == "eagle3":
        if cfg.ttt_length < 1:
            raise ValueError(f"head.ttt_length {cfg.ttt_length}: must be >= 1")
        head = Eagle3Head(cfg, target.config, feature_layers(cfg, target.config))
    else:
        raise ValueError(f"heads.eagle cannot build family '{cfg.family}'")
    _init(head, std)
    return head


# ----------------------------------------------------------------------------------------------- draft vocab
def draft_vocab_from_counts(counts: np.ndarray, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) for the n most frequent ids of `counts` (ties: lower id first), draft ids sorted by target id.

    Worked example: counts [5, 0, 9, 9, 1], n = 3 -> chosen ids [0, 2, 3], d2t [0, 1, 1], t2d [T F T T F].
    Refuses n larger than the number of ids seen at least once.
    """
    seen = int((counts > 0).sum())
    if n > seen:
        raise ValueError(
            f"head.draft_vocab_size {n} is larger than the {seen} distinct tokens in the loss-masked "
            f"training data; set head.draft_vocab_size <= {seen} or train on more data"
        )
    order = np.argsort(-counts, kind="stable")[:n]
    ids = torch.as_tensor(np.sort(order), dtype=torch.long)
    d2t = ids - torch.arange(n)
    t2d = torch.zeros(len(counts), dtype=torch.bool)
    t2d[ids] = True
    return d2t, t2d


def token_counts(dataset: Any, vocab_size: int) -> np.ndarray:
    """How often each target id appears at loss-masked positions of a tokenized dataset."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for start in range(0, len(dataset), 1024):
        rows = dataset[start : start + 1024]
        ids = np.concatenate([np.asarray(r, dtype=np.int64) for r in rows["input_ids"]])
        mask = np.concatenate([np.asarray(r, dtype=bool) for r in rows["loss_mask"]])
        counts += np.bincount(ids[mask], minlength=vocab_size)[:vocab_size]
    return counts


def prepare(cfg: HeadConfig, dataset: Any, target: TargetIO) -> dict[str, torch.Tensor]:
    """Initial values for head tensors that come from data and the target (the loop loads them after build).

    EAGLE-3: `d2t`/`t2d` from the loss-masked training tokens, and `lm_head.weight` initialised from the
    target's lm_head rows of the draft vocab with the target's final-norm scale folded in (so that with
    norm.weight = 1 the draft's logits start as the target's own on the same hidden state).
    EAGLE-1 has nothing data-derived.
    """
    if cfg.family != "eagle3":
        return {}
    n = resolved_draft_vocab(cfg, target.vocab_size)
    d2t, t2d = draft_vocab_from_counts(token_counts(dataset, target.vocab_size), n)
    out = {"d2t": d2t, "t2d": t2d}
    weight = getattr(target.lm_head, "weight", None)
    if weight is not None and tuple(weight.shape) == (target.vocab_size, target.hidden_size):
        rows = weight.detach().float().cpu()[torch.arange(n) + d2t]
        if target.norm is not None and getattr(target.norm, "bias", None) is None:
            with torch.no_grad():
                p = next(target.norm.parameters(), None)
                ones = torch.ones(1, target.hidden_size, dtype=p.dtype if p is not None else torch.float32,
                                  device=p.device if p is not None else "cpu")
                scale = target.norm(ones).float().cpu().reshape(-1)
            rows = rows * scale[None, :]
        out["lm_head.weight"] = rows
    return out


# ----------------------------------------------------------------------------------------------- losses
def _positions(b: int, t: int, offset: int, device: torch.device) -> torch.Tensor:
    return (torch.arange(t, device=device) + offset).expand(b, t)


def loss(head: nn.Module, batch: dict, target: TargetIO) -> tuple[torch.Tensor, dict[str, float]]:
    """Training loss and metrics of an EAGLE head on a feature batch (see the module docstring)."""
    if isinstance(head, Eagle3Head):
        return _loss_eagle3(head, batch, target)
    if isinstance(head, Eagle1Head):
        return _loss_eagle1(head, batch, target)
    raise TypeError(f"heads.eagle.loss: not an EAGLE head: {type(head).__name__}")


def _target_logits(target: TargetIO, last: torch.Tensor) -> torch.Tensor:
    w = next(target.lm_head.parameters())
    return target.lm_head(last.to(w.dtype)).float()


def _loss_eagle3(head: Eagle3Head, batch: dict, target: TargetIO) -> tuple[torch.Tensor, dict[str, float]]:
    ids, lmask = batch["input_ids"], batch["loss_mask"].float()
    b, t = ids.shape
    draft_ids = head.draft_ids()
    with torch.no_grad():
        tl = _target_logits(target, batch["last"])
        t_arg = tl.argmax(-1)  # target's greedy token after each position
        p = tl[..., draft_ids].softmax(-1)  # the target's distribution restricted to the draft vocab
        in_vocab = head.t2d[t_arg].float()
        del tl
    hidden = head.project(Features(last=batch["last"], aux=batch["aux"]))
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    total = hidden.new_zeros((), dtype=torch.float32)
    metrics: dict[str, float] = {}
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
        step_loss = -(mask * (p_s * logits.log_softmax(-1)).sum(-1)).sum() / (b * t)
        total = total + head.ttt_decay**s * step_loss
        with torch.no_grad():
            hit = (draft_ids[logits.argmax(-1)] == arg_s).float() * mask_tok
            n = float(mask_tok.sum())
            metrics[f"loss/{s}"] = float(step_loss.detach())
            metrics[f"top1/{s}"] = float(hit.sum()) / max(n, 1.0)
            metrics[f"n/{s}"] = n
        hidden = o  # the next step reads this step's PRE-norm output
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
    ce = -(mask * (p * logits.log_softmax(-1)).sum(-1)).sum() / denom
    total = head.feature_loss_weight * feat + head.token_loss_weight * ce
    n = float(mask.sum())
    hit = (logits.argmax(-1) == t_arg).float() * mask
    metrics = {"loss/feature": float(feat.detach()), "loss/token": float(ce.detach()), "top1/0": float(hit.sum()) / max(n, 1.0), "n/0": n}
    return total, metrics


# ----------------------------------------------------------------------------------------------- drafting
class EagleDrafter:
    """The decoder's adapter (heads.base.Drafter) for an EAGLE-1 or EAGLE-3 head.

    State: the head's own KV cache over committed rows (row p pairs emb(x_{p+1}) with the target features
    at p, RoPE position p) and the output o / logits of the last committed row, which drafts the root's
    children. A draft row at tree depth d sits at position n-1+d (n committed rows), reads its token and
    its parent's PRE-norm output o, and attends to the whole cache plus its ancestors' draft rows: the
    same keys training-time test uses. Draft rows are never kept: `commit` drops them and recomputes the
    accepted rows from the target's real features (the rollback).

    tree="chain": one child per depth (argmax at temperature 0, else a sample of q; probs given, "iid").
    tree="dynamic" (EAGLE-2): at each depth expand the `top_k` best nodes by cumulative draft log-prob,
    each proposing its `top_k` best children; finally keep the `total_tokens` best nodes of all depths
    (ancestor-closed because a child never scores above its parent). Children are deterministic top-k, so
    the tree is marked sampling="topk" with q at the parent when temperature > 0.
    """

    def __init__(self, head: nn.Module, target: TargetIO, tree: str = "chain", top_k: int = 10,
                 total_tokens: int = 60, depth: int | None = None, generator: torch.Generator | None = None):
        if tree not in ("chain", "dynamic"):
            raise ValueError(f"EAGLE drafter: tree '{tree}' is not one of chain, dynamic")
        if top_k < 1 or total_tokens < 1:
            raise ValueError(f"EAGLE drafter: top_k ({top_k}) and total_tokens ({total_tokens}) must be >= 1")
        self.head, self.target = head.eval(), target
        self.capture_layers: tuple[int, ...] | None = tuple(head.layer_ids)
        self.tree, self.top_k, self.total_tokens, self.depth = tree, top_k, total_tokens, depth
        self.generator = generator
        p = next(head.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.cache_k: torch.Tensor | None = None
        self.cache_v: torch.Tensor | None = None
        self.n = 0
        self.last_o: torch.Tensor | None = None
        self.last_logits: torch.Tensor | None = None
        self.tree_tokens: list[int] = []

    # -- rows
    def _rows(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, ctx_k: torch.Tensor | None,
              ctx_v: torch.Tensor | None, ctx_mask: torch.Tensor, self_mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        emb_dev = next(self.target.embed.parameters()).device
        emb = self.target.embed(tokens[None].to(emb_dev)).to(self.device)
        cos, sin = rotary(self.target, hidden, positions[None].to(self.device))
        q, k, v, resid = self.head.rows(emb, hidden, cos, sin)
        keys = k if ctx_k is None else torch.cat([ctx_k, k], dim=2)
        vals = v if ctx_v is None else torch.cat([ctx_v, v], dim=2)
        mask = torch.cat([ctx_mask, self_mask], dim=1).to(self.device)
        o = self.head.layer.finish(masked_attention(q, keys, vals, mask), resid)
        return o, k, v

    def _logits(self, o: torch.Tensor) -> torch.Tensor:
        return self.head.logits(o, self.target).float()

    def _extend(self, tokens: list[int], features: Features | None) -> None:
        m = len(tokens)
        if features is None or features.last.shape[1] != m:
            got = None if features is None else features.last.shape[1]
            raise ValueError(f"EAGLE drafter: expected features for {m} positions, got {got}")
        feats = Features(last=features.last.to(self.device),
                         aux=None if features.aux is None else features.aux.to(self.device))
        hidden = self.head.project(feats)
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        pos = torch.arange(self.n, self.n + m, device=self.device)
        ctx_mask = torch.ones(m, self.n, dtype=torch.bool)
        causal = torch.ones(m, m, dtype=torch.bool).tril()
        o, k, v = self._rows(ids, hidden, pos, self.cache_k, self.cache_v, ctx_mask, causal)
        self.cache_k = k if self.cache_k is None else torch.cat([self.cache_k, k], dim=2)
        self.cache_v = v if self.cache_v is None else torch.cat([self.cache_v, v], dim=2)
        self.n += m
        self.last_o = o[:, -1:]
        self.last_logits = self._logits(self.last_o)[0, 0]

    # -- protocol
    @torch.no_grad()
    def begin(self, prompt_ids: torch.Tensor, features: Features | None, next_token: int) -> None:
        self.cache_k = self.cache_v = None
        self.n = 0
        self.tree_tokens = []
        ids = prompt_ids.reshape(-1).tolist()
        self._extend(ids[1:] + [int(next_token)], features)

    def commit(self, accepted: list[int], features: Features | None, next_token: int) -> None:
        self.commit_tokens([self.tree_tokens[i] for i in accepted], features, next_token)

    @torch.no_grad()
    def commit_tokens(self, tokens: list[int], features: Features | None, next_token: int) -> None:
        # Draft rows are never kept, so any path is committed alike: its rows come from the target's features.
        self.tree_tokens = []
        self._extend([int(t) for t in tokens] + [int(next_token)], features)

    def _pick(self, logits: torch.Tensor, temperature: float) -> tuple[int, torch.Tensor | None]:
        if temperature <= 0:
            return int(logits.argmax()), None
        q = torch.softmax(logits / temperature, dim=-1)
        return int(torch.multinomial(q.cpu(), 1, generator=self.generator)), q

    @torch.no_grad()
    def draft(self, k: int, temperature: float) -> DraftTree:
        if self.last_logits is None:
            raise RuntimeError("EAGLE drafter: draft() before begin()")
        depth = min(k, self.depth) if self.depth else k
        if depth <= 0:
            self.tree_tokens = []
            return DraftTree.chain(torch.empty(0, dtype=torch.long, device=self.device))
        if self.tree == "dynamic":
            return self._draft_dynamic(depth, temperature)
        return self._draft_chain(depth, temperature)

    def _draft_chain(self, k: int, temperature: float) -> DraftTree:
        vocab = self.target.vocab_size
        logits, hidden = self.last_logits, self.last_o
        ks: list[torch.Tensor] = []
        vs: list[torch.Tensor] = []
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        for j in range(k):
            tok_h, q = self._pick(logits, temperature)
            tok = int(self.head.to_target_ids(torch.tensor(tok_h, device=self.device)))
            tokens.append(tok)
            if q is not None:
                probs.append(self.head.to_target_probs(q, vocab))
            if j == k - 1:
                break
            ctx_k = torch.cat([self.cache_k, *ks], dim=2)
            ctx_v = torch.cat([self.cache_v, *vs], dim=2)
            ctx_mask = torch.ones(1, self.n + j, dtype=torch.bool)
            pos = torch.tensor([self.n + j])  # d_{j+1} sits at depth j+1, position n-1+(j+1)
            hidden, kk, vv = self._rows(torch.tensor([tok], device=self.device), hidden, pos, ctx_k, ctx_v,
                                        ctx_mask, torch.ones(1, 1, dtype=torch.bool))
            ks.append(kk)
            vs.append(vv)
            logits = self._logits(hidden)[0, 0]
        self.tree_tokens = tokens
        t = torch.tensor(tokens, dtype=torch.long, device=self.device)
        return DraftTree.chain(t, torch.stack(probs) if probs else None)

    def _draft_dynamic(self, depth: int, temperature: float) -> DraftTree:
        vocab = self.target.vocab_size
        top_k = min(self.top_k, self.last_logits.numel())
        # Pool of candidate nodes: head-vocab token, parent node (-1 = root), cumulative log-prob, depth.
        tok_h: list[int] = []
        parent: list[int] = []
        score: list[float] = []
        node_depth: list[int] = []
        q_of_parent: list[int] = []  # index into qs: the distribution a node was drawn from
        qs: list[torch.Tensor] = []
        row_of: dict[int, int] = {}  # expanded node -> its draft row
        row_o: list[torch.Tensor] = []
        row_k: list[torch.Tensor] = []
        row_v: list[torch.Tensor] = []
        row_anc: list[list[int]] = []  # draft rows each row attends to (its ancestors' and its own)

        def add_children(logits: torch.Tensor, par: int, base: float, d: int) -> list[int]:
            if temperature > 0:
                qs.append(torch.softmax(logits / temperature, dim=-1))
            lp = logits.log_softmax(-1)
            top = lp.topk(top_k)
            new = []
            for val, idx in zip(top.values.tolist(), top.indices.tolist()):
                new.append(len(tok_h))
                tok_h.append(idx)
                parent.append(par)
                score.append(base + val)
                node_depth.append(d)
                q_of_parent.append(len(qs) - 1)
            return new

        frontier = add_children(self.last_logits, -1, 0.0, 1)
        for d in range(2, depth + 1):
            expand = sorted(frontier, key=lambda i: -score[i])[:top_k]
            m = len(expand)
            toks = self.head.to_target_ids(torch.tensor([tok_h[i] for i in expand], device=self.device))
            hidden = torch.cat([self.last_o if parent[i] < 0 else row_o[row_of[parent[i]]] for i in expand], dim=1)
            pos = torch.tensor([self.n - 1 + d] * m)
            n_rows = len(row_o)
            anc = torch.zeros(m, n_rows, dtype=torch.bool)
            for r, i in enumerate(expand):
                if parent[i] >= 0:
                    anc[r, row_anc[row_of[parent[i]]]] = True
            ctx_k = torch.cat([self.cache_k, *row_k], dim=2)
            ctx_v = torch.cat([self.cache_v, *row_v], dim=2)
            ctx_mask = torch.cat([torch.ones(m, self.n, dtype=torch.bool), anc], dim=1)
            o, kk, vv = self._rows(toks, hidden, pos, ctx_k, ctx_v, ctx_mask, torch.eye(m, dtype=torch.bool))
            logits = self._logits(o)[0]
            frontier = []
            for r, i in enumerate(expand):
                row_of[i] = n_rows + r
                row_o.append(o[:, r : r + 1])
                row_k.append(kk[:, :, r : r + 1])
                row_v.append(vv[:, :, r : r + 1])
                row_anc.append(anc[r].nonzero().reshape(-1).tolist() + [n_rows + r])
                frontier += add_children(logits[r], i, score[i], d)
        # A child never scores above its parent (log-probs <= 0); ties go to the shallower node, so the
        # best `total_tokens` nodes always include their ancestors.
        chosen = sorted(range(len(tok_h)), key=lambda i: (-score[i], node_depth[i], i))[: self.total_tokens]
        chosen.sort(key=lambda i: (node_depth[i], i))
        new_index = {node: j for j, node in enumerate(chosen)}
        parents = [-1 if parent[i] < 0 else new_index[parent[i]] for i in chosen]
        tokens = self.head.to_target_ids(torch.tensor([tok_h[i] for i in chosen], device=self.device))
        self.tree_tokens = tokens.tolist()
        probs = None
        if temperature > 0:
            probs = self.head.to_target_probs(torch.stack([qs[q_of_parent[i]] for i in chosen]), vocab)
        return DraftTree(tokens=tokens, parents=torch.tensor(parents, dtype=torch.long, device=self.device),
                         probs=probs, sampling="topk")


def drafter(head: nn.Module, target: TargetIO, **kw: Any) -> EagleDrafter:
    """The decoder adapter: tree="chain" | "dynamic", top_k, total_tokens, depth, generator (see EagleDrafter)."""
    return EagleDrafter(head, target, **kw)
