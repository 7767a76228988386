"""Medusa heads: the 2+i shift, identity at init, the loss, save/load/draft round trip, exact greedy decoding.

    .venv/bin/python -m pytest -q tests/test_medusa.py            # add -m slow for the sampling exactness test
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from drafters_common import assert_sampling_exact, hf_greedy, make_batch, overfit
from procs import run as run_proc

from data.config import TargetConfig
from data.features import forward_features
from data.target import load_target
from eval.decoder import plain_generate, speculative_generate
from heads import medusa
from heads.base import Features, HeadMismatchError, load_head, save_head

ROOT = Path(__file__).resolve().parents[1]


def test_shift_worked_example() -> None:
    A = torch.tensor([[10, 11, 12, 13]])
    ones = torch.ones_like(A)
    labels, mask = medusa.shift_targets(A, ones, 2)  # head 0
    assert labels.tolist() == [[12, 13, 0, 0]] and mask.int().tolist() == [[1, 1, 0, 0]]
    labels, mask = medusa.shift_targets(A, torch.tensor([[1, 1, 1, 0]]), 3)  # head 1, last token not learnable
    assert labels.tolist() == [[13, 0, 0, 0]] and mask.int().tolist() == [[0, 0, 0, 0]]
    labels, mask = medusa.shift_targets(A, ones, 4)  # nothing left to predict
    assert not mask.any()
    with pytest.raises(ValueError, match="shift must be >= 1"):
        medusa.shift_targets(A, ones, 0)


def test_zero_init_blocks_are_identity(tiny_target) -> None:
    model, _, io = tiny_target
    head = medusa.build(medusa.MedusaConfig(num_heads=3, num_layers=2), io)
    x = torch.randn(5, io.hidden_size)
    for i in range(3):
        assert torch.equal(head.block(i, x), x)
    # With lm_head copies, every head starts as the target's next-token predictor.
    assert torch.allclose(head(x), io.lm_head(x).expand(3, -1, -1), atol=1e-6)
    with torch.no_grad():
        head.blocks[1]["layers"][0].weight.normal_()
    assert not torch.allclose(head.block(1, x), x)


def test_loss_masks_and_decreases(tiny_target) -> None:
    model, _, io = tiny_target
    torch.manual_seed(0)
    seqs = [torch.randint(3, 250, (24,)).tolist(), torch.randint(3, 250, (17,)).tolist()]
    batch = make_batch(model, seqs)
    head = medusa.build(medusa.MedusaConfig(num_heads=3), io)
    loss, metrics = medusa.loss(head, batch, io)
    assert {"top1/0", "top1/1", "top1/2", "n/0", "n/1", "n/2"} <= set(metrics)
    # Head 0 of row 0 predicts tokens 6..23 (loss_mask starts at 4, shift 2: positions 2..21): 20 targets,
    # row 1 has 17 - 4 = 13: the n/ counts are exactly the masked-in tokens that exist t+2 ahead.
    assert metrics["n/0"] == 20 + 13 and metrics["n/2"] == 20 + 13
    # A token outside the loss mask never matters.
    altered = dict(batch, input_ids=batch["input_ids"].clone())
    altered["input_ids"][0, 1] = 7
    assert torch.equal(medusa.loss(head, altered, io)[0], loss)
    losses, metrics = overfit(medusa.loss, head, batch, io, steps=25)
    assert losses[-1] < 0.3 * losses[0]
    chain = [metrics[f"chain/{i}"] for i in range(3)]  # heads.losses.chain_metrics: runs of hits, head by head
    assert chain[0] == metrics["top1/0"] and metrics["n/chain"] == metrics["n/0"]
    assert chain == sorted(chain, reverse=True) and chain[-1] > 0.3, metrics
    # Distillation to the target's distribution trains too (KL starts small on a random target).
    head = medusa.build(medusa.MedusaConfig(num_heads=2, distill=True), io)
    kl, _ = overfit(medusa.loss, head, batch, io, steps=15, lr=3e-3)
    assert kl[-1] < 0.7 * kl[0]


def _greedy_continuation(model, prompt: list[int], n: int) -> list[int]:
    out, _ = plain_generate(model, torch.tensor([prompt]), max_new_tokens=n)
    return prompt + out.tolist()


@pytest.fixture(scope="module")
def trained(tiny_target):
    """Heads overfit on the target's own greedy continuation of one prompt (so drafts get accepted)."""
    model, _, io = tiny_target
    torch.manual_seed(1)
    prompt = torch.randint(3, 250, (12,)).tolist()
    seq = _greedy_continuation(model, prompt, 40)
    head = medusa.build(medusa.MedusaConfig(num_heads=3, tree=[[0], [1], [0, 0], [0, 1], [0, 0, 0]]), io)
    overfit(medusa.loss, head, make_batch(model, [seq], prompt_len=len(prompt)), io, steps=40)
    head.eval()
    return head, prompt


def test_greedy_decoding_is_identical(tiny_target, trained) -> None:
    model, _, io = tiny_target
    head, prompt = trained
    ids = torch.tensor([prompt])
    ref, eos = hf_greedy(model, ids, 40)
    out, stats = speculative_generate(model, ids, medusa.drafter(head, io), k=3, max_new_tokens=40, eos_token_id=eos)
    assert out.tolist() == ref.tolist()
    assert stats.tau > 1.5  # the heads learnt this continuation: accepted drafts exercised the rollback
    # Another prompt (drafts mostly rejected) and the default tree: still identical.
    other = torch.tensor([prompt[::-1]])
    ref, eos = hf_greedy(model, other, 24)
    out, _ = speculative_generate(model, other, medusa.drafter(head, io, tree=None), k=2, max_new_tokens=24,
                                  eos_token_id=eos)
    assert out.tolist() == ref.tolist()


def test_draft_tree_shape_and_probs(tiny_target, trained) -> None:
    model, _, io = tiny_target
    head, prompt = trained
    feats, _ = forward_features(model, torch.tensor([prompt]))
    d = medusa.drafter(head, io)
    d.begin(torch.tensor([prompt]), feats, 5)
    tree = d.draft(3, 0.0)
    assert tree.parents.tolist() == [-1, -1, 0, 0, 2] and tree.probs is None
    logits = head(feats.last[0, -1])
    top = logits.topk(2, dim=-1).indices
    assert tree.tokens.tolist() == [top[0, 0], top[0, 1], top[1, 0], top[1, 1], top[2, 0]]
    assert len(d.draft(1, 0.0)) == 2  # depth cut to k
    sampled = d.draft(3, 0.7)
    assert sampled.sampling == "topk" and torch.allclose(sampled.probs[4], torch.softmax(logits[2] / 0.7, -1))
    with pytest.raises(ValueError, match="depth 4 but the head has only 3"):
        medusa.drafter(head, io, tree=[[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]])
    with pytest.raises(ValueError, match="no parent path"):
        medusa.drafter(head, io, tree=[[0], [1, 0]])


def test_sampling_is_exact(tiny_target, trained) -> None:
    """Speculative sampling with the medusa drafter matches plain sampling's law (see assert_sampling_exact)."""
    model, _, io = tiny_target
    head, prompt = trained
    assert_sampling_exact(model, prompt, lambda i: medusa.drafter(head, io))


def test_save_load_round_trip_and_mismatch(tmp_path: Path, tiny_target, trained) -> None:
    model, _, io = tiny_target
    head, prompt = trained
    save_head(tmp_path / "head", head, head.cfg, io)
    again, cfg, _ = load_head(tmp_path / "head", io)
    assert cfg == head.cfg
    x = torch.randn(3, io.hidden_size)
    assert torch.equal(again(x), head(x))
    feats = Features(last=torch.randn(1, 4, io.hidden_size))
    trees = []
    for h in (head, again):
        d = medusa.drafter(h, io)
        d.begin(torch.tensor([prompt[:4]]), feats, 1)
        trees.append(d.draft(3, 0.5))
    assert torch.equal(trees[0].tokens, trees[1].tokens) and torch.equal(trees[0].probs, trees[1].probs)
    _, _, qwen = load_target(TargetConfig(name_or_path="tiny-random-qwen2", device="cpu"))
    with pytest.raises(HeadMismatchError, match="fingerprint"):
        load_head(tmp_path / "head", qwen)


def test_tiny_config_trains_a_loadable_head(tmp_path: Path, tiny_target) -> None:
    out = tmp_path / "run"
    proc = run_proc(
        [sys.executable, "train/medusa.py", "--config", "configs/tiny-medusa.yaml", "--out", str(out),
         "--train.epochs=1"],
        cwd=ROOT, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    head, cfg, meta = load_head(out / "head", tiny_target[2])
    assert cfg.family == "medusa" and cfg.num_heads == 3 and meta["extra"]["step"] > 0
    wrong = run_proc(
        [sys.executable, "train/medusa.py", "--config", "configs/tiny-mtp.yaml", "--out", str(tmp_path / "x")],
        cwd=ROOT, timeout=120,
    )
    assert wrong.returncode == 2 and "medusa" in wrong.stderr
