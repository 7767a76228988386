"""What every converter reads from the target and the head: Hub ids, architecture, RoPE fields, tensors.

Library only (the converters in convert/<family>.py use it); nothing here knows a format.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from convert.spec import FLOAT_DTYPES, ExportError
from heads.types import TargetIO

# Named default targets -> their Hub ids, written as the verifier / base model of an export.
HUB_IDS = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct"}


def verifier_id(name: str) -> str:
    """The Hub id engines should load for a target name (named defaults map to their Hub repository)."""
    return HUB_IDS.get(name, name)


def causal_lm_architecture(config: Any) -> list[str]:
    """The target's `architectures` entry (its config's own, else transformers' class for the model type)."""
    if getattr(config, "architectures", None):
        return list(config.architectures)
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


def cast_floats(state: dict[str, torch.Tensor], dtype: str | None) -> dict[str, torch.Tensor]:
    """Float tensors to `dtype` (None keeps them); integer and bool buffers (d2t, t2d) never change."""
    if dtype is None:
        return state
    if dtype not in FLOAT_DTYPES:
        raise ExportError(f"dtype '{dtype}' is not one of {', '.join(FLOAT_DTYPES)}")
    return {k: v.to(FLOAT_DTYPES[dtype]) if v.is_floating_point() else v for k, v in state.items()}


def head_state(head: nn.Module) -> dict[str, torch.Tensor]:
    """The head's state dict on the CPU, each tensor contiguous (safetensors writes only those)."""
    return {k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()}


def float_dtype_name(state: dict[str, torch.Tensor]) -> str:
    """The dtype of the first float tensor ("float32" without any), as config.json's torch_dtype."""
    for v in state.values():
        if v.is_floating_point():
            return str(v.dtype).replace("torch.", "")
    return "float32"


def served_layer_ids(meta: dict, target: TargetIO) -> list[int]:
    """The captured layers in vLLM's convention ("input of decoder layer i"), which is the native one.

    Native layer_ids are transformers hidden_states indices = "input of decoder layer i" = vLLM's reading;
    SGLang's value is one less (export_sglang). Example (Llama-3.1-8B, L = 32): native [2, 16, 29] ->
    speculators [2, 16, 29], sglang [1, 15, 28]. Engines capture only decoder-layer inputs, so valid native
    ids are 1..L-1 (0 is the embedding output, which they do not capture; L is after the final norm).
    """
    ids = [int(i) for i in meta["layer_ids"]]
    bad = [i for i in ids if not 1 <= i <= target.num_layers - 1]
    if bad:
        raise ExportError(
            f"layer id {bad[0]} cannot be served: engines capture decoder-layer inputs 1..{target.num_layers - 1}"
        )
    return ids


def layer_config_fields(tc: Any, vocab_size: int) -> dict[str, Any]:
    """The fields every engine's draft-layer config copies from the target (activation, eps, vocab, positions,
    RoPE) plus the ones no draft layer here has (attention bias, tied embeddings)."""
    return {
        "hidden_act": "silu",
        "rms_norm_eps": float(getattr(tc, "rms_norm_eps", 1e-6)),
        "vocab_size": vocab_size,
        "max_position_embeddings": int(getattr(tc, "max_position_embeddings", 4096)),
        **rope_fields(tc),
        "attention_bias": False,
        "tie_word_embeddings": False,
    }
