"""The DFlash block drafter's config and what it resolves to for a target: captured layers, draft vocab, mask id.

    DFlashConfig                          the `head:` section of a run config (family dflash)
    feature_layers(cfg, target_config)    hidden_states indices the head reads as `aux` (EAGLE-3's rule and
                                          default, so one offline store serves both families)
    resolved_mask_token(cfg, vocab)       the token id whose (frozen, shared) embedding fills the masked slots
    loss_weights(cfg)                     the per-block-position loss weights
    first_slot(cfg)                       the first block slot that drafts (1; 0 with sample_from_anchor)

Tests: `.venv/bin/python -m pytest -q tests/test_dflash.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from heads.base import HeadConfig
from heads.eagle.config import feature_layers as eagle_feature_layers


@dataclass
class DFlashConfig(HeadConfig):
    family: str = "dflash"
    layer_ids: list[int] | None = None  # hidden_states indices; null = EAGLE-3's [2, L//2, L-3] (same store)
    num_layers: int = 1  # draft decoder layers (z-lab's Qwen3-8B drafter has 5)
    block_size: int = 8  # B: one pass proposes B - 1 tokens (slot 0 holds the anchor; speculators default 8)
    draft_vocab_size: int | None = None  # null = min(32000, target vocab), as EAGLE-3
    mask_token_id: int | None = None  # null = the target's last id (its embedding row fills the masked slots)
    anchors: int = 512  # anchor positions sampled per sequence per step (SpecForge's default; more than an
    # answer has = every eligible position, which learned the first slot 0.23 -> 0.37 on the quickstart's store)
    decay_gamma: float = 4.0  # the j-th drafting slot (j = 0, 1, ...) weighted exp(-j/gamma) (speculators' default
    # for B = 8; loss_weights)
    intermediate_size: int | None = None  # draft MLP width; null = the target's
    # DSpark's layout (vLLM `qwen3_dspark.py`, `sample_from_anchor`): the anchor's slot drafts too, slot i
    # predicting x_{a+i+1} (next-token, as EAGLE-3's first step: the query that drafts x_{a+1} holds the
    # anchor's own embedding), so a block of B drafts B tokens; false = DFlash's fill-in, B - 1 tokens.
    sample_from_anchor: bool = False
    # DSpark's Markov head: logits of a drafted slot += w2 @ w1[the token before it] (w1 [target vocab, r],
    # w2 [draft vocab, r]), drawn left to right after the one parallel pass, so a slot sees the token drafted
    # before it, which the parallel pass cannot; 0 = none (plain DFlash).
    markov_rank: int = 0
    # The Markov head's rows: "target", one per target id (vLLM's DSpark layout); "draft", one per draft-vocab id
    # plus one shared by every other id (a 49,152-row table is most of the head's parameters, and AdamW's update
    # of it about a tenth of SmolLM2's training step): exported to DSpark's layout with each id given its row.
    markov_rows: Literal["target", "draft"] = "target"
    # The anchor's context feature in every slot's input (P-EAGLE's and EAGLE-3's first-step input, not DFlash's
    # or DSpark's): slot inputs = anchor_proj([embedding, c_{a-1}]), c = hidden_norm(fc(captured layers)) at the
    # position before the anchor, so the query that drafts the first token holds the target's newest state
    # directly instead of fetching it through attention. No engine layout serves it (convert refuses it).
    anchor_feature: bool = False
    # Hydra's sequential dependence on the block drafter (Ankner et al. 2024, "Hydra: Sequentially-Dependent Draft
    # Heads"): before the LM head, each drafting slot's state h gains down(silu(up([norm(h), emb(the token before
    # the one it drafts)]))), an MLP of this width over the target's (frozen, shared) embedding of that token, run
    # slot by slot after the one block pass as the Markov bias is; 0 = none. No engine layout serves it.
    prev_mlp: int = 0
    # Train the draft-vocab LM head (initialised from the target's rows, as EAGLE-3's is, which trains it); false =
    # frozen at the target's rows, as DFlash's and DSpark's recipes share the target's. Either way the export
    # carries the rows drafted with, which the engines load as the drafter's own (its vocab is not the target's).
    train_lm_head: bool = False
    # The first drafting slot skips the sequential stage (the Markov bias and head.prev_mlp): its logits are
    # lm_head(norm(h)) alone. The token before it is the anchor, which its input already holds, and in our decoder
    # the stage cost that slot about a fifth of a one-token drafting pass, where the policy drafts one token on
    # most passes; held out it is level (docs/results.md). No engine layout serves it (DSpark biases every slot).
    plain_first_slot: bool = False


def feature_layers(cfg: HeadConfig, target_config: Any) -> list[int]:
    """The captured layers: EAGLE-3's validation and default ([2, L//2, L-3]) on cfg.layer_ids."""
    return eagle_feature_layers(cfg, target_config)


def check(cfg: DFlashConfig, vocab_size: int) -> None:
    """Refuse a config no head can be built from (ValueError naming the key)."""
    if cfg.block_size < 2 - int(cfg.sample_from_anchor):
        raise ValueError(f"head.block_size {cfg.block_size}: must be >= 2 (slot 0 is the anchor and drafts "
                         "nothing unless head.sample_from_anchor)")
    if cfg.num_layers < 1:
        raise ValueError(f"head.num_layers {cfg.num_layers}: must be >= 1")
    if cfg.anchors < 1:
        raise ValueError(f"head.anchors {cfg.anchors}: must be >= 1")
    if cfg.markov_rank < 0:
        raise ValueError(f"head.markov_rank {cfg.markov_rank}: must be >= 0 (0 = no Markov head)")
    if cfg.markov_rows not in ("target", "draft"):  # dataclasses built in code skip the YAML check
        raise ValueError(f"head.markov_rows '{cfg.markov_rows}': must be target or draft")
    if cfg.prev_mlp < 0:
        raise ValueError(f"head.prev_mlp {cfg.prev_mlp}: must be >= 0 (0 = none)")
    if cfg.decay_gamma <= 0:
        raise ValueError(f"head.decay_gamma {cfg.decay_gamma}: must be > 0")
    resolved_mask_token(cfg, vocab_size)


def resolved_mask_token(cfg: DFlashConfig, vocab_size: int) -> int:
    """The mask token id (default: the target's last id), refused outside the target vocab."""
    m = vocab_size - 1 if cfg.mask_token_id is None else int(cfg.mask_token_id)
    if not 0 <= m < vocab_size:
        raise ValueError(f"head.mask_token_id {m}: must be in 0..{vocab_size - 1} (the target vocab)")
    return m


def first_slot(cfg: DFlashConfig) -> int:
    """The first slot that drafts: 1 (DFlash: slot 0 holds the anchor), 0 with sample_from_anchor."""
    return 0 if cfg.sample_from_anchor else 1


def loss_weights(cfg: DFlashConfig) -> list[float]:
    """Per slot: 0 for a slot that drafts nothing, exp(-j/gamma) for the j-th drafting slot (j = 0, 1, ...).

    Worked examples, B = 4, gamma = 4: [0, 1, 0.7788, 0.6065]; with sample_from_anchor [1, 0.7788, 0.6065,
    0.4724]."""
    f = first_slot(cfg)
    return [0.0] * f + [math.exp(-j / cfg.decay_gamma) for j in range(cfg.block_size - f)]
