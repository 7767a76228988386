"""Every family's export declaration (convert/<family>.py EXPORTS), and the questions others ask of them.

    served_by_vllm("eagle3")   # (VllmServing(format="speculators", method="eagle3"), "")
    served_by_vllm("medusa")   # (None, "exported in the Medusa repository's layout; ...")
    layouts_of("eagle3")       # ("speculators", "sglang"): the first is the main one

A new family adds its module to FAMILY_MODULES (tests/test_export.py checks every family of
heads.base.FAMILIES is declared here).
"""

from __future__ import annotations

from convert import dflash, eagle1, eagle3, medusa, mtp
from convert.family import FamilyExports, Layout, VllmServing

FAMILY_MODULES = (eagle1, eagle3, medusa, mtp, dflash)
FAMILY_EXPORTS: dict[str, FamilyExports] = {m.EXPORTS.family: m.EXPORTS for m in FAMILY_MODULES}
# format -> (family, layout), in declaration order
LAYOUTS: dict[str, tuple[str, Layout]] = {
    layout.format: (e.family, layout) for e in FAMILY_EXPORTS.values() for layout in e.layouts
}
IMPORT_FORMATS = tuple(LAYOUTS)
EXPORT_FORMATS = ("native", *IMPORT_FORMATS)
# Which native families each engine layout can hold.
FORMAT_FAMILIES = {fmt: (family,) for fmt, (family, _) in LAYOUTS.items()}


def served_by_vllm(family: str) -> tuple[VllmServing | None, str]:
    """(how vLLM serves `family`, or None, and then why not; "" for a family nobody declared)."""
    exports = FAMILY_EXPORTS.get(family)
    if exports is None:
        return None, ""
    return exports.vllm, exports.not_served


def serving_note(family: str, repo_id: str, target_hub: str, k: int = 5) -> str:
    """How to serve a published `family` head (the model card's Serving section)."""
    exports = FAMILY_EXPORTS.get(family)
    if exports is None or exports.serving is None:
        return f"{family} heads have no engine layout here; evaluate them with this project (`draftheads/`)."
    return exports.serving(repo_id, target_hub, k)


def layouts_of(family: str) -> tuple[str, ...]:
    """The engine layouts `family` exports to, its main one first; () for a native-only family."""
    exports = FAMILY_EXPORTS.get(family)
    return tuple(layout.format for layout in exports.layouts) if exports else ()
