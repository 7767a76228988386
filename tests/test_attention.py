"""Grouped-query attention inside SDPA for verify passes (data.attention): the same logits as transformers' sdpa.

    .venv/bin/python -m pytest -q tests/test_attention.py
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

import data.attention
from data.attention import NAME, use_gqa_attention
from data.config import TargetConfig
from data.kvcache import new_kv
from data.target import byte_tokenizer, load_model, tiny_config


@pytest.fixture
def grouped_calls(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Each SDPA call data.attention makes itself: whether it had a mask (the case it exists for)."""
    calls: list[bool] = []

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(kwargs.get("attn_mask") is not None and kwargs.get("enable_gqa") is True)
        return F.scaled_dot_product_attention(*args, **kwargs)

    monkeypatch.setattr(data.attention, "F", SimpleNamespace(scaled_dot_product_attention=spy))
    return calls


def test_a_verifying_target_groups_its_kv_heads_inside_sdpa() -> None:
    cfg = TargetConfig(name_or_path="tiny-random-llama", device="cpu", cpu_kernels="dense")
    assert load_model(cfg, decode=True, verify=True).config._attn_implementation == NAME
    assert load_model(cfg, decode=True).config._attn_implementation == "sdpa"  # generation: unchanged


def test_one_kv_head_per_query_head_is_left_alone() -> None:
    config = tiny_config("tiny-random-llama", len(byte_tokenizer()))
    config.num_key_value_heads = config.num_attention_heads
    model = AutoModelForCausalLM.from_config(config)
    assert not use_gqa_attention(model) and model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("name", ["tiny-random-llama", "tiny-random-qwen2", "tiny-random-gemma3"])
def test_grouped_attention_matches_sdpa_on_chains_trees_and_padded_rows(name: str, grouped_calls: list[bool]) -> None:
    cfg = TargetConfig(name_or_path=name, device="cpu", cpu_kernels="dense")
    plain, grouped = load_model(cfg), load_model(cfg)
    assert use_gqa_attention(grouped), f"{name}: not switched"
    torch.manual_seed(0)
    prompt = torch.randint(3, 200, (1, 40))
    with torch.inference_mode():
        for parents in ([-1, 0, 1], [-1, -1, 0, 1, 1]):  # a chain of three drafts, then a tree
            got = []
            for model in (plain, grouped):
                kv = new_kv(model, "dynamic")
                kv.run(prompt)
                kv.keep(range(prompt.shape[1]))
                drafts = torch.randint(3, 200, (1, len(parents) + 1), generator=torch.Generator().manual_seed(1))
                logits, _ = kv.run(drafts, torch.tensor(parents))
                got.append(logits)
            torch.testing.assert_close(got[1], got[0], rtol=1e-5, atol=1e-5)
        # left-padded rows (the batch sweep): two prompts of different lengths, then a chain pass in each
        ids = torch.randint(3, 200, (2, 12))
        pad = torch.ones(2, 12, dtype=torch.long)
        pad[1, :5] = 0
        got = []
        for model in (plain, grouped):
            kv = new_kv(model, "dynamic")
            kv.run(ids, pad=pad)
            kv.keep(range(12))
            logits, _ = kv.run(torch.randint(3, 200, (2, 3), generator=torch.Generator().manual_seed(2)))
            got.append(logits)
        torch.testing.assert_close(got[1], got[0], rtol=1e-5, atol=1e-5)
    assert any(grouped_calls), "the grouped path never ran under a mask"
