"""Every family's export declaration (convert/<family>.py EXPORTS), and the questions others ask of them.

    served_by_vllm("eagle3")   # (VllmServing(format="speculators", method="eagle3"), "")
    served_by_vllm("medusa")   # (None, "exported in the Medusa repository's layout; ...")
    layouts_of("eagle3")       # ("speculators", "sglang"): the first is the main one
    layouts_of("dflash", cfg)  # those a head with this head_config exports to (DFlash's or DSpark's)

The declarations are found, not listed: every module of the `convert` package that defines a module-level
`EXPORTS` (a FamilyExports) is one, so a family with an engine layout adds only its convert/<family>.py.
A native-only family needs no module here at all: it exports to `native` (the head folder, checked by
convert/formats/native.json and heads.base.load_head), and served_by_vllm gives NATIVE_ONLY as the reason
vLLM does not serve it. A module that declares EXPORTS must not import this one (this module imports it
while being imported itself). tests/test_export.py checks that every declared family is a registered one
(heads.registry).
"""

from __future__ import annotations

import importlib
import pkgutil

import convert
from convert.family import FamilyExports, Layout, VllmServing

# Why vLLM does not serve a family that declares no exports (eval/vllm_engine.py prints it).
NATIVE_ONLY = "it is native only (no convert/<family>.py declares an engine layout for it)"


def _declared() -> dict[str, FamilyExports]:
    """family -> EXPORTS of every convert module that has one, in module-name order. Modules being imported
    right now (the package itself, convert.api, this one) come back from sys.modules as they are."""
    found: dict[str, FamilyExports] = {}
    for info in pkgutil.iter_modules(convert.__path__, "convert."):
        exports = getattr(importlib.import_module(info.name), "EXPORTS", None)
        if isinstance(exports, FamilyExports):
            if exports.family in found:
                raise ValueError(f"{info.name}: family '{exports.family}' declares its exports twice")
            found[exports.family] = exports
    return found


FAMILY_EXPORTS: dict[str, FamilyExports] = _declared()
# format -> (family, layout), in declaration order
LAYOUTS: dict[str, tuple[str, Layout]] = {
    layout.format: (e.family, layout) for e in FAMILY_EXPORTS.values() for layout in e.layouts
}
IMPORT_FORMATS = tuple(LAYOUTS)
EXPORT_FORMATS = ("native", *IMPORT_FORMATS)
# Which native families each engine layout can hold.
FORMAT_FAMILIES = {fmt: (family,) for fmt, (family, _) in LAYOUTS.items()}


def served_by_vllm(family: str) -> tuple[VllmServing | None, str]:
    """(how vLLM serves `family`, or None, and then why not: NATIVE_ONLY for a family nobody declared)."""
    exports = FAMILY_EXPORTS.get(family)
    if exports is None:
        return None, NATIVE_ONLY
    return exports.vllm, exports.not_served


def serving_note(family: str, repo_id: str, target_hub: str, k: int = 5, head_config: dict | None = None) -> str:
    """How to serve a published `family` head (the model card's Serving section): from the layouts the upload
    holds, `layouts_of(family, head_config)` (scripts/publish.py stages those; a DFlash head with a Markov head:
    DSpark's; an EAGLE-3 head with norm_before_residual: no sglang/)."""
    exports = FAMILY_EXPORTS.get(family)
    if exports is None or exports.serving is None:
        return f"{family} heads have no engine layout here; evaluate them with this project (`draftheads/`)."
    return exports.serving(repo_id, target_hub, k, layouts_of(family, head_config))


def layouts_of(family: str, head_config: dict | None = None) -> tuple[str, ...]:
    """The engine layouts `family` exports to, its main one first; () for a native-only family. With
    `head_config` (a native config.json's `head_config`), only the layouts that head can be exported to."""
    exports = FAMILY_EXPORTS.get(family)
    return tuple(layout.format for layout in exports.layouts
                 if head_config is None or layout.applies(head_config)) if exports else ()
