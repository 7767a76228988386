"""DFlash heads <-> vLLM's speculators DFlash layout (`speculators_model_type: dflash`).

vLLM reads this layout through its speculators config translation (`update_dflash`: architectures
DFlashDraftModel, `eagle_aux_hidden_state_layer_ids` = our layer ids, `dflash_config {mask_token_id,
target_layer_ids = ids - 1}`) into `qwen3_dflash.py`, whose forward is heads/dflash's (the equations in
heads/dflash/__init__.py). The native weight names ARE the layout's (fc, hidden_norm, layers.{l}.*, norm,
lm_head, d2t, t2d), so export and import only translate the config; vLLM drops `t2d` and renames `d2t`.

The draft layers are described as a Qwen3 config (`transformer_layer_config`, model_type qwen3: the engines'
DFlash layer is Qwen3-style, with q_norm/k_norm) sized like the target, RoPE copied from it. The proposal
length is always block_size - 1: the block the drafter was trained on is [anchor, mask x (B-1)], and a
shorter served block would attend over fewer mask slots, another function.
"""

from __future__ import annotations

import torch
from torch import nn

from convert.common import (
    causal_lm_architecture,
    head_state,
    layer_config_fields,
    rope_fields,
    served_layer_ids,
)
from convert.family import FamilyExports, Layout, VllmServing
from convert.spec import ExportError
from heads import registry
from heads.base import HeadConfig, HeadMismatchError, TargetIO

SPECULATORS_VERSION = "0.1.0"


def layer_config(head: nn.Module, target: TargetIO) -> dict:
    """The draft layers as a Qwen3 config dict (RoPE, eps, sizes from the target and the head's tensors)."""
    tc = target.config
    state = head.state_dict()
    n_heads = int(tc.num_attention_heads)
    head_dim = int(state["layers.0.self_attn.q_norm.weight"].shape[0])
    act = getattr(tc, "hidden_act", "silu")
    if act != "silu":
        raise ExportError(f"target hidden_act is '{act}': vLLM's DFlash layer (Qwen3 MLP) needs silu")
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "num_hidden_layers": len(head.layers),
        "hidden_size": target.hidden_size,
        "intermediate_size": int(state["layers.0.mlp.gate_proj.weight"].shape[0]),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(state["layers.0.self_attn.k_proj.weight"].shape[0]) // head_dim,
        "head_dim": head_dim,
        **layer_config_fields(tc, target.vocab_size),
        "use_sliding_window": False,  # every layer full attention (no sliding window)
    }


def export_speculators_dflash(head: nn.Module, cfg: HeadConfig, meta: dict, target: TargetIO, verifier: str,
                              speculative_tokens: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """vLLM's speculators DFlash layout; `speculative_tokens` is ignored (always block_size - 1, see above)."""
    state = head_state(head)
    config = {
        "speculators_model_type": "dflash",
        "speculators_version": SPECULATORS_VERSION,
        "architectures": ["DFlashSpeculator"],
        "transformer_layer_config": layer_config(head, target),
        "draft_vocab_size": int(state["lm_head.weight"].shape[0]),
        "target_hidden_size": target.hidden_size,
        "block_size": int(head.block_size),
        "mask_token_id": int(head.mask_token_id),
        "aux_hidden_state_layer_ids": served_layer_ids(meta, target),
        "sample_from_anchor": False,  # slot 0 is the anchor (the bonus token); slots 1..B-1 are drafted
        # vLLM (0.32's update_dflash) sets dflash_config.causal = not this, and `causal` overrides EVERY layer:
        # false would serve the draft causally inside the block, another function. True keeps it bidirectional.
        "sliding_window_non_causal": True,
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": int(head.block_size) - 1,
                 "verifier_accept_k": 1, "accept_tolerance": 0.0}
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": causal_lm_architecture(target.config)},
        },
    }
    return config, state


def _check_layer(layer: dict, config: dict, target: TargetIO, where: str) -> None:
    """Refuse draft layers the native head would build differently for this target."""
    tc = target.config
    n_heads = int(tc.num_attention_heads)
    for key, want in (("hidden_size", target.hidden_size), ("vocab_size", target.vocab_size),
                      ("num_attention_heads", n_heads),
                      ("num_key_value_heads", int(getattr(tc, "num_key_value_heads", None) or n_heads)),
                      ("head_dim", int(getattr(tc, "head_dim", None) or target.hidden_size // n_heads))):
        if int(layer[key]) != want:
            raise HeadMismatchError(f"{where}: {key} is {layer[key]} but this project's head uses {want}")
    if int(config.get("target_hidden_size") or layer["hidden_size"]) != target.hidden_size:
        raise HeadMismatchError(f"{where}: target_hidden_size is {config['target_hidden_size']} but the target "
                                f"has {target.hidden_size}")
    theta = rope_fields(tc)["rope_theta"]
    if float(layer["rope_theta"]) != theta:
        raise HeadMismatchError(f"{where}: rope_theta is {layer['rope_theta']} but the target's is {theta}")


def import_speculators_dflash(config: dict, state: dict[str, torch.Tensor], target: TargetIO, where: str
                              ) -> tuple[HeadConfig, dict[str, torch.Tensor]]:
    layer = config["transformer_layer_config"]
    _check_layer(layer, config, target, where)
    inter = int(layer["intermediate_size"])
    cfg = registry.get("dflash").config(
        layer_ids=[int(i) for i in config["aux_hidden_state_layer_ids"]],
        num_layers=int(layer["num_hidden_layers"]),
        block_size=int(config["block_size"]),
        draft_vocab_size=int(config["draft_vocab_size"]),
        mask_token_id=int(config["mask_token_id"]),
        intermediate_size=None if inter == int(target.config.intermediate_size) else inter,
    )
    return cfg, dict(state)


def serving(repo_id: str, target_hub: str, k: int) -> str:
    """The model card's serving command (vLLM; the proposal length is the block's, not `k`)."""
    return f"""vLLM (speculators DFlash layout; proposes block_size - 1 tokens per pass):

```bash
vllm serve {target_hub} \\
  --speculative-config '{{"method": "dflash", "model": "{repo_id}"}}'
```"""


EXPORTS = FamilyExports(
    family="dflash",
    layouts=(Layout("speculators_dflash", export_speculators_dflash, import_speculators_dflash),),
    vllm=VllmServing(format="speculators_dflash", method="dflash"),
    serving=serving,
)
