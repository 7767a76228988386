"""DeepSeek-V3-style MTP modules: enorm/hnorm, eh_proj (2H -> H), one target-architecture block, own norm.

Step k (1-based) at position t combines the embedding of token t+k with the previous step's hidden state
at t and predicts token t+1+k (convert/formats/README.md, "MTP"; vLLM's deepseek_mtp forward):

    e   = embed(x[t+k])                      (the target's frozen embedding; zero at position 0, as vLLM)
    u   = eh_proj(cat(enorm(e), hnorm(h)))   (no bias, embedding first)
    o   = block(u)                           (one decoder block of the target's class, residuals included)
    logits = lm_head(norm(o))                (the target's frozen lm_head; `norm` is the module's own)

with h = `last` (the target's post-final-norm hidden state at t) for step 1 and the previous step's `o`
for step k > 1. The block attends causally over its own step's sequence (positions t' <= t), with the
target's rotary embedding at the absolute positions. `num_modules` modules run in sequence (step k uses
module k), or with `recursive` one module runs `num_steps` times (FastMTP).

Parameter names (per module k): `mtp.{k}.enorm.weight`, `mtp.{k}.hnorm.weight`, `mtp.{k}.eh_proj.weight`
([H, 2H]), `mtp.{k}.block.*` (the decoder layer's own names, e.g. `self_attn.q_proj.weight`) and
`mtp.{k}.norm.weight` (DeepSeek's `shared_head.norm`). The DeepSeek-V3 layout stores module k as
`model.layers.{L+k}.{enorm,hnorm,eh_proj}.*`, the block's tensors directly under `model.layers.{L+k}.`, and
`model.layers.{L+k}.shared_head.norm.weight`; `shared_head.head` and `embed_tokens` are the target's.
Norms use the target's norm class (Gemma's RMSNorm stores w for a (1 + w) scale).

Training: `python train/mtp.py --config configs/tiny-mtp.yaml --out runs/mtp-tiny`.
Drafting: `MTPDrafter` proposes a chain, one token per step, keeping one KV cache per step (transformers'
DynamicCache, see heads.cache); `drafter_factory` maps eval.tree onto it (auto or chain);
`MTPDrafter.draft_together` drafts the chains of the batched decoder's rows (eval.batch) in one pass of each
step's module for all of them.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache

from heads.align import shift_targets
from heads.base import check_eval_tree
from heads.cache import additive_mask, cache_kwarg, cache_length, crop_to, pad_requests
from heads.losses import TokenLossConfig, chain_metrics, check_token_loss, hard_token_loss
from heads.registry import Family
from heads.sampling import draft_token
from heads.types import DraftTree, Features, TargetIO

TREES = ("chain",)  # the eval.tree values drafter_factory maps besides "auto": an MTP drafter drafts chains


@dataclass
class MTPConfig(TokenLossConfig):
    family: str = "mtp"
    num_modules: int = 1  # K modules in sequence; module k predicts token t+1+k
    recursive: bool = False  # apply one module num_steps times (FastMTP) instead of K separate modules
    num_steps: int = 3  # training steps unrolled when recursive (drafting may run more)
    step_weights: list[float] | None = None  # per-step loss weights; null = 0.8**(k-1) for step k = 1, 2, ...
    init_from_last_layer: bool = True  # initialise the block from the target's last decoder layer


def train_steps(cfg: MTPConfig) -> int:
    """Steps unrolled in training: num_steps when recursive, else one per module."""
    return cfg.num_steps if cfg.recursive else cfg.num_modules


def step_weights(cfg: MTPConfig) -> list[float]:
    """Loss weight of each training step (default 0.8**(k-1): step 1 weighs 1, step 2 0.8, ...)."""
    n = train_steps(cfg)
    if cfg.step_weights is None:
        return [0.8**k for k in range(n)]
    if len(cfg.step_weights) != n:
        raise ValueError(f"head.step_weights has {len(cfg.step_weights)} entries but training unrolls {n} steps")
    return list(cfg.step_weights)


def causal_mask(q_pos: torch.Tensor, k_len: int, window: int | None, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [1, 1, q, k]: query at absolute position q_pos[i] sees keys 0..q_pos[i] (and, for a
    sliding-window layer, only the last `window` of them, as transformers' sliding masks do)."""
    k_pos = torch.arange(k_len, device=q_pos.device)
    return additive_mask(k_pos[None, :] <= q_pos[:, None], dtype, q_pos, k_pos, window)


class MTPModule(nn.Module):
    """One DeepSeek MTP module: enorm, hnorm, eh_proj, block, norm (see the module docstring)."""

    def __init__(self, enorm: nn.Module, hnorm: nn.Module, eh_proj: nn.Linear, block: nn.Module, norm: nn.Module):
        super().__init__()
        self.enorm, self.hnorm, self.eh_proj, self.block, self.norm = enorm, hnorm, eh_proj, block, norm

    def forward(
        self,
        emb: torch.Tensor,
        h: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor,
        cache: DynamicCache | None = None,
    ) -> torch.Tensor:
        """o = block(eh_proj(cat(enorm(emb), hnorm(h)))) over [B, T, H] inputs (T new positions)."""
        u = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h)], dim=-1))
        out = self.block(u, attention_mask=mask, position_embeddings=position_embeddings, **{cache_kwarg(self.block): cache})
        return out[0] if isinstance(out, tuple) else out


class MTPHead(nn.Module):
    """The modules (`mtp.{k}`) and the step -> module map; frozen target parts stay outside."""

    def __init__(self, cfg: MTPConfig, modules: list[MTPModule]):
        super().__init__()
        self.cfg = cfg  # plain attribute (not in the state dict): loss and drafter read it
        self.mtp = nn.ModuleList(modules)
        attn = getattr(modules[0].block, "self_attn", None)
        # Sliding-window layers (Gemma3, some Qwen2) keep their window; the rotary may depend on the type.
        self.window: int | None = getattr(attn, "sliding_window", None)
        self.layer_type: str = getattr(attn, "layer_type", None) or "full_attention"

    def module_for(self, step: int) -> MTPModule:
        """The module run at 1-based `step` (the only one when recursive)."""
        if self.cfg.recursive:
            return self.mtp[0]
        if not 1 <= step <= len(self.mtp):
            raise ValueError(f"MTP step {step} outside 1..{len(self.mtp)} (num_modules) for a non-recursive head")
        return self.mtp[step - 1]

    def forward(
        self,
        h: torch.Tensor,
        embs: list[torch.Tensor],
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor,
    ) -> list[torch.Tensor]:
        """Training unroll over full sequences: embs[k-1] = embed(x[t+k]); returns norm(o_k) per step k."""
        dtype = self.mtp[0].eh_proj.weight.dtype
        h = h.to(dtype)
        outs = []
        for k, e in enumerate(embs, start=1):
            mod = self.module_for(k)
            h = mod(e.to(dtype), h, position_embeddings, mask)
            outs.append(mod.norm(h))
        return outs


def rotary_embeddings(head: MTPHead, target: TargetIO, x: torch.Tensor, positions: torch.Tensor):
    """(cos, sin) of the target's rotary embedding at `positions` [1, T] for the head's layer type."""
    if target.rotary is None:
        raise ValueError(f"target '{target.name}' exposes no rotary embedding; MTP blocks need one")
    if "layer_type" in inspect.signature(target.rotary.forward).parameters:
        return target.rotary(x, positions, head.layer_type)
    return target.rotary(x, positions)


def embed(target: TargetIO, ids: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The target's (frozen) embedding of `ids` [B, T], zeroed where the absolute position is 0 (vLLM);
    positions [T] (every row's) or [B, T] (each row's own)."""
    with torch.no_grad():
        e = target.embed(ids).to(dtype)
    first = positions == 0
    return e.masked_fill((first if first.dim() == 2 else first[None])[..., None], 0.0)


def feature_layers(cfg: MTPConfig, target_config: Any) -> list[int]:
    """MTP reads only `last` (and the target's embedding of the next tokens)."""
    return []


def _fresh_norm(template: nn.Module, hidden: int) -> nn.Module:
    """A new norm of the target's class at its identity scale (ones, or zeros for Gemma's 1 + w)."""
    eps = getattr(template, "variance_epsilon", getattr(template, "eps", 1e-6))
    return type(template)(hidden, eps=eps)


def build(cfg: MTPConfig, target: TargetIO) -> MTPHead:
    """Fresh float32 modules on the target's device; blocks copied from the target's last layer."""
    check_token_loss(cfg)
    if cfg.num_modules < 1 or cfg.num_steps < 1:
        raise ValueError(f"head.num_modules and head.num_steps must be >= 1 (got {cfg.num_modules}, {cfg.num_steps})")
    step_weights(cfg)  # fail early on a wrong-length step_weights
    if target.last_layer is None or target.norm is None:
        raise ValueError(f"target '{target.name}' exposes no last decoder layer or final norm; MTP needs both")
    H = target.hidden_size
    std = float(getattr(target.config, "initializer_range", 0.02))
    modules = []
    for _ in range(1 if cfg.recursive else cfg.num_modules):
        if cfg.init_from_last_layer:
            block = copy.deepcopy(target.last_layer)
        else:
            block = type(target.last_layer)(target.config, target.num_layers - 1)
            for m in block.modules():
                if isinstance(m, nn.Linear):
                    nn.init.normal_(m.weight, std=std)
                    if m.bias is not None:
                        nn.init.zeros_(m.bias)
        eh_proj = nn.Linear(2 * H, H, bias=False)
        nn.init.normal_(eh_proj.weight, std=std)
        norm = copy.deepcopy(target.norm)  # shared_head.norm starts as the target's final norm
        modules.append(MTPModule(_fresh_norm(target.norm, H), _fresh_norm(target.norm, H), eh_proj, block, norm))
    head = MTPHead(cfg, modules).float().to(target.lm_head.weight.device)
    head.requires_grad_(True)  # the copies come from a frozen target
    return head


def _logits(target: TargetIO, normed: torch.Tensor) -> torch.Tensor:
    return target.lm_head(normed.to(target.lm_head.weight.dtype)).float()


def loss(head: nn.Module, batch: dict[str, torch.Tensor], target: TargetIO) -> tuple[torch.Tensor, dict[str, float]]:
    """Sum over steps k of weight_k * CE(lm_head(norm(o_k)) at t, token t+1+k), on loss-masked tokens (head.loss
    tv or kl_tv: heads/losses.py's total variation against that token, or the mix).

    `head` may be wrapped (DDP): the computation goes through its forward, config and helpers through
    `.module`.
    """
    inner: MTPHead = getattr(head, "module", head)
    cfg = inner.cfg
    ids, last = batch["input_ids"], batch["last"]
    real = batch["attention_mask"].bool()
    valid = batch["loss_mask"].bool() & real
    T = ids.shape[1]
    dtype = inner.mtp[0].eh_proj.weight.dtype
    positions = torch.arange(T, device=ids.device)
    # Step k embeds x[t+k]; beyond the sequence end the id is a 0 filler, only ever seen by positions
    # whose own label is masked (causal attention never looks forward).
    embs = [embed(target, shift_targets(ids, real, k)[0], positions, dtype) for k in range(1, train_steps(cfg) + 1)]
    pe = rotary_embeddings(inner, target, embs[0], positions[None])
    mask = causal_mask(positions, T, inner.window, dtype)
    normed = head(last, embs, pe, mask)
    total = last.new_zeros((), dtype=torch.float32)
    metrics: dict[str, float] = {}
    hits: list[torch.Tensor] = []  # per step, [B, T]: a start position's chain is its row of every step
    for k, (w, out) in enumerate(zip(step_weights(cfg), normed), start=1):
        labels, m = shift_targets(ids, valid, 1 + k)
        hits.append(torch.zeros(m.shape, device=ids.device))
        if not m.any():
            metrics[f"top1/{k - 1}"] = 0.0
            continue
        logits, gold = _logits(target, out[m]), labels[m]
        step_loss = hard_token_loss(logits, gold, cfg.loss, cfg.loss_tv_weight)
        total = total + w * step_loss
        hits[-1][m] = (logits.argmax(-1) == gold).float()
        metrics[f"loss/{k - 1}"] = float(step_loss.detach())
        metrics[f"top1/{k - 1}"] = float(hits[-1][m].mean())
        metrics[f"n/{k - 1}"] = float(gold.numel())  # weights top1 when the loop averages batches
    metrics.update(chain_metrics(hits, shift_targets(ids, valid, 2)[1]))  # the start positions: step 1's
    return total, metrics


class MTPDrafter:
    """Chain drafter: step k proposes token n+k from module k at position n-1 (n = the root's position).

    Exactly the training computation, incrementally. Step k at position p needs x[p+k], so its committed
    positions are p <= n-k (those never change and stay in step k's KV cache); positions n-k+1..n-1 use
    drafted tokens and are recomputed at every draft, then cropped away. Outputs o_k at committed positions
    are kept for step k+1. `commit` only records tokens and the target's new hidden states.
    """

    capture_layers: tuple[int, ...] | None = ()

    def __init__(
        self, head: MTPHead, target: TargetIO, max_steps: int | None = None, generator: torch.Generator | None = None
    ):
        self.head, self.target, self.generator = head, target, generator
        cfg = head.cfg
        # Separate modules stop at K; a recursive module may run as far as asked (or max_steps).
        self.max_steps = max_steps if max_steps is not None else (None if cfg.recursive else cfg.num_modules)
        if not cfg.recursive and self.max_steps is not None and self.max_steps > cfg.num_modules:
            raise ValueError(f"max_steps {self.max_steps} exceeds num_modules {cfg.num_modules} (not recursive)")
        self.dtype = head.mtp[0].eh_proj.weight.dtype
        self.tokens: list[int] = []
        self.hidden = torch.empty(0)
        self.caches: list[DynamicCache] = []  # one per step: its committed positions (heads.cache)
        self.outs: list[torch.Tensor] = []
        self.drafted: list[int] = []
        self.ready: tuple[int, float, DraftTree] | None = None  # (k, temperature, chain) from draft_together

    def begin(self, prompt_ids: torch.Tensor, features: Features | None, next_token: int) -> None:
        if features is None:
            raise ValueError("MTPDrafter needs the target's last hidden states (capture_layers = ())")
        ids = prompt_ids.reshape(-1).tolist()
        if features.last.shape[1] != len(ids):
            raise ValueError(f"begin: {features.last.shape[1]} feature positions for a {len(ids)}-token prompt")
        self.tokens = ids + [int(next_token)]
        self.hidden = features.last[0].to(self.dtype)
        self.caches, self.outs, self.drafted, self.ready = [], [], [], None

    @property
    def max_depth(self) -> int | None:
        """heads.types.Drafter: no draft is deeper than max_steps (None: a recursive module runs as far as asked)."""
        return self.max_steps

    def _steps(self, k: int) -> int:
        return k if self.max_steps is None else min(k, self.max_steps)

    def _step_cache(self, s: int) -> DynamicCache:
        """Step s's cache (made empty, with no outputs yet, on its first use)."""
        if len(self.caches) < s:
            self.caches.append(DynamicCache())
            self.outs.append(self.hidden.new_zeros((0, self.hidden.shape[-1])))
        return self.caches[s - 1]

    def _keep(self, s: int, full: torch.Tensor) -> None:
        """After step s's pass, o_s at positions 0..n-1 (`full`): keep only positions whose inputs are all
        committed (p <= n-s) in its cache and outputs, for the next draft."""
        keep = max(0, len(self.tokens) - s)
        crop_to(self.caches[s - 1], keep)
        self.outs[s - 1] = full[:keep]

    @torch.no_grad()
    def draft(self, k: int, temperature: float) -> DraftTree:
        ready, self.ready = self.ready, None
        if ready is not None and ready[:2] == (k, temperature):
            self.drafted = ready[2].tokens.tolist()
            return ready[2]
        steps = self._steps(k)
        n = len(self.tokens) - 1  # root position; hidden states are known for 0..n-1
        device = self.hidden.device
        seq = list(self.tokens)
        tokens, probs = [], []
        prev = self.hidden  # h for step 1: the target's, positions 0..n-1
        for s in range(1, steps + 1):
            cache = self._step_cache(s)
            start = cache_length(cache)
            pos = torch.arange(start, n, device=device)
            ids = torch.tensor([seq[p + s] for p in range(start, n)], device=device)[None]
            emb = embed(self.target, ids, pos, self.dtype)
            mod = self.head.module_for(s)
            pe = rotary_embeddings(self.head, self.target, emb, pos[None])
            mask = causal_mask(pos, n, self.head.window, self.dtype)
            o = mod(emb, prev[start:n][None], pe, mask, cache=cache)[0]
            full = torch.cat([self.outs[s - 1][:start], o])  # o_s at positions 0..n-1
            logits = _logits(self.target, mod.norm(full[-1]))
            tok, q = draft_token(logits, temperature, self.generator)
            if q is not None:
                probs.append(q)
            tokens.append(tok)
            seq.append(tok)
            self._keep(s, full)
            prev = full
        self.drafted = tokens
        t = torch.tensor(tokens, dtype=torch.long, device=device)
        return DraftTree.chain(t, torch.stack(probs) if probs else None)

    @staticmethod
    @torch.no_grad()
    def draft_together(drafters: list[MTPDrafter], ks: list[int], temperature: float) -> None:
        """Draft the chains of several requests at once (the batched decoder's rows: eval.batch), one pass of each
        step's module for all of them (and one of the target's LM head): each request's new positions padded
        to the longest, over its own committed keys (padded to the longest and masked), at its own positions;
        drafter i's next draft(ks[i], temperature) returns its chain, the one its own draft would make, and its
        caches end as its own draft leaves them. Requests are grouped by head; a block whose attention has no
        layer_idx (no cache slot to fill), or a request that drafted since its last commit (its steps have no
        new position to run), is left to its own draft."""
        by_head: dict[int, list[tuple[MTPDrafter, int]]] = {}
        for d, k in zip(drafters, ks):
            if d._steps(k) > 0 and d.tokens and not d.drafted:
                by_head.setdefault(id(d.head), []).append((d, k))
        for rows in by_head.values():
            layer = getattr(getattr(rows[0][0].head.mtp[0].block, "self_attn", None), "layer_idx", None)
            if len(rows) > 1 and layer is not None:
                MTPDrafter._draft_rows(rows, temperature, int(layer))

    @staticmethod
    def _draft_rows(rows: list[tuple[MTPDrafter, int]], temperature: float, layer: int) -> None:
        """draft_together for requests of one head: (drafter, k) each; `layer`: the block's cache slot."""
        first = rows[0][0]
        head, target, dtype, device = first.head, first.target, first.dtype, first.hidden.device
        steps = [d._steps(k) for d, k in rows]
        seqs = [list(d.tokens) for d, _ in rows]
        prevs = [d.hidden for d, _ in rows]  # step 1 reads the target's states, positions 0..n-1
        tokens: list[list[int]] = [[] for _ in rows]
        probs: list[list[torch.Tensor]] = [[] for _ in rows]
        for s in range(1, max(steps) + 1):
            live = [i for i, st in enumerate(steps) if st >= s]  # requests whose chain reaches this step
            ds = [rows[i][0] for i in live]
            caches = [d._step_cache(s) for d in ds]
            n = [len(d.tokens) - 1 for d in ds]  # each request's root position
            start = [cache_length(c) for c in caches]
            m = [a - b for a, b in zip(n, start)]
            b, mm, past = len(ds), max(m), max(start)
            pos = torch.tensor([[st + j for j in range(mm)] for st in start], device=device)  # [b, mm]
            ids = torch.zeros(b, mm, dtype=torch.long, device=device)
            h = prevs[0].new_zeros(b, mm, prevs[0].shape[-1])
            allowed = torch.zeros(b, mm, past + mm, dtype=torch.bool, device=device)
            allowed[:, :, past:] = torch.ones(mm, mm, dtype=torch.bool, device=device).tril()  # its new, causal
            k_pos = torch.cat([torch.arange(past, device=device).expand(b, past), pos], dim=1)  # [b, past + mm]
            tmp = DynamicCache()
            if past:  # else no request has committed keys at this step yet
                keys, vals, seen = pad_requests([(c.layers[layer].keys, c.layers[layer].values) if st else None
                                                 for c, st in zip(caches, start)])
                tmp.update(keys, vals, layer)
                allowed[:, :, :past] = seen[:, None, :]  # its committed keys
            for r, (i, st, mr) in enumerate(zip(live, start, m)):
                ids[r, :mr] = torch.tensor([seqs[i][p + s] for p in range(st, st + mr)], device=device)
                h[r, :mr] = prevs[i][st:st + mr]
            mask = additive_mask(allowed, dtype, pos, k_pos, head.window)  # [b, 1, mm, past + mm]
            emb = embed(target, ids, pos, dtype)
            mod = head.module_for(s)
            pe = rotary_embeddings(head, target, emb, pos)
            o = mod(emb, h, pe, mask, cache=tmp)  # [b, mm, H]
            new = tmp.layers[layer]
            lasts = []
            for r, (i, d, c, st, mr) in enumerate(zip(live, ds, caches, start, m)):
                # its new keys join its own cache (then cropped to the committed ones, as its own draft does)
                c.update(new.keys[r:r + 1, :, past:past + mr], new.values[r:r + 1, :, past:past + mr], layer)
                full = torch.cat([d.outs[s - 1][:st], o[r, :mr]])  # o_s at positions 0..n-1
                d._keep(s, full)
                prevs[i] = full
                lasts.append(full[-1])
            logits = _logits(target, mod.norm(torch.stack(lasts)))  # [b, V]
            for r, (i, d) in enumerate(zip(live, ds)):
                tok, q = draft_token(logits[r], temperature, d.generator)
                tokens[i].append(tok)
                seqs[i].append(tok)
                if q is not None:
                    probs[i].append(q)
        for i, (d, k) in enumerate(rows):
            t = torch.tensor(tokens[i], dtype=torch.long, device=device)
            d.ready = (k, temperature, DraftTree.chain(t, torch.stack(probs[i]) if probs[i] else None))
            d.drafted = tokens[i]

    def commit(self, accepted: list[int], features: Features | None, next_token: int) -> None:
        a = len(accepted)
        if list(accepted) != list(range(a)) or a > len(self.drafted):
            raise ValueError(f"commit: accepted {accepted} is not a prefix of the {len(self.drafted)}-token chain")
        self.commit_tokens(self.drafted[:a], features, next_token)

    def commit_tokens(self, tokens: list[int], features: Features | None, next_token: int) -> None:
        # Caches hold committed positions only (draft positions are cropped in draft), so any path commits alike.
        if features is None or features.last.shape[1] != len(tokens) + 1:
            raise ValueError(f"commit: expected features for {len(tokens) + 1} positions")
        self.tokens += [int(t) for t in tokens] + [int(next_token)]
        self.hidden = torch.cat([self.hidden, features.last[0].to(self.dtype)])
        self.drafted, self.ready = [], None


def drafter(
    head: MTPHead, target: TargetIO, max_steps: int | None = None, generator: torch.Generator | None = None
) -> MTPDrafter:
    """The decoder adapter (chain drafting; sampled drafts use `generator`, the drafter's own)."""
    return MTPDrafter(head, target, max_steps=max_steps, generator=generator)


def drafter_factory(head: MTPHead, target: TargetIO, tree: str = "auto", k: int = 4) -> Callable[[], MTPDrafter]:
    """Fresh drafters for eval.tree: auto or chain (an MTP drafter only drafts chains); `k` is unused (the
    depth comes with each draft call). Any other tree raises HeadError."""
    check_eval_tree(tree, head.cfg.family, TREES)
    return lambda: drafter(head, target)


FAMILIES = (Family(name="mtp", config=MTPConfig, feature_layers=feature_layers, build=build, loss=loss,
                   drafter_factory=drafter_factory, trees=TREES, script="mtp", tiny="configs/tiny-mtp.yaml"),)
