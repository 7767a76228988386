"""EAGLE-1 heads: native only. No engine layout is exported for them (README, Known limits)."""

from __future__ import annotations

from convert.family import FamilyExports

EXPORTS = FamilyExports(
    family="eagle1",
    not_served="no vLLM layout is exported for EAGLE-1 (native only)",
    serving=lambda repo_id, target_hub, k, layouts: (
        "EAGLE-1 heads have no engine layout here; evaluate them with this project (`draftheads/`)."),
)
