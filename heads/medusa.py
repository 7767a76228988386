"""Medusa heads: residual SiLU blocks plus a vocabulary projection per head on the last hidden state.

(Implementation lands with the Medusa/MTP issue; the config dataclass is fixed here.)
"""

from __future__ import annotations

from dataclasses import dataclass

from heads.base import HeadConfig


@dataclass
class MedusaConfig(HeadConfig):
    family: str = "medusa"
    num_heads: int = 4  # head i predicts token t+2+i
    num_layers: int = 1  # residual blocks per head
    decay: float = 0.8  # head i's loss weighted decay**i
    init_from_lm_head: bool = True  # initialise each vocab projection from the target's lm_head
    distill: bool = False  # train against the target's distribution (KL) instead of its tokens (CE)
    tree: list[list[int]] | None = None  # static tree (Medusa choices); null = a default tree


CONFIGS = {"medusa": MedusaConfig}
