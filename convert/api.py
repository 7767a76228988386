"""Export a native head folder to an engine layout, or import an engine layout into a native head.

    from convert import export_head, import_folder
    export_head("runs/quickstart/head", "speculators", "exports/vllm", target)
    head, cfg, provenance = import_folder("path/to/EAGLE3-folder", "sglang", target)

The family's converter (convert/<family>.py, found by convert/registry.py) maps names and builds the
config; everything is checked against the spec before and after writing (convert/folders.py).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

from convert.common import cast_floats, float_dtype_name, verifier_id
from convert.folders import check_out, read_folder, write_folder, write_head_folder
from convert.registry import EXPORT_FORMATS, FORMAT_FAMILIES, IMPORT_FORMATS, LAYOUTS
from convert.spec import FLOAT_DTYPES, ExportError, check_config, load_spec, validate
from heads import registry
from heads.base import FORMAT_VERSION, HeadConfig, HeadMismatchError, TargetIO, load_head


def build_export(
    head_dir: str | Path,
    fmt: str,
    target: TargetIO,
    verifier: str | None = None,
    speculative_tokens: int = 5,
    dtype: str | None = None,
) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, weights) of the export of a native head folder to `fmt`, validated against the spec."""
    if fmt not in LAYOUTS:
        raise ExportError(f"build_export: format must be one of {', '.join(EXPORT_FORMATS[1:])}, got '{fmt}'")
    head, cfg, meta = load_head(head_dir, target)
    if cfg.family not in FORMAT_FAMILIES[fmt]:
        raise ExportError(f"{head_dir}: a {cfg.family} head cannot be exported to {fmt} (holds {FORMAT_FAMILIES[fmt]})")
    why = LAYOUTS[fmt][1].refuses(dataclasses.asdict(cfg))
    if why:
        raise ExportError(f"{head_dir}: {why}")
    verifier = verifier or verifier_id(meta["target"].get("name_or_path") or target.name)
    config, weights = LAYOUTS[fmt][1].export(head, cfg, meta, target, verifier, speculative_tokens)
    weights = cast_floats(weights, dtype)
    config["torch_dtype"] = float_dtype_name(weights)
    validate(fmt, config, weights, target, where=f"{fmt} export of {head_dir}")
    return config, weights


def _export_native(head_dir: str | Path, out: Path, target: TargetIO, dtype: str | None, force: bool) -> Path:
    """A copy of a native head folder, checked (and cast to `dtype` when given)."""
    head, cfg, meta = load_head(head_dir, target)  # refuses a head made for another target
    check_config(load_spec("native"), meta, f"{head_dir}/config.json")
    check_out(out, force, (head_dir,))
    if dtype is not None:
        cast_floats({}, dtype)  # refuses an unknown dtype name
        head = head.to(FLOAT_DTYPES[dtype])  # Module.to(dtype) leaves the int/bool buffers alone
    return write_head_folder(out, head, cfg, target, meta.get("extra", {}), force, (head_dir,))


def export_head(
    head_dir: str | Path,
    fmt: str,
    out: str | Path,
    target: TargetIO,
    verifier: str | None = None,
    speculative_tokens: int = 5,
    dtype: str | None = None,
    force: bool = False,
) -> Path:
    """Export a native head folder to `out` in layout `fmt` ("native" copies and checks the folder)."""
    if fmt == "native":
        return _export_native(head_dir, Path(out), target, dtype, force)
    config, weights = build_export(head_dir, fmt, target, verifier, speculative_tokens, dtype)
    return write_folder(out, fmt, config, weights, force=force, target=target, inputs=(head_dir,))


def import_folder(folder: str | Path, fmt: str, target: TargetIO) -> tuple[nn.Module, HeadConfig, dict]:
    """Read a public checkpoint in layout `fmt` into a native head: (head, config, provenance)."""
    if fmt not in IMPORT_FORMATS:
        raise ExportError(f"import: format must be one of {', '.join(IMPORT_FORMATS)}, got '{fmt}'")
    folder = Path(folder)
    config, state = read_folder(folder, fmt)
    spec = load_spec(fmt)
    dropped = [k for k in spec.get("ignored_on_import", []) if k in state]
    # Engines overwrite these with the target's own tensors, so the native head never holds them.
    state = {k: v for k, v in state.items() if k not in dropped}
    validate(fmt, config, state, target, where=str(folder))
    where = str(folder)
    cfg, native = LAYOUTS[fmt][1].import_(config, state, target, where)
    head = registry.get(cfg.family).build(cfg, target)
    own = head.state_dict()
    missing, unexpected = sorted(set(own) - set(native)), sorted(set(native) - set(own))
    if missing or unexpected:
        raise HeadMismatchError(f"{where}: missing native keys {missing[:3]} / unexpected {unexpected[:3]}")
    for k, v in native.items():
        if tuple(v.shape) != tuple(own[k].shape):
            raise HeadMismatchError(f"{where}: {k} has shape {tuple(v.shape)}, this target's head needs {tuple(own[k].shape)}")
    dtype = next((v.dtype for v in native.values() if v.is_floating_point()), torch.float32)
    head = head.to(dtype)
    head.load_state_dict(native, strict=True)
    head.eval()
    provenance = {"imported_from": {"format": fmt, "path": str(folder), "dropped": dropped,
                                    "format_version": FORMAT_VERSION}}
    return head, cfg, provenance
