"""EAGLE head configs and what they resolve to for a target: the captured layers and the draft vocabulary size.

    Eagle1Config / Eagle3Config     the `head:` section of a run config (family eagle1 / eagle3)
    feature_layers(cfg, target_config)   hidden_states indices an EAGLE-3 head reads ([] for EAGLE-1)
    resolved_draft_vocab(cfg, vocab)     the draft vocabulary size (default min(32000, target vocab))

Tests: `.venv/bin/python -m pytest -q tests/test_eagle.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from heads.base import HeadConfig
from heads.losses import TokenLossConfig

DEFAULT_DRAFT_VOCAB = 32000


@dataclass
class Eagle1Config(TokenLossConfig):
    family: str = "eagle1"
    noise: float = 0.2  # width of the uniform input-feature noise: U(-noise/2, noise/2) (EAGLE: U(-0.1, 0.1))
    feature_loss_weight: float = 1.0  # SmoothL1 on the predicted feature
    token_loss_weight: float = 0.1  # cross-entropy of the target's lm_head on the predicted feature


@dataclass
class Eagle3Config(TokenLossConfig):
    family: str = "eagle3"
    layer_ids: list[int] | None = None  # hidden_states indices; null = [2, L//2, L-3] (EAGLE/SpecForge)
    draft_vocab_size: int | None = None  # null = min(32000, target vocab)
    ttt_length: int = 7  # training-time-test unroll steps
    ttt_decay: float = 0.8  # step s weighted decay**s
    intermediate_size: int | None = None  # draft MLP width; null = the target's
    # EAGLE-3.1 / speculators `norm_before_residual`: the layer's residual is hidden_norm(hidden), not hidden
    norm_before_residual: bool = False
    # A pointer over the request's own positions, mixed with the draft vocab's softmax: the head's state queries the
    # target's last hidden state at every committed position and drafts the token that followed it, so it can
    # also draft the request's tokens outside the draft vocab. No engine layout has it: export refuses.
    pointer: bool = False


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
    """The draft vocabulary size of an EAGLE-3 head for a target vocab of `vocab_size` (refuses 0 or more)."""
    n = cfg.draft_vocab_size if cfg.draft_vocab_size is not None else min(DEFAULT_DRAFT_VOCAB, vocab_size)
    if not 0 < n <= vocab_size:
        raise ValueError(f"head.draft_vocab_size {n}: must be in 1..{vocab_size} (the target vocab)")
    return n
