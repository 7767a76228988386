"""Medusa heads: residual SiLU blocks plus a vocabulary projection per head, all on the last hidden state.

Head i (0-based) reads `last` at position t (the target's post-norm hidden state, what its own lm_head
reads to predict token t+1) and predicts token t+2+i:

    block_i(x) = x <- x + SiLU(W_j x + b_j)  for j < num_layers     (W_j, b_j zero-initialised: identity)
    logits_i   = lm_heads[i](block_i(last))                          (no norm, no bias)

This is exactly vLLM's Medusa forward (convert/formats/README.md, "Medusa"). Parameter names follow vLLM's layout so
the exporter only adds a prefix: `blocks.{i}.layers.{j}.weight` / `.bias` ([H, H] / [H]) and
`lm_heads.{i}.weight` ([V, H], V = the target's full vocabulary). The Medusa repository's layout maps
`blocks.{i}.layers.{j}.*` -> `{i}.{j}.linear.*` and `lm_heads.{i}.weight` -> `{i}.{num_layers}.weight`.

Training: `python train/medusa.py --config configs/tiny-medusa.yaml --out runs/medusa-tiny`.
Drafting: `MedusaDrafter` proposes a static tree (a Medusa choices list) verified by eval.decoder;
`drafter_factory` maps eval.tree onto it (auto/static: the configured tree, chain: the rank-0 path);
`MedusaDrafter.draft_together` drafts the trees of the batched decoder's rows (eval.batch) in one pass of each head.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from heads.align import shift_targets
from heads.base import check_eval_tree
from heads.losses import TokenLossConfig, chain_metrics, check_token_loss, hard_token_loss, token_loss
from heads.registry import Family
from heads.sampling import draft_distribution
from heads.tree import DEFAULT_CHOICES, StaticTree
from heads.types import DraftTree, Features, TargetIO

TREES = ("chain", "static")  # the eval.tree values drafter_factory maps besides "auto"


@dataclass
class MedusaConfig(TokenLossConfig):
    family: str = "medusa"
    num_heads: int = 4  # head i predicts token t+2+i
    num_layers: int = 1  # residual blocks per head
    decay: float = 0.8  # head i's loss weighted decay**i (loss = sum over heads, Medusa-1)
    init_from_lm_head: bool = True  # initialise each vocab projection from the target's lm_head
    distill: bool = False  # train against the target's distribution (KL) instead of its tokens (CE)
    tree: list[list[int]] | None = None  # static tree (Medusa choices); null = heads.tree.DEFAULT_CHOICES cut to num_heads


class MedusaHead(nn.Module):
    """`num_heads` heads of `num_layers` residual SiLU blocks and a vocabulary projection each."""

    def __init__(self, cfg: MedusaConfig, hidden_size: int, vocab_size: int):
        super().__init__()
        self.cfg = cfg  # plain attribute (not in the state dict): loss and drafter read it
        num_heads, num_layers = cfg.num_heads, cfg.num_layers
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"layers": nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(num_layers))})
            for _ in range(num_heads)
        )
        self.lm_heads = nn.ModuleList(nn.Linear(hidden_size, vocab_size, bias=False) for _ in range(num_heads))
        for block in self.blocks:
            for lin in block["layers"]:
                # Zero weight AND bias: x + SiLU(0) = x, so every head starts as the target's own next-token
                # predictor (Medusa zero-initialises W; the bias too, so the identity is exact).
                nn.init.zeros_(lin.weight)
                nn.init.zeros_(lin.bias)

    @property
    def num_heads(self) -> int:
        return len(self.lm_heads)

    def block(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Head i's residual blocks: x <- x + SiLU(W x + b), layer by layer."""
        for lin in self.blocks[i]["layers"]:
            x = x + F.silu(lin(x))
        return x

    def forward(self, last: torch.Tensor, heads: int | None = None) -> torch.Tensor:
        """Logits of the first `heads` heads (all by default): [heads, *last.shape[:-1], V]."""
        n = self.num_heads if heads is None else heads
        x = last.to(self.lm_heads[0].weight.dtype)  # features may be stored in bf16; the head is fp32
        return torch.stack([self.lm_heads[i](self.block(i, x)) for i in range(n)])


def feature_layers(cfg: MedusaConfig, target_config: Any) -> list[int]:
    """Medusa reads only `last`, no intermediate layers."""
    return []


def build(cfg: MedusaConfig, target: TargetIO) -> MedusaHead:
    """A fresh float32 head on the target's device; vocab projections copied from the target's lm_head."""
    check_token_loss(cfg)
    if cfg.num_heads < 1 or cfg.num_layers < 0:
        raise ValueError(f"head.num_heads must be >= 1 and head.num_layers >= 0 (got {cfg.num_heads}, {cfg.num_layers})")
    device = target.lm_head.weight.device
    head = MedusaHead(cfg, target.hidden_size, target.vocab_size)
    if cfg.init_from_lm_head:
        w = target.lm_head.weight.detach().float()
        if tuple(w.shape) != (target.vocab_size, target.hidden_size):
            raise ValueError(f"target lm_head weight has shape {tuple(w.shape)}, expected (vocab, hidden)")
        for lm in head.lm_heads:
            lm.weight.data.copy_(w)
    return head.to(device)


def loss(head: nn.Module, batch: dict[str, torch.Tensor], target: TargetIO) -> tuple[torch.Tensor, dict[str, float]]:
    """Sum over heads of decay**i * (CE to the actual token t+2+i, or KL to the target's distribution); with
    head.loss tv or kl_tv, heads/losses.py's total variation (or the mix) against that token or distribution.

    Only positions whose predicted token is a real, loss-masked token count. The teacher distribution for
    token t+2+i is the target's own prediction at position t+1+i: lm_head(last[t+1+i]). `head` may be
    wrapped (DDP): the computation goes through its forward, the config through `.module`.
    """
    cfg: MedusaConfig = getattr(head, "module", head).cfg
    ids, last = batch["input_ids"], batch["last"]
    valid = batch["loss_mask"].bool() & batch["attention_mask"].bool()
    shifted = [shift_targets(ids, valid, 2 + i) for i in range(cfg.num_heads)]
    union = torch.stack([m for _, m in shifted]).any(0)
    total = last.new_zeros((), dtype=torch.float32)
    metrics: dict[str, float] = {}
    if not union.any():
        none = chain_metrics([torch.zeros(0)] * cfg.num_heads, torch.zeros(0))  # every key, as each rank must have
        return total, {**{f"top1/{i}": 0.0 for i in range(cfg.num_heads)}, **none}
    # Only positions some head has a target for pay for the [N, V] projections.
    logits_all = head(last[union]).float()  # [heads, N, V]
    hits = [torch.zeros(logits_all.shape[1], device=last.device) for _ in shifted]  # per selected position
    for i, (labels, mask) in enumerate(shifted):
        keep = mask[union]  # head i's positions among the selected ones
        if not keep.any():
            metrics[f"top1/{i}"] = 0.0
            continue
        logits, gold = logits_all[i][keep], labels[mask]
        if cfg.distill:
            # Teacher at t+1+i: rolled[t] = last[t+1+i]. Under `mask`, t+2+i is a real token, so t+1+i is
            # too and the roll never wraps around for a selected position.
            teacher_in = torch.roll(last, shifts=-(1 + i), dims=1)[mask]
            with torch.no_grad():
                teacher = target.lm_head(teacher_in.to(target.lm_head.weight.dtype)).float().log_softmax(-1)
            # forward_kl is KL(p || q) here (the soft CE less p's entropy), as it always was; kl_tv mixes that KL
            if cfg.loss != "tv":
                head_loss = F.kl_div(logits.log_softmax(-1), teacher, log_target=True, reduction="batchmean")
            if cfg.loss != "forward_kl":
                n = logits.shape[0]
                tv = token_loss(logits, teacher.exp(), torch.ones(n, device=logits.device), n, "tv")
                head_loss = tv if cfg.loss == "tv" else (1 - cfg.loss_tv_weight) * head_loss + cfg.loss_tv_weight * tv
        else:
            head_loss = hard_token_loss(logits, gold, cfg.loss, cfg.loss_tv_weight)
        total = total + (cfg.decay**i) * head_loss
        metrics[f"loss/{i}"] = float(head_loss.detach())
        hits[i][keep] = (logits.argmax(-1) == gold).float()
        metrics[f"top1/{i}"] = float(hits[i][keep].mean())
        metrics[f"n/{i}"] = float(gold.numel())  # weights top1 when the loop averages batches
    metrics.update(chain_metrics(hits, shifted[0][1][union]))
    return total, metrics


class MedusaDrafter:
    """Static-tree drafter: all heads read `last` at the position before the root, once per draft.

    The root (the token the target itself chose) sits at position n; head i proposes candidates for
    position n+1+i from the hidden state at n-1. Siblings are distinct top-k candidates, so the tree is
    marked "topk" and each node carries its head's softmax(logits / temperature) as q.
    """

    capture_layers: tuple[int, ...] | None = ()

    def __init__(self, head: MedusaHead, target: TargetIO, tree: list[list[int]] | None = None):
        self.head, self.target = head, target
        num_heads = head.num_heads
        choices = tree if tree is not None else head.cfg.tree
        if choices is None:
            self.tree = StaticTree(DEFAULT_CHOICES).truncate(num_heads)
        else:
            self.tree = StaticTree(choices)
            if self.tree.depth > num_heads:
                raise ValueError(f"Medusa tree has depth {self.tree.depth} but the head has only {num_heads} heads")
        self.max_depth = self.tree.depth  # heads.types.Drafter: no draft is deeper
        self.last: torch.Tensor | None = None
        self.ready: tuple[int, float, DraftTree] | None = None  # (k, temperature, tree) from draft_together

    def begin(self, prompt_ids: torch.Tensor, features: Features | None, next_token: int) -> None:
        if features is None:
            raise ValueError("MedusaDrafter needs the target's last hidden states (capture_layers = ())")
        self.last, self.ready = features.last[0, -1], None

    def _build(self, tree: StaticTree, logits: torch.Tensor, temperature: float) -> DraftTree:
        """The tree from its heads' logits [depth, V]."""
        candidates = logits.topk(tree.topk, dim=-1).indices  # temperature does not change the ranking
        probs = draft_distribution(logits, temperature) if temperature > 0 else None
        return tree.build(candidates, probs)

    @torch.no_grad()
    def draft(self, k: int, temperature: float) -> DraftTree:
        if self.last is None:
            raise RuntimeError("MedusaDrafter.draft called before begin")
        ready, self.ready = self.ready, None
        if ready is not None and ready[:2] == (k, temperature):
            return ready[2]
        if k < 1:
            return DraftTree.chain(torch.empty(0, dtype=torch.long, device=self.last.device))
        tree = self.tree.truncate(k)
        return self._build(tree, self.head(self.last, heads=tree.depth).float(), temperature)  # [depth, V]

    @staticmethod
    @torch.no_grad()
    def draft_together(drafters: list[MedusaDrafter], ks: list[int], temperature: float) -> None:
        """Draft the trees of several requests at once (the batched decoder's rows: eval.batch): one pass of
        each head over all their last states, per Medusa head; drafter i's next draft(ks[i], temperature)
        returns its tree, the one its own draft would make. On a memory-bound device a head's full-vocabulary
        LM head is read once for the batch instead of once a request."""
        by_head: dict[int, list[tuple[MedusaDrafter, int]]] = {}
        for d, k in zip(drafters, ks):
            if k > 0 and d.last is not None:
                by_head.setdefault(id(d.head), []).append((d, k))
        for rows in by_head.values():
            if len(rows) < 2:
                continue
            trees = [d.tree.truncate(k) for d, k in rows]
            lasts = torch.stack([d.last for d, _ in rows])
            logits = rows[0][0].head(lasts, heads=max(t.depth for t in trees)).float()  # [depth, requests, V]
            for r, ((d, k), tree) in enumerate(zip(rows, trees)):
                d.ready = (k, temperature, d._build(tree, logits[:tree.depth, r], temperature))

    def commit(self, accepted: list[int], features: Features | None, next_token: int) -> None:
        self.commit_tokens(accepted, features, next_token)  # only the path's length matters here

    def commit_tokens(self, tokens: list[int], features: Features | None, next_token: int) -> None:
        if features is None or features.last.shape[1] != len(tokens) + 1:
            raise ValueError(f"commit: expected features for {len(tokens) + 1} positions")
        self.last, self.ready = features.last[0, -1], None  # the last accepted node (or the old root)


def drafter(head: MedusaHead, target: TargetIO, tree: list[list[int]] | None = None) -> MedusaDrafter:
    """The decoder adapter (static tree; `tree` overrides the head's configured choices)."""
    return MedusaDrafter(head, target, tree=tree)


def drafter_factory(head: MedusaHead, target: TargetIO, tree: str = "auto", k: int = 4) -> Callable[[], MedusaDrafter]:
    """Fresh drafters for eval.tree: auto or static (the head's configured tree), chain (the rank-0 path of
    depth `k`: choices [[0], [0, 0], ...]). Any other tree raises HeadError."""
    check_eval_tree(tree, head.cfg.family, TREES)
    kw: dict[str, Any] = {"tree": [[0] * d for d in range(1, k + 1)]} if tree == "chain" else {}
    return lambda: drafter(head, target, **kw)


FAMILIES = (Family(name="medusa", config=MedusaConfig, feature_layers=feature_layers, build=build, loss=loss,
                   drafter_factory=drafter_factory, trees=TREES, script="medusa", tiny="configs/tiny-medusa.yaml",
                   target_labels=lambda cfg: cfg.distill),)
