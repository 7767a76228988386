"""Grouped-query attention inside SDPA for the target's verify passes on a CPU, mask or not.

transformers' `sdpa` attention lets torch's scaled_dot_product_attention share each key/value head among its
query heads (`enable_gqa`) only when no mask is passed. A pass over one new token has none, but verifying k
drafted tokens needs a causal (or tree) mask, and then every layer copies its whole key/value cache
`num_key_value_groups` times (`repeat_kv`) before attending: a cost that grows with the context, paid only by
passes that verify drafts. Measured on the 2-core Zen 5 machine, SmolLM2-135M (9 query heads over 3 key/value
heads), packed kernels, ms per pass over 1 / 2 / 4 tokens (`python scripts/bench_attention.py`: both
attentions interleaved, median of 12; a second run read the same within the VM's noise, up to 5 ms a cell):

    context               100                 300                 600                 1000
    repeat_kv (sdpa)     51 / 63 / 68        57 / 77 / 79        55 / 73 / 79        61 / 85 / 93
    enable_gqa (here)    54 / 60 / 65        59 / 72 / 75        55 / 64 / 69        60 / 71 / 77

and in the eval (the quickstart head alone, 4 questions of mt_bench and humaneval, adaptive) a pass verifying
one drafted token went from a median 68.7 to 61.3 ms against a plain pass's 54.9 / 52.7 ms: from 1.25 to 1.16
times a plain pass. `use_gqa_attention(model)` registers `sdpa_gqa` (transformers' AttentionInterface, with
sdpa's mask builder) and switches a CPU model that uses `sdpa` and groups its key/value heads to it;
data.target.load_model does so for a target that verifies drafts (eval, the benchmarks). The mask and
everything else is sdpa's; a pass without a mask, with a position bias, a softcap or head sizes SDPA does
not group goes through transformers' own function unchanged. On
CUDA, SDPA's grouped path under a mask is its math kernel, slower than the memory-efficient one after
`repeat_kv`, so a GPU model is left as it is.

    from data.attention import use_gqa_attention
    use_gqa_attention(model)      # True when switched
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "sdpa_gqa"
MAX_HEAD_DIM = 256  # the largest head size transformers itself hands to SDPA's grouped path


def sdpa_gqa_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                       is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention, with the key/value heads grouped inside SDPA also under a mask (see the
    module docstring); query [B, H, q, d], key/value [B, H_kv, kv, d] -> ([B, q, H, d], None)."""
    groups = getattr(module, "num_key_value_groups", 1)
    if (groups == 1 or attention_mask is None or kwargs.get("position_bias") is not None
            or kwargs.get("softcap") is not None or kwargs.get("output_attentions", False)
            or not key.shape[-1] == value.shape[-1] <= MAX_HEAD_DIM):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def use_gqa_attention(model: nn.Module) -> bool:
    """Switch a CPU model on transformers' `sdpa` whose attention groups key/value heads to `sdpa_gqa`; returns
    whether it did (a GPU model, another attention or one key/value head per query head: left as is)."""
    config = model.config.get_text_config()
    impl = getattr(config, "_attn_implementation", None)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if impl != "sdpa" or not heads or heads == kv_heads or next(model.parameters()).device.type != "cpu":
        return False
    AttentionInterface.register(NAME, sdpa_gqa_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
    return True
