"""DFlash: a block-parallel drafter (arXiv 2602.06036; z-lab/dflash, served by vLLM `method: dflash`).

A few Qwen3-style decoder layers draft a whole block in ONE pass: the queries come from the block
[anchor, mask x (B-1)] (the anchor is the newest token, which the target has not processed yet; the masked
slots hold the target's embedding of `mask_token_id`), the keys/values are the target's fused context
features (EAGLE-3's captured layers, projected once and shared by every layer) followed by the block's own
states; attention is bidirectional inside the block. The target's embedding is used (never stored); the LM
head is the target's, restricted to an EAGLE-3-style draft vocabulary, frozen.

Forward (vLLM `qwen3_dflash.py`, z-lab `DFlashDraftModel`, speculators `DFlashDraftModel`):
    c_p   = hidden_norm(fc(A_p))               A_p = cat(hidden_states[i] at p for the layer ids), ascending
    h^0_i = emb([x_n, m, ..., m])_i            slots i = 0..B-1 at RoPE positions n+i; m = mask_token_id
    per layer l (x = input_layernorm(h)):
        K = [k_norm(k_proj(c_p)) for p < n] ++ [k_norm(k_proj(x_j)) for j < B]    RoPE at p and n+j
        V = [v_proj(c_p) for p < n] ++ [v_proj(x_j) for j < B]
        h = h + o_proj(softmax(rope(q_norm(q_proj(x))) K^T / sqrt(d)) V)          no mask inside the block
        h = h + mlp(post_attention_layernorm(h))
    logits_i = lm_head(norm(h_i)) over the draft vocab; slot i >= 1 drafts x_{n+i}; target id = id + d2t[id]
DSpark's variant (vLLM `qwen3_dspark.py` and its DSpark speculator; two config options, same backbone):
    sample_from_anchor   slot i >= 0 drafts x_{n+i+1} (the anchor's own slot drafts: B tokens a pass)
    markov_rank R > 0    logits_i += markov_w2 @ markov_w1[t_i], t_i the target id before the drafted one
                         (the anchor for the first drafting slot, then the token drawn before); the block's
                         pass stays one, the draws go left to right, each q_i conditioned on the chain drawn
    markov_rows draft    markov_w1 holds a row per draft-vocab id plus one shared by every other id (exported
                         to DSpark's layout as a row per target id: the same function)
This project's options (no engine layout):
    anchor_feature       h^0_i = anchor_proj([emb_i, c_{n-1}]) in every slot: the newest context feature in the
                         input, as EAGLE-3's first step (its fc of [embedding, feature]) and P-EAGLE's depth 0 have it
    prev_mlp W > 0       before the LM head, h_i += down(silu(up([norm(h_i), emb_norm(emb(t_i))]))), width W, t_i as
                         the Markov head's (Hydra's sequentially-dependent heads, arXiv 2402.05109): each slot's
                         state reads the token drawn before it; drawn left to right as the Markov head's
    plain_first_slot     the first drafting slot's logits skip both (the Markov bias, prev_mlp): lm_head(norm(h))
                         alone; the token before it is the anchor, already in its input
Training (heads/dflash/losses.py): anchors a sampled per sequence; slot k of the block at a sees features
< a and its own block, predicts x_{a+k} against the target's distribution at a+k-1 with weight
exp(-(k-1)/gamma), loss_mask[a+k] and t2d[target argmax] as masks (speculators' recipe).

The package, one job per module (this file re-exports their public names and declares the family,
`FAMILIES`, for heads.registry; its loss reads the stored target argmax, as EAGLE-3's does):
    config.py   DFlashConfig, feature_layers, resolved_mask_token, loss_weights, first_slot
    model.py    DFlashAttention, DFlashLayer, MarkovHead, PrevTokenMLP, DFlashHead, block_attention, build,
                prepare (draft vocab, LM head rows)
    losses.py   loss, block_loss, block_logits, block_alignment, context_mask, sample_anchors
    drafting.py DFlashDrafter, drafter, drafter_factory, TREES (eval.tree: chain; static, a top-k tree over
                the block's slots; dynamic, EAGLE-2's tree over them)

Run the unit tests with `.venv/bin/python -m pytest -q tests/test_dflash.py`.
"""

from heads.dflash.config import DFlashConfig, feature_layers, first_slot, loss_weights, resolved_mask_token
from heads.dflash.drafting import TREES, DFlashDrafter, drafter, drafter_factory
from heads.dflash.losses import (
    block_alignment,
    block_logits,
    block_loss,
    context_mask,
    loss,
    sample_anchors,
)
from heads.dflash.model import (
    DFlashAttention,
    DFlashHead,
    DFlashLayer,
    MarkovHead,
    PrevTokenMLP,
    block_attention,
    build,
    prepare,
)
from heads.registry import TARGET_ARGMAX, Family

FAMILIES = (Family(name="dflash", config=DFlashConfig, feature_layers=feature_layers, build=build, loss=loss,
                   drafter_factory=drafter_factory, trees=TREES, prepare=prepare,
                   reads=lambda cfg: frozenset({TARGET_ARGMAX}), target_labels=lambda cfg: True,
                   tiny="configs/tiny-dflash.yaml"),)

__all__ = [
    "FAMILIES", "TREES", "DFlashAttention", "DFlashConfig", "DFlashDrafter", "DFlashHead", "DFlashLayer", "block_alignment",
    "block_attention", "block_logits", "block_loss", "build", "context_mask", "drafter", "drafter_factory",
    "feature_layers", "first_slot", "loss", "loss_weights", "MarkovHead", "PrevTokenMLP", "prepare", "resolved_mask_token",
    "sample_anchors",
]
