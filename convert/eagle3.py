"""EAGLE-3 heads <-> vLLM's speculators layout and SGLang's LlamaForCausalLMEagle3 layout.

Both layouts hold the same tensors (the draft decoder layer under `layers.0.` / `midlayer.`) and describe
the layer as a one-layer Llama config; they read the captured layer ids one layer apart (see
convert/formats/README.md). vLLM serves the speculators layout as speculative method "eagle3".
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
NATIVE_PREFIX = "midlayer."
PREFIX = {"sglang": "midlayer.", "speculators": "layers.0."}


def layer_config(head: nn.Module, target: TargetIO) -> dict:
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
        **layer_config_fields(tc, target.vocab_size),
        "mlp_bias": False,
        "bos_token_id": getattr(tc, "bos_token_id", None),
        "eos_token_id": getattr(tc, "eos_token_id", None),
    }


def _renamed(state: dict[str, torch.Tensor], old: str, new: str) -> dict[str, torch.Tensor]:
    """The state with the key prefix `old` replaced by `new` (other keys unchanged)."""
    return {(new + k[len(old):]) if k.startswith(old) else k: v for k, v in state.items()}


def export_speculators(head: nn.Module, cfg: HeadConfig, meta: dict, target: TargetIO, verifier: str,
                       speculative_tokens: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """vLLM's speculators layout: the draft layer's config nested under `transformer_layer_config`."""
    state = head_state(head)
    layer = layer_config(head, target)
    ids = served_layer_ids(meta, target)
    config = {
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "architectures": ["Eagle3Speculator"],
        "transformer_layer_config": layer,
        "draft_vocab_size": int(state["lm_head.weight"].shape[0]),
        "target_hidden_size": target.hidden_size,
        "eagle_aux_hidden_state_layer_ids": ids,
        # vLLM's speculators loader defaults this to True when absent, so it is always written (the head's option)
        "norm_before_residual": bool(cfg.norm_before_residual),
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
    return config, _renamed(state, NATIVE_PREFIX, PREFIX["speculators"])


def export_sglang(head: nn.Module, cfg: HeadConfig, meta: dict, target: TargetIO, verifier: str,
                  speculative_tokens: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """SGLang's layout (a head `refuses_sglang` lets through): the draft layer's config at the top level, layer
    ids as "output of layer i"."""
    state = head_state(head)
    layer = layer_config(head, target)
    ids = [i - 1 for i in served_layer_ids(meta, target)]  # SGLang adds 1 before capturing
    config = {
        **layer,
        "architectures": ["LlamaForCausalLMEagle3"],
        "draft_vocab_size": int(state["lm_head.weight"].shape[0]),
        "target_hidden_size": target.hidden_size,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
    }
    return config, _renamed(state, NATIVE_PREFIX, PREFIX["sglang"])


def _check_layer(layer: dict, config: dict, target: TargetIO, where: str) -> None:
    """Refuse a draft layer the native head would build differently for this target."""
    for key, have in (("hidden_size", target.hidden_size), ("vocab_size", target.vocab_size)):
        if int(layer[key]) != have:
            raise HeadMismatchError(f"{where}: {key} is {layer[key]} but the target has {have}")
    th = int(config.get("target_hidden_size") or layer["hidden_size"])
    if th != target.hidden_size:
        raise HeadMismatchError(f"{where}: target_hidden_size is {th} but the target has {target.hidden_size}")
    # The native head takes these from the target (the family's DecoderLayer): refuse a checkpoint whose
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


def _import(config: dict, state: dict[str, torch.Tensor], target: TargetIO, where: str, layer: dict,
            ids: list[int], prefix: str, norm_before_residual: bool = False) -> tuple[HeadConfig, dict[str, torch.Tensor]]:
    """(Eagle3Config, native state dict) from a checked draft layer config, native layer ids, key prefix."""
    _check_layer(layer, config, target, where)
    inter = int(layer["intermediate_size"])
    cfg = registry.get("eagle3").config(
        layer_ids=ids,
        draft_vocab_size=int(config["draft_vocab_size"]),
        # null = "the target's width", as a natively trained head records it
        intermediate_size=None if inter == int(target.config.intermediate_size) else inter,
        norm_before_residual=norm_before_residual,
    )
    return cfg, _renamed(state, prefix, NATIVE_PREFIX)


def import_speculators(config: dict, state: dict[str, torch.Tensor], target: TargetIO, where: str
                       ) -> tuple[HeadConfig, dict[str, torch.Tensor]]:
    ids = [int(i) for i in config["eagle_aux_hidden_state_layer_ids"]]
    return _import(config, state, target, where, config["transformer_layer_config"], ids, PREFIX["speculators"],
                   bool(config["norm_before_residual"]))  # required by the spec (vLLM's default when absent differs)


def import_sglang(config: dict, state: dict[str, torch.Tensor], target: TargetIO, where: str
                  ) -> tuple[HeadConfig, dict[str, torch.Tensor]]:
    raw_ids = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    ids = [int(i) + 1 for i in raw_ids]  # SGLang's "output of layer i" -> hidden_states index i + 1
    return _import(config, state, target, where, config, ids, PREFIX["sglang"])


def serving(repo_id: str, target_hub: str, k: int, layouts: tuple[str, ...]) -> str:
    """The model card's serving commands: vLLM from the upload's root (speculators), SGLang from its `sglang/`
    folder when the upload holds one (`layouts`: not for a head with norm_before_residual)."""
    name = repo_id.split("/")[-1]
    if "speculators" not in layouts:  # the root is the native folder (head.pointer: no engine layout holds it)
        return ("No serving engine runs this head (head.pointer: a pointer no engine layout has); evaluate it "
                "with this project (`python -m eval.run --head` on the downloaded folder).")
    vllm = f"""vLLM (the repository root is the speculators layout; layer ids in vLLM's convention):

```bash
vllm serve {target_hub} \\
  --speculative-config '{{"method": "eagle3", "model": "{repo_id}", "num_speculative_tokens": {k}}}'
```"""
    if "sglang" not in layouts:
        return vllm + "\n\nSGLang: not served (its layout has no key for head.norm_before_residual)."
    return vllm + f"""

SGLang (the `sglang/` folder; layer ids in SGLang's convention, one less than vLLM's):

```bash
huggingface-cli download {repo_id} --include "sglang/*" --local-dir {name}
python -m sglang.launch_server --model-path {target_hub} --speculative-algorithm EAGLE3 \\
  --speculative-draft-model-path {name}/sglang --speculative-num-steps {k} \\
  --speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}
```"""


def refuses_speculators(head_config: dict) -> str:
    """Why a head cannot go to the speculators layout ("" when it can)."""
    if head_config.get("pointer"):  # no engine has it: the served head would draft from its vocab alone
        return ("head.pointer is true: no engine layout has the pointer over the request's positions; evaluate it "
                "here, or train without it to serve it")
    return ""


def refuses_sglang(head_config: dict) -> str:
    """Why a head cannot go to SGLang's layout ("" when it can)."""
    why = refuses_speculators(head_config)
    if why:
        return why
    if head_config.get("norm_before_residual"):  # no key for it: the engine would compute the default forward
        return "head.norm_before_residual is true: the sglang layout has no such key; export speculators"
    return ""


EXPORTS = FamilyExports(
    family="eagle3",
    layouts=(Layout("speculators", export_speculators, import_speculators, refuses_speculators),
             Layout("sglang", export_sglang, import_sglang, refuses_sglang)),
    vllm=VllmServing(format="speculators", method="eagle3"),
    serving=serving,
)
