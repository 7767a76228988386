"""EAGLE heads: EAGLE-1 (feature regression) and EAGLE-3 (fused low/mid/high features, training-time test).

(Implementation lands with the EAGLE issue; the config dataclasses are fixed here.)
"""

from __future__ import annotations

from dataclasses import dataclass

from heads.base import HeadConfig


@dataclass
class Eagle1Config(HeadConfig):
    family: str = "eagle1"
    noise: float = 0.2  # uniform input-feature noise half-width during training (EAGLE paper)
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
