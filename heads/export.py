"""Export native head folders to serving-engine layouts, import public layouts back, validate both.

Formats (the written specification is `heads/formats/<name>.json`, explained in heads/formats/README.md):

    native       our own folder (config.json + model.safetensors), what eval and the decoder load
    speculators  vLLM's speculators layout for EAGLE-3 (layer ids = "input of layer i")
    sglang       SGLang's LlamaForCausalLMEagle3 layout (layer ids = "output of layer i", one less)
    medusa       the Medusa repository's medusa_lm_head.safetensors layout
    mtp          the DeepSeek-V3 MTP layout (`model.layers.{L+k}.*`), adapted to the target's decoder layer

Every exporter builds the whole folder in memory, checks its config keys, weight keys, shapes and dtypes
against the spec, writes to a temporary folder, checks the files read back from disk, then renames the
folder into place: an incomplete export (a missing `d2t`, say) is refused and never written. Importers
(speculators, sglang, medusa, mtp) check a folder against the same spec and rebuild a native head through
the family module, so a public checkpoint can be evaluated here.

Library only (heads may not import data or eval); the command line is scripts/export.py:

    python scripts/export.py --head runs/quickstart/head --to speculators --out exports/vllm
"""

from __future__ import annotations

import ast
import itertools
import json
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from heads.base import (
    FORMAT_VERSION,
    HeadConfig,
    HeadError,
    HeadMismatchError,
    TargetIO,
    check_finite,
    family_module,
    load_head,
    read_head_config,
    save_head,
)

SPEC_DIR = Path(__file__).parent / "formats"
EXPORT_FORMATS = ("native", "speculators", "sglang", "medusa", "mtp")
IMPORT_FORMATS = ("speculators", "sglang", "medusa", "mtp")
# Which native families each engine layout can hold.
FORMAT_FAMILIES = {"speculators": ("eagle3",), "sglang": ("eagle3",), "medusa": ("medusa",), "mtp": ("mtp",)}
# Named default targets -> their Hub ids, written as the verifier / base model of an export.
HUB_IDS = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct"}
SPECULATORS_VERSION = "0.1.0"
FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ExportError(HeadError):
    """A folder or an in-memory export does not follow its format's specification; names file and key."""


# ------------------------------------------------------------------------------------------------ spec
def load_spec(fmt: str) -> dict:
    """The written specification of `fmt` (heads/formats/<fmt>.json)."""
    if fmt not in EXPORT_FORMATS:
        raise ExportError(f"unknown format '{fmt}' (known: {', '.join(EXPORT_FORMATS)})")
    return json.loads((SPEC_DIR / f"{fmt}.json").read_text())


def eval_expr(expr: str | int, env: dict[str, int], where: str = "spec") -> int:
    """Evaluate a shape expression ("3 * TH", "H // NH", "L + k") over integer symbols.

    Only integer literals, names from `env`, unary minus and + - * // are allowed, so a spec file cannot
    run code. Example: eval_expr("NH * D", {"NH": 4, "D": 16}) == 64.
    """
    if isinstance(expr, int):
        return expr

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name):
            if node.id not in env:
                raise ExportError(f"{where}: shape expression '{expr}' uses unknown symbol '{node.id}'")
            return env[node.id]
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if isinstance(node, ast.BinOp):
            ops = {ast.Add: int.__add__, ast.Sub: int.__sub__, ast.Mult: int.__mul__, ast.FloorDiv: int.__floordiv__}
            if type(node.op) in ops:
                return ops[type(node.op)](ev(node.left), ev(node.right))
        raise ExportError(f"{where}: shape expression '{expr}' is not integer arithmetic")

    return ev(ast.parse(str(expr), mode="eval"))


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


def check_config(spec: dict, config: dict, where: str) -> None:
    """Refuse a config that lacks a required key, has a wrong type or value, or holds a forbidden key."""
    for key, rule in spec["config"].items():
        found, value = get_dotted(config, key)
        if not found:
            if rule.get("optional"):
                continue
            raise ExportError(f"{where}: config key '{key}' is required by the {spec['name']} format but missing")
        tp = rule["type"]
        if not _type_ok(value, tp):
            raise ExportError(f"{where}: config key '{key}' must be {tp}, got {value!r}")
        if "equals" in rule and value != rule["equals"]:
            raise ExportError(f"{where}: config key '{key}' must be {rule['equals']!r}, got {value!r}")
        if "one_of" in rule and value not in rule["one_of"]:
            raise ExportError(f"{where}: config key '{key}' must be one of {rule['one_of']}, got {value!r}")
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
    for key in spec.get("config_forbidden", []):
        if get_dotted(config, key)[0]:
            raise ExportError(f"{where}: config key '{key}' changes the engine's forward and must not be present")


def resolve_symbols(spec: dict, config: dict, target_config: Any = None, where: str = "") -> dict[str, int]:
    """Shape symbols from the config (then the target's config, then the spec's default expression)."""
    env: dict[str, int] = {}
    for name, src in spec.get("symbols", {}).items():
        found, value = get_dotted(config, src["config"])
        if found and value is not None:
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


def read_folder(folder: str | Path, fmt: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, weights) of a folder in layout `fmt`; safetensors only (pickled .bin/.pt files are refused)."""
    folder = Path(folder)
    spec = load_spec(fmt)
    cfg_path, w_path = folder / spec["files"]["config"], folder / spec["files"]["weights"]
    if not cfg_path.is_file():
        raise ExportError(f"{cfg_path}: missing ({fmt} format)")
    if not w_path.is_file():
        pickles = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
        hint = f" (found {pickles[0]}: pickled weights are not loaded; convert them to safetensors)" if pickles else ""
        raise ExportError(f"{w_path}: missing ({fmt} format){hint}")
    try:
        config = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ExportError(f"{cfg_path}: invalid JSON ({e})") from None
    try:
        state = load_file(str(w_path))
    except Exception as e:  # safetensors raises its own error types for truncated files
        raise ExportError(f"{w_path}: unreadable or truncated ({e})") from None
    check_finite(state, str(w_path))
    return config, state


def validate_folder(folder: str | Path, fmt: str, target: TargetIO | None = None) -> dict[str, int]:
    """Read a folder and check it against the spec of `fmt` (native folders go through load_head)."""
    folder = Path(folder)
    if fmt == "native":
        _, meta = read_head_config(folder)
        check_config(load_spec("native"), meta, str(folder / "config.json"))
        if target is not None:
            load_head(folder, target)
        return {}
    config, state = read_folder(folder, fmt)
    return validate(fmt, config, state, target, where=str(folder))


# ------------------------------------------------------------------------------------------------ helpers
def verifier_id(name: str) -> str:
    """The Hub id engines should load for a target name (named defaults map to their Hub repository)."""
    return HUB_IDS.get(name, name)


def causal_lm_architecture(config: Any) -> list[str]:
    """The target's `architectures` entry (its config's own, else transformers' class for the model type)."""
    if getattr(config, "architectures", None):
        return list(config.architectures)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    if name is None:
        raise ExportError(f"cannot name the causal-LM architecture of model_type '{config.model_type}'")
    return [name]


def rope_fields(config: Any) -> dict:
    """The target's RoPE settings written the way engines read them (rope_theta, rope_scaling) and the way
    transformers >= 5 writes them (rope_parameters); the draft layer must rotate exactly like the target."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling = None if params.get("rope_type", "default") == "default" else dict(params)
        return {"rope_theta": theta, "rope_scaling": scaling, "rope_parameters": dict(params)}
    theta = float(getattr(config, "rope_theta", 10000.0))
    return {"rope_theta": theta, "rope_scaling": getattr(config, "rope_scaling", None)}


def _cast(state: dict[str, torch.Tensor], dtype: str | None) -> dict[str, torch.Tensor]:
    """Float tensors to `dtype` (None keeps them); integer and bool buffers (d2t, t2d) never change."""
    if dtype is None:
        return state
    if dtype not in FLOAT_DTYPES:
        raise ExportError(f"dtype '{dtype}' is not one of {', '.join(FLOAT_DTYPES)}")
    return {k: v.to(FLOAT_DTYPES[dtype]) if v.is_floating_point() else v for k, v in state.items()}


def _state(head: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()}


def _float_dtype_name(state: dict[str, torch.Tensor]) -> str:
    for v in state.values():
        if v.is_floating_point():
            return str(v.dtype).replace("torch.", "")
    return "float32"


# ------------------------------------------------------------------------------------------------ EAGLE-3
EAGLE3_PREFIX = {"sglang": "midlayer.", "speculators": "layers.0."}


def _eagle3_layer_config(head: nn.Module, cfg: HeadConfig, target: TargetIO) -> dict:
    """The draft decoder layer as a Llama config dict (one layer; RoPE and eps copied from the target)."""
    tc = target.config
    state = head.state_dict()
    H = target.hidden_size
    n_heads = int(tc.num_attention_heads)
    head_dim = int(state["midlayer.self_attn.q_proj.weight"].shape[0]) // n_heads
    inter = int(state["midlayer.mlp.gate_proj.weight"].shape[0])
    n_kv = int(state["midlayer.self_attn.k_proj.weight"].shape[0]) // head_dim
    act = getattr(tc, "hidden_act", "silu")
    if act != "silu":
        # vLLM's and SGLang's Llama MLP only implement SiLU: the draft layer would compute another function.
        raise ExportError(f"target hidden_act is '{act}': the engines' EAGLE-3 draft layer (Llama MLP) needs silu")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": H,
        "intermediate_size": inter,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(getattr(tc, "rms_norm_eps", 1e-6)),
        "vocab_size": target.vocab_size,
        "max_position_embeddings": int(getattr(tc, "max_position_embeddings", 4096)),
        **rope_fields(tc),
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": getattr(tc, "bos_token_id", None),
        "eos_token_id": getattr(tc, "eos_token_id", None),
    }


def _eagle3_layer_ids(meta: dict, target: TargetIO, fmt: str) -> list[int]:
    """The captured layers in `fmt`'s convention.

    Native layer_ids are transformers hidden_states indices = "input of decoder layer i" = vLLM's reading.
    SGLang reads eagle_aux_hidden_state_layer_ids as "output of layer i" and adds 1, so its value is i - 1.
    Example (Llama-3.1-8B, L = 32): native [2, 16, 29] -> speculators [2, 16, 29], sglang [1, 15, 28].
    Engines capture only decoder-layer inputs, so valid native ids are 1..L-1 (0 is the embedding output,
    which they do not capture; L is after the final norm).
    """
    ids = [int(i) for i in meta["layer_ids"]]
    bad = [i for i in ids if not 1 <= i <= target.num_layers - 1]
    if bad:
        raise ExportError(
            f"layer id {bad[0]} cannot be served: engines capture decoder-layer inputs 1..{target.num_layers - 1}"
        )
    return [i - 1 for i in ids] if fmt == "sglang" else ids


def _export_eagle3(head, cfg, meta, target, fmt, verifier, speculative_tokens):
    state = _state(head)
    layer = _eagle3_layer_config(head, cfg, target)
    ids = _eagle3_layer_ids(meta, target, fmt)
    draft_vocab = int(state["lm_head.weight"].shape[0])
    prefix = EAGLE3_PREFIX[fmt]
    weights = {(prefix + k[len("midlayer."):]) if k.startswith("midlayer.") else k: v for k, v in state.items()}
    if fmt == "sglang":
        config = {
            **layer,
            "architectures": ["LlamaForCausalLMEagle3"],
            "draft_vocab_size": draft_vocab,
            "target_hidden_size": target.hidden_size,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
        }
    else:
        config = {
            "speculators_model_type": "eagle3",
            "speculators_version": SPECULATORS_VERSION,
            "architectures": ["Eagle3Speculator"],
            "transformer_layer_config": layer,
            "draft_vocab_size": draft_vocab,
            "target_hidden_size": target.hidden_size,
            "eagle_aux_hidden_state_layer_ids": ids,
            # vLLM's speculators loader defaults this to True when absent; our forward is the False one.
            "norm_before_residual": False,
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [
                    {"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens),
                     "verifier_accept_k": 1, "accept_tolerance": 0.0}
                ],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": verifier, "architectures": causal_lm_architecture(target.config)},
            },
        }
    return config, weights


def _import_eagle3(config: dict, state: dict[str, torch.Tensor], fmt: str, target: TargetIO, where: str):
    """An EAGLE-3 config + weights in `fmt` -> (Eagle3Config, native state dict)."""
    mod = family_module("eagle3")
    layer = config["transformer_layer_config"] if fmt == "speculators" else config
    if fmt == "sglang":
        raw_ids = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        ids = [int(i) + 1 for i in raw_ids]  # SGLang's "output of layer i" -> hidden_states index i + 1
    else:
        ids = [int(i) for i in config["eagle_aux_hidden_state_layer_ids"]]
    for key, have in (("hidden_size", target.hidden_size), ("vocab_size", target.vocab_size)):
        if int(layer[key]) != have:
            raise HeadMismatchError(f"{where}: {key} is {layer[key]} but the target has {have}")
    th = int(config.get("target_hidden_size") or layer["hidden_size"])
    if th != target.hidden_size:
        raise HeadMismatchError(f"{where}: target_hidden_size is {th} but the target has {target.hidden_size}")
    # The native head takes these from the target (heads/eagle.py DecoderLayer): refuse a checkpoint whose
    # draft layer was built differently, since its weights would load but compute another function.
    tc = target.config
    n_heads = int(tc.num_attention_heads)
    for key, want in (
        ("num_attention_heads", n_heads),
        ("head_dim", int(getattr(tc, "head_dim", None) or target.hidden_size // n_heads)),
        ("rms_norm_eps", float(getattr(tc, "rms_norm_eps", 1e-6))),
        ("hidden_act", "silu"),
    ):
        if key in layer and layer[key] != want and not (isinstance(want, float) and abs(layer[key] - want) < 1e-12):
            raise HeadMismatchError(f"{where}: {key} is {layer[key]!r} but this project's head uses {want!r}")
    theta = rope_fields(target.config)["rope_theta"]
    if "rope_theta" in layer and float(layer["rope_theta"]) != theta:
        raise HeadMismatchError(f"{where}: rope_theta is {layer['rope_theta']} but the target's is {theta}")
    inter = int(layer["intermediate_size"])
    cfg = mod.CONFIGS["eagle3"](
        layer_ids=ids,
        draft_vocab_size=int(config["draft_vocab_size"]),
        # null = "the target's width", as a natively trained head records it
        intermediate_size=None if inter == int(tc.intermediate_size) else inter,
    )
    prefix = EAGLE3_PREFIX[fmt]
    native = {("midlayer." + k[len(prefix):]) if k.startswith(prefix) else k: v for k, v in state.items()}
    return cfg, native


# ------------------------------------------------------------------------------------------------ Medusa
MEDUSA_BLOCK = re.compile(r"^blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)$")
MEDUSA_HEAD = re.compile(r"^lm_heads\.(\d+)\.weight$")


def _export_medusa(head, cfg, meta, target, verifier):
    """Native `blocks.{h}.layers.{i}.*` -> `{h}.{i}.linear.*`, `lm_heads.{h}.weight` -> `{h}.{N}.weight`."""
    n = int(cfg.num_layers)
    weights = {}
    for k, v in _state(head).items():
        if m := MEDUSA_BLOCK.match(k):
            weights[f"{m[1]}.{m[2]}.linear.{m[3]}"] = v
        elif m := MEDUSA_HEAD.match(k):
            weights[f"{m[1]}.{n}.weight"] = v
        else:
            raise ExportError(f"medusa head: parameter '{k}' has no place in the Medusa layout")
    config = {
        "medusa_num_heads": int(cfg.num_heads),
        "medusa_num_layers": n,
        "base_model_name_or_path": verifier,
        "hidden_size": target.hidden_size,
        "vocab_size": target.vocab_size,
    }
    return config, weights


def _import_medusa(config: dict, state: dict[str, torch.Tensor], target: TargetIO, where: str):
    cfg = family_module("medusa").CONFIGS["medusa"](
        num_heads=int(config["medusa_num_heads"]), num_layers=int(config["medusa_num_layers"])
    )
    n = cfg.num_layers
    native = {}
    for k, v in state.items():
        h, i, rest = k.split(".", 2)
        if int(i) == n:
            native[f"lm_heads.{h}.weight"] = v
        else:
            native[f"blocks.{h}.layers.{i}.{rest.removeprefix('linear.')}"] = v
    return cfg, native


# ------------------------------------------------------------------------------------------------ MTP
def _export_mtp(head, cfg, meta, target):
    """Native `mtp.{k}.*` -> `model.layers.{L+k}.*`; the target's embedding and lm_head are copied in.

    Mapping per module k (L = the target's num_hidden_layers): enorm/hnorm/eh_proj keep their names,
    `mtp.{k}.block.X` -> `model.layers.{L+k}.X` (the decoder layer's own names), `mtp.{k}.norm.weight` ->
    `model.layers.{L+k}.shared_head.norm.weight`; `shared_head.head.weight` = the target's lm_head and
    `embed_tokens.weight` = the target's embedding, as in DeepSeek-V3's checkpoint.
    """
    L = target.num_layers
    state = _state(head)
    dtype = state["mtp.0.eh_proj.weight"].dtype
    emb = target.embed.weight.detach().cpu().to(dtype).contiguous()
    lm = target.lm_head.weight.detach().cpu().to(dtype).contiguous()
    weights: dict[str, torch.Tensor] = {}
    n_modules = 1 + max(int(k.split(".")[1]) for k in state)
    for k, v in state.items():
        _, idx, rest = k.split(".", 2)
        p = f"model.layers.{L + int(idx)}."
        if rest.startswith("block."):
            weights[p + rest[len("block."):]] = v
        elif rest == "norm.weight":
            weights[p + "shared_head.norm.weight"] = v
        elif rest.split(".")[0] in ("enorm", "hnorm", "eh_proj"):
            weights[p + rest] = v
        else:
            raise ExportError(f"mtp head: parameter '{k}' has no place in the DeepSeek MTP layout")
    for idx in range(n_modules):
        weights[f"model.layers.{L + idx}.embed_tokens.weight"] = emb.clone()  # safetensors refuses shared storage
        weights[f"model.layers.{L + idx}.shared_head.head.weight"] = lm.clone()
    config = {k: v for k, v in target.config.to_dict().items() if not k.startswith("_")}
    config.update(
        architectures=causal_lm_architecture(target.config),
        num_nextn_predict_layers=n_modules,
        draftheads_mtp={"recursive": bool(cfg.recursive), "num_steps": int(cfg.num_steps)},
    )
    return config, weights


def _import_mtp(config: dict, state: dict[str, torch.Tensor], target: TargetIO, where: str):
    L, K = int(config["num_hidden_layers"]), int(config["num_nextn_predict_layers"])
    if L != target.num_layers:
        raise HeadMismatchError(f"{where}: num_hidden_layers is {L} but the target has {target.num_layers}")
    extra = config.get("draftheads_mtp", {})
    cfg = family_module("mtp").CONFIGS["mtp"](
        num_modules=K, recursive=bool(extra.get("recursive", False)), num_steps=int(extra.get("num_steps", 3))
    )
    if cfg.recursive and K != 1:
        raise ExportError(f"{where}: draftheads_mtp.recursive needs num_nextn_predict_layers 1, got {K}")
    # The native head uses the target's embedding and lm_head: a checkpoint holding other tensors there
    # would decode differently here than in the engine, so it is refused rather than silently replaced.
    for k in range(K):
        p = f"model.layers.{L + k}."
        for name, own in (("embed_tokens.weight", target.embed.weight), ("shared_head.head.weight", target.lm_head.weight)):
            w = state[p + name]
            if not torch.equal(w, own.detach().cpu().to(w.dtype)):
                raise HeadMismatchError(f"{where}: {p}{name} differs from the target's (not made for this target)")
    native = {}
    for key, v in state.items():
        m = re.match(r"^model\.layers\.(\d+)\.(.*)$", key)
        idx, rest = int(m[1]) - L, m[2]
        if rest in ("embed_tokens.weight", "shared_head.head.weight"):
            continue
        if rest == "shared_head.norm.weight":
            native[f"mtp.{idx}.norm.weight"] = v
        elif rest.split(".")[0] in ("enorm", "hnorm", "eh_proj"):
            native[f"mtp.{idx}.{rest}"] = v
        else:
            native[f"mtp.{idx}.block.{rest}"] = v
    return cfg, native


# ------------------------------------------------------------------------------------------------ entry points
def build_export(
    head_dir: str | Path,
    fmt: str,
    target: TargetIO,
    verifier: str | None = None,
    speculative_tokens: int = 5,
    dtype: str | None = None,
) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, weights) of the export of a native head folder to `fmt`, validated against the spec."""
    if fmt == "native" or fmt not in EXPORT_FORMATS:
        raise ExportError(f"build_export: format must be one of {', '.join(EXPORT_FORMATS[1:])}, got '{fmt}'")
    head, cfg, meta = load_head(head_dir, target)
    if cfg.family not in FORMAT_FAMILIES[fmt]:
        raise ExportError(f"{head_dir}: a {cfg.family} head cannot be exported to {fmt} (holds {FORMAT_FAMILIES[fmt]})")
    verifier = verifier or verifier_id(meta["target"].get("name_or_path") or target.name)
    if fmt in ("speculators", "sglang"):
        config, weights = _export_eagle3(head, cfg, meta, target, fmt, verifier, speculative_tokens)
    elif fmt == "medusa":
        config, weights = _export_medusa(head, cfg, meta, target, verifier)
    else:
        config, weights = _export_mtp(head, cfg, meta, target)
    weights = _cast(weights, dtype)
    config["torch_dtype"] = _float_dtype_name(weights)
    validate(fmt, config, weights, target, where=f"{fmt} export of {head_dir}")
    return config, weights


def _protected_kind(folder: Path) -> str | None:
    """What `folder` is when it must never be replaced: a run folder, a head folder or a feature store."""
    if (folder / "checkpoints").is_dir() or (folder / "metrics.jsonl").is_file() or \
            (folder / "progress.json").is_file():
        return "a run folder"
    cfg = folder / "config.json"
    if cfg.is_file():
        try:
            if json.loads(cfg.read_text()).get("format") == "draftheads":
                return "a head folder"
        except (ValueError, OSError, AttributeError):
            pass
    if (folder / "manifest.json").is_file() or (folder / "store.json").is_file():
        return "a feature store"
    return None


def check_replaceable(out: str | Path, inputs: tuple[str | Path, ...] = ()) -> None:
    """Refuse (ExportError) to replace `out` when it is, contains or lies inside a run folder, a head folder,
    a feature store or one of `inputs` (--force must never delete training results or the source)."""
    o = Path(out).resolve()
    for inp in inputs:
        i = Path(inp).resolve()
        if o == i or i in o.parents or o in i.parents:
            raise ExportError(f"{out}: --force would replace {inp}, the input of this command (choose another --out)")
    for d in (o, *o.parents):
        kind = _protected_kind(d)
        if kind:
            where = "is" if d == o else f"lies inside {d}, which is"
            raise ExportError(f"{out}: refusing to replace it: it {where} {kind} (choose a new --out)")
    if o.is_dir():
        for d in o.rglob("*"):
            kind = _protected_kind(d) if d.is_dir() else None
            if kind:
                raise ExportError(f"{out}: refusing to replace it: it contains {d}, {kind} (choose a new --out)")


def write_folder(out: str | Path, fmt: str, config: dict, weights: dict[str, torch.Tensor], force: bool = False,
                 target: TargetIO | None = None, inputs: tuple[str | Path, ...] = ()) -> Path:
    """Write a validated export to `out` via a fresh temporary folder, re-checking the files read back.

    An existing non-empty `out` is replaced only with `force`, and never when check_replaceable refuses it."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        if not force:
            raise ExportError(f"{out}: exists and is not empty (pass force=True / --force to replace it)")
        check_replaceable(out, inputs)
    spec = load_spec(fmt)
    validate(fmt, config, weights, target, where=f"{fmt} export to {out}")  # nothing is written if this fails
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-export-", dir=out.parent))  # ours alone
    try:
        save_file(weights, str(tmp / spec["files"]["weights"]), metadata={"format": "pt"})
        (tmp / spec["files"]["config"]).write_text(json.dumps(config, indent=2) + "\n")
        validate_folder(tmp, fmt, target)  # what engines will read: the files, not our in-memory copy
    except Exception:
        shutil.rmtree(tmp)
        raise
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


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
    """Export a native head folder to `out` in layout `fmt` (see the module docstring)."""
    if fmt == "native":
        head, cfg, meta = load_head(head_dir, target)  # refuses a head made for another target
        check_config(load_spec("native"), meta, f"{head_dir}/config.json")
        out = Path(out)
        if out.exists() and any(out.iterdir()):
            if not force:
                raise ExportError(f"{out}: exists and is not empty (pass force=True / --force to replace it)")
            check_replaceable(out, (head_dir,))
        if dtype is not None:
            _cast({}, dtype)  # refuses an unknown dtype name
            head = head.to(FLOAT_DTYPES[dtype])  # Module.to(dtype) leaves the int/bool buffers alone
        save_head(out, head, cfg, target, extra=meta.get("extra", {}))
        validate_folder(out, "native", target)
        return out
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
    if fmt in ("speculators", "sglang"):
        cfg, native = _import_eagle3(config, state, fmt, target, where)
    elif fmt == "medusa":
        cfg, native = _import_medusa(config, state, target, where)
    else:
        cfg, native = _import_mtp(config, state, target, where)
    mod = family_module(cfg.family)
    head = mod.build(cfg, target)
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
