"""Export native head folders to serving-engine layouts, import public layouts back, validate both.

Formats (the written specification is `convert/formats/<name>.json`, explained in convert/formats/README.md):

    native       our own folder (config.json + model.safetensors), what eval and the decoder load
    speculators  vLLM's speculators layout for EAGLE-3 (layer ids = "input of layer i")
    sglang       SGLang's LlamaForCausalLMEagle3 layout (layer ids = "output of layer i", one less)
    medusa       the Medusa repository's medusa_lm_head.safetensors layout
    mtp          the DeepSeek-V3 MTP layout (`model.layers.{L+k}.*`), adapted to the target's decoder layer

Every exporter builds the whole folder in memory, checks its config keys, weight keys, shapes and dtypes
against the spec, writes to a temporary folder, checks the files read back from disk, then renames the
folder into place: an incomplete export (a missing `d2t`, say) is refused and never written. Importers
check a folder against the same spec and rebuild a native head through heads.registry, so a public
checkpoint can be evaluated here.

Modules: spec.py (the spec checker), folders.py (folder I/O), common.py (target/tensor helpers),
family.py (what a family declares), one converter module per family with engine layouts (eagle1.py,
eagle3.py, medusa.py, mtp.py; a native-only family needs none), registry.py (the declarations found by
scanning this package, no list; `served_by_vllm`), api.py (export_head, import_folder).
Layering: scripts -> train -> eval -> convert -> data -> heads; convert imports heads only. The command
line is scripts/export.py:

    python scripts/export.py --head runs/quickstart/head --to speculators --out exports/vllm
"""

from convert.api import build_export, export_head, import_folder
from convert.common import causal_lm_architecture, rope_fields, verifier_id
from convert.family import FamilyExports, Layout, VllmServing
from convert.folders import (
    check_out,
    check_replaceable,
    read_folder,
    validate_folder,
    write_folder,
    write_head_folder,
)
from convert.registry import (
    EXPORT_FORMATS,
    FORMAT_FAMILIES,
    IMPORT_FORMATS,
    layouts_of,
    served_by_vllm,
    serving_note,
)
from convert.spec import (
    FLOAT_DTYPES,
    SPEC_DIR,
    ExportError,
    check_config,
    eval_expr,
    expected_weights,
    load_spec,
    resolve_symbols,
    validate,
)

__all__ = [
    "EXPORT_FORMATS", "FLOAT_DTYPES", "FORMAT_FAMILIES", "IMPORT_FORMATS", "SPEC_DIR", "ExportError",
    "FamilyExports", "Layout", "VllmServing", "build_export", "causal_lm_architecture", "check_config",
    "check_out", "check_replaceable", "eval_expr", "expected_weights", "export_head", "import_folder",
    "layouts_of", "load_spec", "read_folder", "resolve_symbols", "rope_fields", "served_by_vllm", "serving_note", "validate",
    "validate_folder", "verifier_id", "write_folder", "write_head_folder",
]
