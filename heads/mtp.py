"""DeepSeek-V3-style MTP modules: enorm/hnorm, eh_proj (2H -> H), one target-architecture block, shared head.

(Implementation lands with the Medusa/MTP issue; the config dataclass is fixed here.)
"""

from __future__ import annotations

from dataclasses import dataclass

from heads.base import HeadConfig


@dataclass
class MTPConfig(HeadConfig):
    family: str = "mtp"
    num_modules: int = 1  # K modules in sequence; module k predicts token t+1+k
    recursive: bool = False  # apply one module K times (FastMTP) instead of K separate modules
    num_steps: int = 3  # training steps unrolled when recursive
    step_weights: list[float] | None = None  # per-step loss weights; null = 0.8**k
    init_from_last_layer: bool = True  # initialise the block from the target's last decoder layer


CONFIGS = {"mtp": MTPConfig}
