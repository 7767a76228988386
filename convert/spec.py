"""The spec checker: an export (config dict + weights) against the written specification of its format.

The specification of format F is `convert/formats/<format>.json` (how to read one: convert/formats/README.md).
Shape expressions are an integer or a symbol, or two of them joined by one of + - * // ("3 * TH",
"H // NH", "L + k"); a spec file names no code, so none is ever run. Library only:

    from convert.spec import validate
    env = validate("sglang", config, weights, target)   # ExportError naming the key, else the shape symbols
"""

from __future__ import annotations

import itertools
import json
import operator
import re
from pathlib import Path
from typing import Any

import torch

from heads import registry
from heads.base import HeadError, TargetIO

SPEC_DIR = Path(__file__).parent / "formats"
FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# An operand (integer or symbol, optionally negated), optionally followed by one operator and an operand.
_OPERAND = r"-?(?:\d+|[A-Za-z_]\w*)"
_EXPR = re.compile(rf"\s*({_OPERAND})\s*(?:(\+|-|\*|//)\s*({_OPERAND})\s*)?")
_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "//": operator.floordiv}


class ExportError(HeadError):
    """A folder or an in-memory export does not follow its format's specification; names file and key."""


def load_spec(fmt: str) -> dict:
    """The written specification of `fmt` (convert/formats/<fmt>.json)."""
    known = sorted(p.stem for p in SPEC_DIR.glob("*.json"))
    if fmt not in known:
        raise ExportError(f"unknown format '{fmt}' (known: {', '.join(known)})")
    return json.loads((SPEC_DIR / f"{fmt}.json").read_text())


def eval_expr(expr: str | int, env: dict[str, int], where: str = "spec") -> int:
    """Evaluate a shape expression ("3 * TH", "H // NH", "L + k") over integer symbols.

    Example: eval_expr("NH * D", {"NH": 4, "D": 16}) == 64. Anything but `operand [op operand]` is refused.
    """
    if isinstance(expr, int):
        return expr
    m = _EXPR.fullmatch(str(expr))
    if m is None:
        raise ExportError(f"{where}: shape expression '{expr}' is not integer arithmetic")

    def operand(token: str) -> int:
        name = token.removeprefix("-")
        if not name.isdigit() and name not in env:
            raise ExportError(f"{where}: shape expression '{expr}' uses unknown symbol '{name}'")
        value = int(name) if name.isdigit() else env[name]
        return -value if token.startswith("-") else value

    left = operand(m[1])
    return left if m[2] is None else _OPS[m[2]](left, operand(m[3]))


def get_dotted(config: dict, dotted: str) -> tuple[bool, Any]:
    """(found, value) of `a.b.c` in nested dicts."""
    cur: Any = config
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return False, None
        cur = cur[part]
    return True, cur


def _type_ok(value: Any, tp: str) -> bool:
    if tp == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if tp == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp == "str":
        return isinstance(value, str)
    if tp == "bool":
        return isinstance(value, bool)
    if tp == "dict":
        return isinstance(value, dict)
    if tp.startswith("list[") and tp.endswith("]"):
        return isinstance(value, list) and all(_type_ok(v, tp[5:-1]) for v in value)
    raise ExportError(f"spec: unknown type '{tp}'")


def _check_key(config: dict, key: str, rule: dict, value: Any, where: str) -> None:
    """One present config key against its rule (type, equals, one_of, head_family, min, lengths, items, in)."""
    tp = rule["type"]
    if not _type_ok(value, tp):
        raise ExportError(f"{where}: config key '{key}' must be {tp}, got {value!r}")
    if "equals" in rule and value != rule["equals"]:
        raise ExportError(f"{where}: config key '{key}' must be {rule['equals']!r}, got {value!r}")
    if "one_of" in rule and value not in rule["one_of"]:
        raise ExportError(f"{where}: config key '{key}' must be one of {rule['one_of']}, got {value!r}")
    if rule.get("head_family") and value not in registry.names():  # a family added later needs no spec edit
        raise ExportError(f"{where}: config key '{key}' must be one of {list(registry.names())}, got {value!r}")
    items = value if isinstance(value, list) else [value]
    if "min" in rule and any(v < rule["min"] for v in items):
        raise ExportError(f"{where}: config key '{key}' must be >= {rule['min']}, got {value!r}")
    if "length" in rule and len(value) != rule["length"]:
        raise ExportError(f"{where}: config key '{key}' must have {rule['length']} entries, got {value!r}")
    if "min_length" in rule and len(value) < rule["min_length"]:
        raise ExportError(f"{where}: config key '{key}' must have at least {rule['min_length']} entries")
    for i, item in enumerate(value if "items" in rule else []):
        for sub, sub_tp in rule["items"].items():
            if sub not in item:
                raise ExportError(f"{where}: config key '{key}[{i}]' lacks '{sub}'")
            if not _type_ok(item[sub], sub_tp):
                raise ExportError(f"{where}: config key '{key}[{i}].{sub}' must be {sub_tp}, got {item[sub]!r}")
    if "in" in rule:
        # "a.b[].c": the values of field c over the list of dicts at a.b
        list_key, field_name = rule["in"].split("[].")
        allowed = [m.get(field_name) for m in get_dotted(config, list_key)[1] or []]
        if value not in allowed:
            raise ExportError(f"{where}: config key '{key}' is {value!r} but must name one of {allowed}")


def check_config(spec: dict, config: dict, where: str) -> None:
    """Refuse a config that lacks a required key, has a wrong type or value, or holds a forbidden key."""
    for key, rule in spec["config"].items():
        found, value = get_dotted(config, key)
        if found:
            _check_key(config, key, rule, value, where)
        elif not rule.get("optional"):
            raise ExportError(f"{where}: config key '{key}' is required by the {spec['name']} format but missing")
    for key in spec.get("config_forbidden", []):
        if get_dotted(config, key)[0]:
            raise ExportError(f"{where}: config key '{key}' changes the engine's forward and must not be present")


def resolve_symbols(spec: dict, config: dict, target_config: Any = None, where: str = "") -> dict[str, int]:
    """Shape symbols from the config (an int key, or with `length: true` a list key's length; then the
    target's config, then the spec's default expression)."""
    env: dict[str, int] = {}
    for name, src in spec.get("symbols", {}).items():
        found, value = get_dotted(config, src["config"])
        if found and isinstance(value, list) and src.get("length"):  # a list key's length (DFlash's layer ids)
            env[name] = len(value)
        elif found and value is not None:
            env[name] = int(value)
        elif "target" in src and target_config is not None:
            env[name] = int(getattr(target_config, src["target"]))
        elif "default" in src:
            env[name] = eval_expr(src["default"], env, where)
        else:
            raise ExportError(f"{where}: config key '{src['config']}' is missing (needed for symbol {name})")
    return env


def _expand(pattern: str, spec: dict, env: dict[str, int], where: str) -> list[str]:
    """All keys a pattern names: {h}-style range variables iterate, other {expr} are evaluated.

    Example with ranges {"h": "K", "i": "N"}, K = 2, N = 1: "{h}.{N}.weight" -> ["0.1.weight", "1.1.weight"].
    """
    exprs = re.findall(r"\{([^}]*)\}", pattern)
    ranges = spec.get("ranges", {})
    used = sorted({v for e in exprs for v in re.findall(r"[A-Za-z_]\w*", e) if v in ranges})
    keys = []
    for values in itertools.product(*(range(eval_expr(ranges[v], env, where)) for v in used)):
        local = {**env, **dict(zip(used, values))}
        parts = re.split(r"\{([^}]*)\}", pattern)  # odd entries are the expressions between braces
        keys.append("".join(str(eval_expr(p, local, where)) if i % 2 else p for i, p in enumerate(parts)))
    return keys


def expected_weights(
    spec: dict, env: dict[str, int], block: dict[str, dict] | None = None, where: str = ""
) -> dict[str, dict]:
    """key -> {"shape": tuple, "dtype": str, "optional": bool} for every weight the spec names.

    `block` (MTP) holds the decoder block's own keys, placed under the spec's `block_prefix`.
    """
    out: dict[str, dict] = {}
    patterns = dict(spec["weights"])
    for sub, rule in (block or {}).items():
        patterns[spec["block_prefix"] + sub] = rule
    for pattern, rule in patterns.items():
        for key in _expand(pattern, spec, env, where):
            shape = tuple(eval_expr(e, env, where) for e in rule["shape"])
            out[key] = {"shape": shape, "dtype": rule["dtype"], "optional": bool(rule.get("optional"))}
    return out


def _dtype_ok(t: torch.Tensor, kind: str) -> bool:
    if kind == "float":
        return t.dtype in FLOAT_DTYPES.values()
    return str(t.dtype).replace("torch.", "") == kind


def check_weights(
    spec: dict, state: dict[str, torch.Tensor], env: dict[str, int], where: str, block: dict[str, dict] | None = None
) -> None:
    """Refuse missing, unexpected or forbidden keys, wrong shapes, wrong dtypes, mixed float dtypes."""
    want = expected_weights(spec, env, block, where)
    for key in spec.get("weights_forbidden", []):
        if key in state:
            raise ExportError(f"{where}: weight '{key}' must not be in a {spec['name']} checkpoint")
    for key, rule in want.items():
        if key not in state:
            if rule["optional"]:
                continue
            raise ExportError(f"{where}: weight '{key}' is missing ({spec['name']} format needs it)")
        t = state[key]
        if tuple(t.shape) != rule["shape"]:
            raise ExportError(f"{where}: weight '{key}' has shape {tuple(t.shape)}, the spec says {rule['shape']}")
        if not _dtype_ok(t, rule["dtype"]):
            raise ExportError(f"{where}: weight '{key}' has dtype {t.dtype}, the spec says {rule['dtype']}")
    unexpected = sorted(set(state) - set(want))
    if unexpected:
        # SGLang skips unknown keys silently: an unexpected key means a misnamed tensor that would not load.
        raise ExportError(f"{where}: unexpected weight '{unexpected[0]}' ({len(unexpected)} unexpected in all)")
    floats = {t.dtype for t in state.values() if t.dtype in FLOAT_DTYPES.values()}
    if len(floats) > 1:
        raise ExportError(f"{where}: float weights mix dtypes {sorted(map(str, floats))}")


def block_spec(spec: dict, model_type: str | None, target: TargetIO | None, where: str) -> dict[str, dict] | None:
    """The MTP decoder block's keys: from the spec for listed architectures, else the target's own layer."""
    if "block_weights" not in spec:
        return None
    if model_type in spec["block_weights"]:
        return spec["block_weights"][model_type]
    if target is None or target.last_layer is None:
        raise ExportError(f"{where}: model_type '{model_type}' has no block in the mtp spec; pass the target")
    return {k: {"shape": list(v.shape), "dtype": "float"} for k, v in target.last_layer.state_dict().items()}


def validate(
    fmt: str, config: dict, state: dict[str, torch.Tensor], target: TargetIO | None = None, where: str = ""
) -> dict[str, int]:
    """Check an export (config dict + weights) against the spec of `fmt`; returns the shape symbols."""
    spec = load_spec(fmt)
    where = where or f"{fmt} export"
    check_config(spec, config, where)
    env = resolve_symbols(spec, config, None if target is None else target.config, where)
    block = block_spec(spec, config.get("model_type"), target, where)
    check_weights(spec, state, env, where, block)
    return env
