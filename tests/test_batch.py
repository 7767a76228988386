"""Batched verification (eval/batch.py): greedy identity per row against plain batched greedy, and the sweep.

    .venv/bin/python -m pytest -q tests/test_batch.py
"""

from __future__ import annotations

import random

import pytest
import torch

from data.tokenize import left_pad
from eval.batch import batched_generate, sweep
from heads.base import DraftTree


class OracleDrafter:
    """Drafts a row's true greedy continuation (from a reference run), corrupting some tokens at random.

    Rows then accept different lengths each round, which is what the min-over-rows rule must handle.
    """

    capture_layers = None

    def __init__(self, refs: dict[tuple, list[int]], corrupt: float, seed: int, vocab: int, full: bool = False) -> None:
        self.refs, self.corrupt, self.rng, self.vocab = refs, corrupt, random.Random(seed), vocab
        self.full = full  # always draft k tokens (else a random length 1..k)
        self.ref: list[int] = []
        self.pos = 0

    def begin(self, prompt_ids, features, next_token):
        self.ref = self.refs[tuple(prompt_ids.tolist())]
        assert next_token == self.ref[0]
        self.pos = 1  # ref[0] (the root) is already emitted

    def draft(self, k, temperature):
        toks = list(self.ref[self.pos:self.pos + (k if self.full else self.rng.randint(1, k))])
        toks = [(t + 1) % self.vocab if self.rng.random() < self.corrupt else t for t in toks]
        return DraftTree.chain(torch.tensor(toks, dtype=torch.long))

    def commit(self, accepted, features, next_token):
        self.pos += len(accepted) + 1
        assert self.pos > len(self.ref) or next_token == self.ref[self.pos - 1]


def _prompts(tok, n):
    texts = ["Hello there, how are you?", "Write a haiku about the sea.", "2+2=", "Tell me a long story about a cat."]
    return [tok.apply_chat_template([{"role": "user", "content": texts[i % len(texts)]}], tokenize=True,
                                    add_generation_prompt=True, return_dict=False) for i in range(n)]


def test_left_pad_example():
    ids, mask = left_pad([[5, 6, 7], [8]], 0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_batched_plain_matches_single_rows(tiny_target):
    """Left padding with the position rule gives each row what it gets alone (float32)."""
    model, tok, _ = tiny_target
    prompts = _prompts(tok, 3)
    both = batched_generate(model, prompts, 12, tok.pad_token_id)
    for i, p in enumerate(prompts):
        alone = batched_generate(model, [p], 12, tok.pad_token_id)
        assert torch.equal(both.tokens[i], alone.tokens[0])


def test_speculative_batch_is_greedy_identical_per_row(tiny_target):
    """Rows accept different lengths each round (random draft lengths, corrupted tokens): still identical."""
    model, tok, io = tiny_target
    prompts = _prompts(tok, 4)
    n = 20
    plain = batched_generate(model, prompts, n, tok.pad_token_id)
    refs = {tuple(p): plain.tokens[i].tolist() for i, p in enumerate(prompts)}
    seeds = iter(range(100))
    spec = batched_generate(
        model, prompts, n, tok.pad_token_id, k=4,
        make_drafter=lambda: OracleDrafter(refs, 0.1, next(seeds), io.vocab_size),
    )
    assert torch.equal(spec.tokens, plain.tokens)
    # Some rounds must have accepted drafts (fewer passes than tokens), else the test checks nothing.
    assert spec.passes < n - 1


def test_perfect_drafts_advance_k_plus_one(tiny_target):
    """Uncorrupted full drafts: every round accepts all k and emits k+1 tokens (tau counts the bonus)."""
    model, tok, io = tiny_target
    prompts = _prompts(tok, 3)
    n, k = 21, 4
    plain = batched_generate(model, prompts, n, tok.pad_token_id)
    refs = {tuple(p): plain.tokens[i].tolist() for i, p in enumerate(prompts)}
    spec = batched_generate(model, prompts, n, tok.pad_token_id, k=k,
                            make_drafter=lambda: OracleDrafter(refs, 0.0, 0, io.vocab_size, full=True))
    assert torch.equal(spec.tokens, plain.tokens)
    assert spec.passes == (n - 1) // (k + 1)  # 20 tokens after the prefill's one, 5 per pass
    assert spec.tau == pytest.approx(k + 1)


def test_wrong_drafter_still_exact(tiny_target):
    """A drafter proposing junk gets nothing accepted yet the output is unchanged."""
    model, tok, io = tiny_target
    prompts = _prompts(tok, 2)
    plain = batched_generate(model, prompts, 10, tok.pad_token_id)
    refs = {tuple(p): [(t + 5) % io.vocab_size for t in plain.tokens[i].tolist()] for i, p in enumerate(prompts)}

    class Junk(OracleDrafter):
        def begin(self, prompt_ids, features, next_token):
            self.ref = self.refs[tuple(prompt_ids.tolist())]
            self.pos = 1

        def commit(self, accepted, features, next_token):
            self.pos += len(accepted) + 1

    spec = batched_generate(model, prompts, 10, tok.pad_token_id, k=3,
                            make_drafter=lambda: Junk(refs, 0.0, 0, io.vocab_size))
    assert torch.equal(spec.tokens, plain.tokens)


def test_sweep_report_shape_and_crossover(tiny_target):
    model, tok, io = tiny_target
    prompts = _prompts(tok, 2)
    plain = batched_generate(model, prompts, 8, tok.pad_token_id)
    refs = {tuple(p): plain.tokens[i].tolist() for i, p in enumerate(prompts)}
    out = sweep(model, prompts, tok.pad_token_id, [1, 2], k=3, max_new_tokens=8, drafter_name="oracle",
                make_drafter=lambda: OracleDrafter(refs, 0.0, 1, io.vocab_size))
    assert [r["batch_size"] for r in out["rows"]] == [1, 2]
    assert out["drafter"] == "oracle"
    for r in out["rows"]:
        assert r["plain_tok_s"] > 0 and r["spec_tok_s"] > 0
        assert r["speedup"] == pytest.approx(r["spec_tok_s"] / r["plain_tok_s"])
    expect = next((r["batch_size"] for r in out["rows"] if r["speedup"] <= 1.0), None)
    assert out["crossover_batch_size"] == expect
