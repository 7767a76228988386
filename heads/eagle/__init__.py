"""EAGLE heads: EAGLE-1 (feature regression) and EAGLE-3 (fused low/mid/high features, training-time test).

Both heads are one Llama-style decoder layer sized like the target (attention heads, KV heads, head_dim,
MLP width and activation, RMSNorm eps; RoPE from the target's own rotary module), trained on frozen target
features, with the target's embedding (and, for EAGLE-1, its lm_head) used but never stored in the head.
The functions computed are the ones in the project's format notes (SGLang/vLLM `LlamaForCausalLMEagle3`
and SafeAILab `cnets1`):

EAGLE-1 (`Eagle1Head`, parameters `fc`, `layers.0.*`):
    h = fc(cat(emb(x_{t+1}), f_t))                   f_t = target last hidden AFTER its final norm; fc has a bias
    y = h + o_proj(attn(h));  o = y + mlp(post_attention_layernorm(y))      (no input_layernorm, no final norm)
    o predicts f_{t+1}; logits = target.lm_head(o) predict x_{t+2}
    loss = 1.0 * SmoothL1(o, f_{t+1}) + 0.1 * CE(softmax(target.lm_head(f_{t+1})), log_softmax(target.lm_head(o)))
    with U(-noise/2, noise/2) added to f_t during training (the EAGLE paper's U(-0.1, 0.1) at noise 0.2);
    head.loss (forward_kl, the default, is this CE; tv, kl_tv, see `token_loss`) picks the token term.

EAGLE-3 (`Eagle3Head`, parameters named like SGLang's layout: `fc`, `midlayer.*`, `norm`, `lm_head`, buffers
`d2t`, `t2d`):
    g = fc(A_t)   A_t = cat(hidden_states[i] for the layer ids), ascending; no bias; step 0 only
    u = cat(input_layernorm(emb(x)), hidden_norm(g));   y = g + o_proj(attn(u));   o = y + mlp(post_ln(y))
    (norm_before_residual: y = hidden_norm(g) + o_proj(attn(u)), speculators' / vLLM's option of that name)
    logits_draft = lm_head(norm(o)) over the draft vocab; target_id = draft_id + d2t[draft_id]
    next step's hidden = o (PRE-norm)
  Training-time test, step s at index t (s = 0 .. ttt_length-1), see `step_alignment` for a worked example:
    token x_{t+1+s}, hidden fc(A_t) at s = 0 else o^{s-1}_t, RoPE position t+s,
    keys: step-0 keys at t' <= t (causal) plus the keys of steps 1..s at the same index t (`ttt_attention`),
    target: draft-vocab softmax of the target's logits at t+1+s (they predict x_{t+2+s}),
    mask: loss_mask[t+2+s] (the project convention: predicting token j uses loss_mask[j]; SpecForge's
    `loss_mask[t+s]` is the same rule under its own, shifted, mask) times t2d[the target's argmax there]
    (batch["target_argmax"], stored at extraction, so training computes only the draft vocab's logits),
    loss_s = -sum(mask * sum_v p log q) / (B*T);  loss = sum_s ttt_decay**s * loss_s
    (head.loss: forward_kl, the default, is this; tv and kl_tv replace -sum_v p log q, see `token_loss`).
  Pointer (head.pointer, parameters `ptr_q`, `ptr_k`, `ptr_gate`): a pointer over the request's positions,
    mixed with the draft vocab's softmax. At step s of index t, with x = norm(o):
      a_i = softmax_i(ptr_q(x) . ptr_k(f_i) / sqrt(H)) over the committed positions i <= t (f_i = the target's last
            hidden state there, `batch["last"]`), pointing at i drafts x_{i+1} (the token that followed it);
      g = sigmoid(ptr_gate(x));   P = (1 - g) * softmax(lm_head(x)) + g * sum_i a_i [x_{i+1}]
    over the draft vocab extended by the copy tokens (the distinct x_{i+1}, i <= t, with t2d false; its own drafts
    are not added), and log P is the head's logits. Training's label is the target's softmax over the same
    extended set and its mask admits a target argmax there; a copy token the pointer cannot reach yet sits at
    -1e9 (`copy_set`, `copy_allowed` in losses.py). No engine layout has it: convert refuses such a head.
  Metrics: `top1/s` = share of loss-masked positions (target argmax outside the draft vocab, or with
  head.pointer outside the extended set, counted as misses) where the draft's argmax equals the target's argmax
  at step s; `n/s` their count; `chain/s` the
  share of step-0 positions whose steps 0..s all hit (heads.losses.chain_metrics).

Draft vocabulary (`prepare`): the N most frequent tokens among loss-masked training tokens (ties: lower id
first), sorted by id; `d2t[i] = id_i - i`, `t2d[id] = True` for chosen ids (vLLM/SGLang convention).

Drafting (`drafter`, `drafter_factory`): chains, or EAGLE-2 dynamic trees (`tree="dynamic"`, `top_k`,
`total_tokens`), with the head's own KV cache rolled back to the accepted path on every commit.

The package, one job per module (this file re-exports their public names, so `from heads.eagle import X`
reaches all of them, and declares the two families, `FAMILIES`, for heads.registry):
    config.py   Eagle1Config, Eagle3Config (head.loss from heads/losses.py's TokenLossConfig), feature_layers,
                default_layer_ids, resolved_draft_vocab
    model.py    the re-implemented Llama layer (RMSNorm, Attention, MLP, DecoderLayer), ttt_attention,
                masked_attention, rotary, Eagle1Head, Eagle3Head, build
    vocab.py    the draft vocabulary (draft_vocab_from_counts, token_counts), prepare, final_norm_scale
    losses.py   loss (EAGLE-1 and EAGLE-3 TTT; the token term is heads/losses.py's token_loss), step_alignment
    drafting.py EagleDrafter (chain / EAGLE-2 dynamic tree: heads.tree.grow_dynamic), drafter, drafter_factory, TREES

Run the unit tests with `.venv/bin/python -m pytest -q tests/test_eagle.py tests/test_alignment.py`.
"""

from heads.align import shift_left
from heads.eagle.config import (
    DEFAULT_DRAFT_VOCAB,
    Eagle1Config,
    Eagle3Config,
    TokenLossConfig,
    default_layer_ids,
    feature_layers,
    resolved_draft_vocab,
)
from heads.eagle.drafting import TREES, EagleDrafter, drafter, drafter_factory
from heads.eagle.losses import loss, step_alignment, token_loss
from heads.eagle.model import (
    MLP,
    Attention,
    DecoderLayer,
    Eagle1Head,
    Eagle3Head,
    RMSNorm,
    build,
    masked_attention,
    rotary,
    ttt_attention,
)
from heads.eagle.vocab import draft_vocab_from_counts, prepare, token_counts
from heads.registry import TARGET_ARGMAX, Family

# EAGLE-1 and EAGLE-3 share every function (each dispatches on the config or head class); only EAGLE-3's
# loss reads the target's argmax (EAGLE-1 uses the full logits of the next feature). Every label is the
# target's: its next feature, its distribution, its greedy token (never the sequence's token).
_SHARED = dict(feature_layers=feature_layers, build=build, loss=loss, drafter_factory=drafter_factory,
               trees=TREES, prepare=prepare, script="eagle", target_labels=lambda cfg: True)
FAMILIES = (
    Family(name="eagle1", config=Eagle1Config, tiny="configs/tiny-eagle1.yaml", **_SHARED),
    Family(name="eagle3", config=Eagle3Config, tiny="configs/tiny-eagle.yaml",
           reads=lambda cfg: frozenset({TARGET_ARGMAX}), **_SHARED),
)

__all__ = [
    "DEFAULT_DRAFT_VOCAB", "FAMILIES", "MLP", "TREES", "Attention", "DecoderLayer",
    "Eagle1Config", "Eagle1Head", "Eagle3Config", "Eagle3Head", "EagleDrafter", "RMSNorm", "TokenLossConfig", "build",
    "default_layer_ids", "draft_vocab_from_counts", "drafter", "drafter_factory", "feature_layers", "loss",
    "masked_attention", "prepare", "resolved_draft_vocab", "rotary", "shift_left", "step_alignment",
    "token_counts", "token_loss", "ttt_attention",
]
