"""MTP modules: the 1+k shift, architecture-copied blocks (Llama, Qwen2, Gemma3), the loss, the incremental
drafter against a full recomputation, save/load/draft round trip, exact greedy decoding.

    .venv/bin/python -m pytest -q tests/test_mtp.py               # add -m slow for the sampling exactness test
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
from heads import mtp
from heads.base import HeadMismatchError, load_head, save_head

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def targets(tiny_target):
    out = {"tiny-random-llama": tiny_target}
    for name in ("tiny-random-qwen2", "tiny-random-gemma3"):
        out[name] = load_target(TargetConfig(name_or_path=name, device="cpu"))
    return out


def test_shift_worked_example() -> None:
    A = torch.tensor([[10, 11, 12, 13]])
    ones = torch.ones_like(A)
    ids, mask = mtp.shift_targets(A, ones, 1 + 1)  # step 1's label
    assert ids.tolist() == [[12, 13, 0, 0]] and mask.int().tolist() == [[1, 1, 0, 0]]
    ids, _ = mtp.shift_targets(A, ones, 1)  # step 1's embedding input
    assert ids.tolist() == [[11, 12, 13, 0]]
    ids, mask = mtp.shift_targets(A, ones, 1 + 2)  # step 2's label
    assert ids.tolist() == [[13, 0, 0, 0]] and mask.int().tolist() == [[1, 0, 0, 0]]
    with pytest.raises(ValueError, match="shift must be >= 1"):
        mtp.shift_targets(A, ones, 0)


def test_step_weights_and_config_checks(tiny_target) -> None:
    assert mtp.step_weights(mtp.MTPConfig(num_modules=3)) == pytest.approx([1.0, 0.8, 0.64])
    assert mtp.step_weights(mtp.MTPConfig(recursive=True, num_steps=2, step_weights=[1.0, 0.3])) == [1.0, 0.3]
    with pytest.raises(ValueError, match="step_weights has 1 entries but training unrolls 2"):
        mtp.build(mtp.MTPConfig(num_modules=2, step_weights=[1.0]), tiny_target[2])


@pytest.mark.parametrize("name", ["tiny-random-llama", "tiny-random-qwen2", "tiny-random-gemma3"])
def test_block_copies_target_architecture_and_trains(targets, name: str) -> None:
    model, _, io = targets[name]
    head = mtp.build(mtp.MTPConfig(num_modules=2), io)
    module = head.mtp[0]
    assert type(module.block) is type(io.last_layer)
    for (k, v), (k2, v2) in zip(module.block.state_dict().items(), io.last_layer.state_dict().items()):
        assert k == k2 and torch.equal(v, v2)
    assert torch.equal(module.norm.weight, io.norm.weight) and type(module.enorm) is type(io.norm)
    frozen = {k: v.clone() for k, v in io.last_layer.state_dict().items()}
    torch.manual_seed(0)
    seqs = [torch.randint(3, 250, (20,)).tolist(), torch.randint(3, 250, (14,)).tolist()]
    batch = make_batch(model, seqs)
    loss, metrics = mtp.loss(head, batch, io)
    assert {"top1/0", "top1/1", "n/0", "n/1"} <= set(metrics)
    assert metrics["n/0"] == 16 + 10 and metrics["n/1"] == 16 + 10
    # The frozen lm_head of a random target caps the logits, so the loss falls slowly; top-1 tells.
    losses, metrics = overfit(mtp.loss, head, batch, io, steps=10)
    assert losses[-1] < losses[0] - 1.0 and metrics["top1/0"] > 0.7 and metrics["top1/1"] > 0.7
    assert all(torch.equal(v, frozen[k]) for k, v in io.last_layer.state_dict().items())  # target untouched


def test_recursive_module_trains(tiny_target) -> None:
    model, _, io = tiny_target
    head = mtp.build(mtp.MTPConfig(recursive=True, num_steps=3), io)
    assert len(head.mtp) == 1 and head.module_for(3) is head.mtp[0]
    torch.manual_seed(0)
    batch = make_batch(model, [torch.randint(3, 250, (18,)).tolist()])
    _, metrics = mtp.loss(head, batch, io)
    assert {"top1/0", "top1/1", "top1/2"} <= set(metrics)
    losses, metrics = overfit(mtp.loss, head, batch, io, steps=10)
    assert losses[-1] < losses[0] - 1.0 and min(metrics[f"top1/{k}"] for k in range(3)) > 0.7
    chain = [metrics[f"chain/{k}"] for k in range(3)]  # heads.losses.chain_metrics: runs of hits, step by step
    assert chain[0] == metrics["top1/0"] and chain == sorted(chain, reverse=True) and chain[-1] > 0.3, metrics


def reference_probs(head, io, seq: list[int], hidden: torch.Tensor, steps: int, temperature: float) -> torch.Tensor:
    """The training forward over the whole sequence: step s's distribution at the last hidden position."""
    n, T = hidden.shape[0], len(seq)
    ids = torch.tensor([seq])
    last = torch.cat([hidden, hidden.new_zeros(T - n, hidden.shape[1])])[None]  # never read at t <= n-1
    pos = torch.arange(T)
    embs = [mtp.embed(io, mtp.shift_targets(ids, torch.ones_like(ids), s)[0], pos, torch.float32)
            for s in range(1, steps + 1)]
    outs = head(last, embs, mtp.rotary_embeddings(head, io, embs[0], pos[None]), mtp.causal_mask(pos, T, head.window, torch.float32))
    return torch.stack([torch.softmax(io.lm_head(o[0, n - 1]) / temperature, -1) for o in outs])


def _lively_head(cfg, io):
    """A head of cfg on io with its weights moved off their copy of the target's layer (seeded)."""
    torch.manual_seed(0)
    head = mtp.build(cfg, io).eval()
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return head


@pytest.mark.parametrize(
    "name,cfg",
    [
        ("tiny-random-llama", mtp.MTPConfig(num_modules=3)),
        ("tiny-random-gemma3", mtp.MTPConfig(recursive=True, num_steps=2)),  # sliding window 64 crossed
    ],
)
def test_incremental_drafter_matches_full_recomputation(targets, name: str, cfg) -> None:
    model, _, io = targets[name]
    head = _lively_head(cfg, io)
    seq = torch.randint(3, 250, (66,)).tolist()
    feats, _ = forward_features(model, torch.tensor([seq[:-1]]))
    d = mtp.drafter(head, io, max_steps=None if not cfg.recursive else 4)
    d.begin(torch.tensor([seq[:-1]]), feats, seq[-1])
    for accept in [0, 2, 1, 3, 0]:
        steps = 3 if not cfg.recursive else 4
        tree = d.draft(5, 0.8)  # capped at num_modules (3) when not recursive
        drafted = tree.tokens.tolist()
        assert len(drafted) == steps and tree.parents.tolist() == list(range(-1, steps - 1))
        with torch.no_grad():
            ref = reference_probs(head, io, d.tokens + drafted[:-1], d.hidden, steps, 0.8)
        torch.testing.assert_close(tree.probs, ref, atol=2e-5, rtol=1e-4)
        # Commit `accept` drafts plus a correction token, with the target's features for them.
        committed = d.tokens + drafted[:accept] + [int(torch.randint(3, 250, ()))]
        with torch.no_grad():
            f, _ = forward_features(model, torch.tensor([committed[:-1]]))
        d.commit(list(range(accept)), f.slice(len(d.tokens) - 1, len(committed) - 1), committed[-1])


@pytest.mark.parametrize(
    "name,cfg",
    [
        ("tiny-random-llama", mtp.MTPConfig(num_modules=3)),
        ("tiny-random-gemma3", mtp.MTPConfig(recursive=True, num_steps=2)),  # sliding window 64 crossed
    ],
)
def test_drafting_together_equals_each_requests_own_draft(targets, name: str, cfg) -> None:
    """MTPDrafter.draft_together (the batched decoder's rows, one pass of each step's module for all): requests
    with contexts of different lengths (their new positions and committed keys padded to the longest) and
    different draft lengths get, round after round of commits, the chain their own draft makes, sampled from
    their own generator with the same q, and their caches end as their own drafts leave them. A request's keys
    seen by another (mutant together_sees_padded_keys) fail it."""
    model, _, io = targets[name]
    head = _lively_head(cfg, io)
    seq = torch.randint(3, 250, (90,)).tolist()
    feats, _ = forward_features(model, torch.tensor([seq]))
    lengths = [70, 12, 41]
    cap = None if not cfg.recursive else 4

    def begun(n: int, seed: int):
        d = mtp.drafter(head, io, max_steps=cap, generator=torch.Generator().manual_seed(seed))
        d.begin(torch.tensor([seq[:n]]), feats.slice(0, n), seq[n])
        return d

    alone = [begun(n, i) for i, n in enumerate(lengths)]
    together = [begun(n, i) for i, n in enumerate(lengths)]
    for ks, accept in (([3, 2, 4], [0, 2, 1]), ([4, 0, 1], [3, 0, 1]), ([2, 3, 3], [1, 2, 0])):
        mtp.MTPDrafter.draft_together(together, ks, 0.8)
        for a, t, k, acc in zip(alone, together, ks, accept):
            if k == 0:
                assert t.ready is None
                continue
            want, got = a.draft(k, 0.8), t.draft(k, 0.8)
            assert got.tokens.tolist() == want.tokens.tolist() and t.drafted == a.drafted
            torch.testing.assert_close(got.probs, want.probs, atol=2e-5, rtol=1e-4)
            for ca, ct, oa, ot in zip(a.caches, t.caches, a.outs, t.outs):
                assert mtp.cache_length(ct) == mtp.cache_length(ca)
                torch.testing.assert_close(ot, oa, atol=2e-5, rtol=1e-4)
            # commit `acc` drafts plus a correction token with the target's features for them (the sequence's)
            m, n = len(a.tokens) - 1, min(acc, len(a.drafted))
            for d in (a, t):
                d.commit(list(range(n)), feats.slice(m, m + n + 1), seq[m + n + 1])


@pytest.fixture(scope="module")
def trained(tiny_target):
    """Two modules overfit on the target's own greedy continuation of one prompt (drafts get accepted)."""
    model, _, io = tiny_target
    torch.manual_seed(1)
    prompt = torch.randint(3, 250, (12,)).tolist()
    out, _ = plain_generate(model, torch.tensor([prompt]), max_new_tokens=32)
    head = mtp.build(mtp.MTPConfig(num_modules=2), io)
    overfit(mtp.loss, head, make_batch(model, [prompt + out.tolist()], prompt_len=len(prompt)), io, steps=30)
    return head.eval(), prompt


def test_greedy_decoding_is_identical(tiny_target, trained) -> None:
    model, _, io = tiny_target
    head, prompt = trained
    for ids, n in ((torch.tensor([prompt]), 32), (torch.tensor([prompt[::-1]]), 20)):
        ref, eos = hf_greedy(model, ids, n)
        out, stats = speculative_generate(model, ids, mtp.drafter(head, io), k=2, max_new_tokens=n, eos_token_id=eos)
        assert out.tolist() == ref.tolist()
        if n == 32:
            assert stats.tau > 1.5  # learnt continuation: accepted drafts exercised the rollback


def test_sampling_is_exact(tiny_target, trained) -> None:
    """Speculative sampling with the mtp drafter matches plain sampling's law (see assert_sampling_exact)."""
    model, _, io = tiny_target
    head, prompt = trained
    assert_sampling_exact(model, prompt, lambda i: mtp.drafter(head, io, generator=torch.Generator().manual_seed(10_000 + i)))


def test_save_load_round_trip_and_mismatch(tmp_path: Path, targets, trained) -> None:
    model, _, io = targets["tiny-random-llama"]
    head, prompt = trained
    save_head(tmp_path / "head", head, head.cfg, io)
    again, cfg, _ = load_head(tmp_path / "head", io)
    assert cfg == head.cfg
    batch = make_batch(model, [prompt + prompt])
    assert torch.equal(mtp.loss(again, batch, io)[0], mtp.loss(head, batch, io)[0])
    feats, _ = forward_features(model, torch.tensor([prompt]))
    drafts = []
    for h in (head, again):
        d = mtp.drafter(h, io)
        d.begin(torch.tensor([prompt]), feats, 7)
        drafts.append(d.draft(2, 0.0).tokens.tolist())
    assert drafts[0] == drafts[1]
    with pytest.raises(HeadMismatchError, match="fingerprint"):
        load_head(tmp_path / "head", targets["tiny-random-qwen2"][2])


def test_tiny_config_trains_a_loadable_head(tmp_path: Path, tiny_target) -> None:
    out = tmp_path / "run"
    proc = run_proc(
        [sys.executable, "train/mtp.py", "--config", "configs/tiny-mtp.yaml", "--out", str(out), "--train.epochs=1"],
        cwd=ROOT, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    head, cfg, meta = load_head(out / "head", tiny_target[2])
    assert cfg.family == "mtp" and cfg.num_modules == 2 and meta["extra"]["step"] > 0
