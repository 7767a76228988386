"""Training/inference alignment oracles: what a head is trained on at step s is what it computes when drafting.

EAGLE-3 training-time test (TTT): for every index t of a sequence and every unrolled step s, the training
unroll's step-s logits must equal (allclose) the logits the drafter computes by its own inference path, run
s times (the head consuming its own outputs, RoPE at the real positions t+s); and the step-s soft label must
be the target's distribution at t+1+s (checked by recomputing the loss from independently taken target
distributions). The same for MTP's K modules (step k predicts x[t+1+k]) and Medusa's head offsets (head i
predicts x[t+2+i]). A label taken one position early, RoPE not advanced per step, or a step reading the
target's features instead of its own output fails here (see scripts/check_mutants.py).

    .venv/bin/python -m pytest -q tests/test_alignment.py
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F

from data.features import forward_features, greedy_ids
from heads import eagle, medusa, mtp
from heads.eagle import losses as eagle_losses

T = 14  # sequence length of the oracle batches
STEPS = 3


def _spread(head: torch.nn.Module, std: float, seed: int) -> None:
    """Re-initialise a head's linear weights larger: at the default std its logits are nearly uniform, and
    a label taken from the wrong position would change the loss too little to see."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in head.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) * std)


@contextmanager
def recording(module: torch.nn.Module, pick: Callable = lambda out: out.float()) -> Iterator[list[torch.Tensor]]:
    """The outputs of every call of `module` inside the block (passed through `pick`), in call order."""
    got: list[torch.Tensor] = []
    handle = module.register_forward_hook(lambda mod, inp, out: got.append(pick(out)))
    try:
        yield got
    finally:
        handle.remove()


# ----------------------------------------------------------------------------------------------- EAGLE-3
def _eagle3_training(model, head, io, seq: torch.Tensor) -> tuple[list[torch.Tensor], dict]:
    """(step-s logits [T, draft_vocab] of the training unroll for s < ttt_length, the loss metrics)."""
    feats, _ = forward_features(model, seq, None, head.layer_ids)
    batch = {"input_ids": seq, "attention_mask": torch.ones_like(seq), "loss_mask": torch.ones_like(seq),
             "last": feats.last, "aux": feats.aux, "target_argmax": greedy_ids(model, feats.last).long()}
    with recording(head.lm_head, lambda out: out[0].float()) as steps, torch.no_grad():
        _, metrics = eagle.loss(head, batch, io)
    return steps, metrics


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_eagle3_ttt_steps_are_the_drafters_own_unroll_and_labels_sit_at_t_plus_1_plus_s(tiny_target,
                                                                                       norm_before_residual):
    model, _, io = tiny_target
    torch.manual_seed(0)
    cfg = eagle.Eagle3Config(layer_ids=[1, 2, 3], draft_vocab_size=200, ttt_length=STEPS,
                             norm_before_residual=norm_before_residual)
    head = eagle.build(cfg, io).eval()
    _spread(head, 0.15, seed=1)
    ids = torch.randint(3, 250, (1, T), generator=torch.Generator().manual_seed(2))
    for n in range(3, T - STEPS):  # index t = n - 1: the drafter begins with n prompt tokens and x_n
        d = eagle.drafter(head, io)
        d.begin(ids[:, :n], forward_features(model, ids[:, :n], None, head.layer_ids)[0], int(ids[0, n]))
        with recording(head.lm_head, lambda out: out.reshape(-1, out.shape[-1])[-1].float()) as drafted:
            tree = d.draft(STEPS, 0.0)  # greedy: step s reads the draft of step s-1, at position n-1+s
        # The sequence continues with the drafts, so the training unroll reads the same tokens.
        seq = torch.cat([ids[0, : n + 1], tree.tokens])[None]
        steps, _ = _eagle3_training(model, head, io, seq)
        inference = [d.last_logits] + drafted
        assert len(steps) == STEPS
        for s in range(STEPS):
            torch.testing.assert_close(steps[s][n - 1], inference[s], atol=1e-4, rtol=1e-4,
                                       msg=lambda m, s=s, n=n: f"TTT step {s} at index {n - 1}: {m}")

    # Labels: recompute every step's loss from the target's own logits (a full forward, not the features).
    steps, metrics = _eagle3_training(model, head, io, ids)
    with torch.no_grad():
        target_logits = model(input_ids=ids).logits[0].float()
    draft_ids = head.draft_ids()
    p = target_logits[:, draft_ids].softmax(-1)
    in_vocab = head.t2d[target_logits.argmax(-1)].float()
    for s in range(STEPS):
        loss = 0.0
        for t in range(T - 2 - s):  # index t predicts x_{t+2+s}: its label is the target's p at t+1+s
            ce = -(p[t + 1 + s] * steps[s][t].log_softmax(-1)).sum()
            loss = loss + in_vocab[t + 1 + s] * ce
        assert abs(float(loss) / T - metrics[f"loss/{s}"]) < 1e-4 * max(1.0, metrics[f"loss/{s}"]), s


def test_eagle3_chain_is_each_start_positions_run_of_hits_through_the_ttt_steps(tiny_target):
    """`chain/s` (heads.losses.chain_metrics) counts index t when steps 0..s at t ALL hit. An untrained head hits
    nothing, so the labels (`target_argmax`) are set from the drafts themselves: position u gets step u % 3's draft
    at index u - 1 - u % 3, which completes the chain of every third index and leaves others partial; the direct
    count from the recorded step logits must equal the metric (a chain read across indices, or one started
    from another step's mask, does not)."""
    model, _, io = tiny_target
    torch.manual_seed(0)
    head = eagle.build(eagle.Eagle3Config(layer_ids=[1, 2, 3], draft_vocab_size=200, ttt_length=STEPS), io).eval()
    _spread(head, 0.15, seed=1)
    ids = torch.randint(3, 250, (1, T), generator=torch.Generator().manual_seed(2))
    feats, _ = forward_features(model, ids, None, head.layer_ids)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids),
             "last": feats.last, "aux": feats.aux, "target_argmax": greedy_ids(model, feats.last).long()}
    draft_ids = head.draft_ids()
    with recording(head.lm_head, lambda out: draft_ids[out[0].argmax(-1)]) as drafts, torch.no_grad():
        eagle.loss(head, batch, io)
    labels = batch["target_argmax"].clone()
    for u in range(1, T):
        if u - 1 - u % STEPS >= 0:
            labels[0, u] = drafts[u % STEPS][u - 1 - u % STEPS]
    with torch.no_grad():
        _, metrics = eagle.loss(head, {**batch, "target_argmax": labels}, io)
    starts = T - 2  # index t predicts x_{t+2} at step 0
    run = torch.ones(starts)
    for s in range(STEPS):
        hit = torch.zeros(starts)
        hit[: T - 2 - s] = (drafts[s][: T - 2 - s] == labels[0, 1 + s : T - 1]).float()
        run = run * hit
        assert metrics[f"chain/{s}"] == pytest.approx(float(run.sum()) / starts), s
    assert metrics[f"chain/{STEPS - 1}"] >= 3 / starts  # the planted full chains count
    assert metrics["chain/0"] == pytest.approx(metrics["top1/0"]) and metrics["n/chain"] == metrics["n/0"]


def test_eagle3_pointer_drafts_the_requests_own_tokens_alike_in_training_and_drafting(tiny_target, monkeypatch):
    """head.pointer: at index t = n - 1 every TTT step scores the draft vocab plus the request's tokens outside it
    that the pointer reaches, x_1 .. x_n (each the token after a committed position: never x_{n+1} onwards, not
    even the step's own drafts), each with the log-probability the drafter gives it at depth s; and each step's
    loss is the one recomputed from the target's own logits at t+1+s over that set. A pointer that sees one
    position too many copies step 0's own label."""
    model, _, io = tiny_target
    torch.manual_seed(0)
    head = eagle.build(eagle.Eagle3Config(layer_ids=[1, 2, 3], draft_vocab_size=128, ttt_length=STEPS, pointer=True),
                       io).eval()
    _spread(head, 0.15, seed=1)
    with torch.no_grad():
        head.ptr_gate.bias.fill_(2.0)  # the pointer outweighs the draft vocab, so copy tokens are drafted
    draft_ids = head.draft_ids().tolist()
    vocab = set(draft_ids)
    recorded: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (logits, p, mask) per step
    real_loss = eagle_losses.token_loss
    monkeypatch.setattr(eagle_losses, "token_loss",
                        lambda logits, p, mask, *a: recorded.append((logits[0], p[0], mask[0])) or real_loss(logits, p, mask, *a))

    def training(seq: torch.Tensor) -> tuple[list[dict[int, float]], dict]:
        """Per step, {target id: log-probability} at every index over the ids training scores there; the metrics."""
        feats, _ = forward_features(model, seq, None, head.layer_ids)
        batch = {"input_ids": seq, "attention_mask": torch.ones_like(seq), "loss_mask": torch.ones_like(seq),
                 "last": feats.last, "aux": feats.aux, "target_argmax": greedy_ids(model, feats.last).long()}
        recorded.clear()
        with torch.no_grad():
            _, metrics = eagle.loss(head, batch, io)
        ext = draft_ids + sorted({x for x in seq[0, 1:].tolist() if x not in vocab})  # training's order of the logits
        return [[{ext[j]: float(v) for j, v in enumerate(row) if v > -1e8} for row in logits]
                for logits, _, _ in recorded], metrics

    ids = torch.randint(3, 250, (1, T), generator=torch.Generator().manual_seed(2))
    copied = 0
    for n in range(3, T - STEPS):
        d = eagle.drafter(head, io)
        d.begin(ids[:, :n], forward_features(model, ids[:, :n], None, head.layer_ids)[0], int(ids[0, n]))
        drafted: list[torch.Tensor] = []
        real_logits = d._logits
        d._logits = lambda o, rec=drafted, real=real_logits: rec.append(real(o)) or rec[-1]
        tree = d.draft(STEPS, 0.0)
        held = [x for x in dict.fromkeys(ids[0, 1 : n + 1].tolist()) if x not in vocab]
        assert d.copy_ids == held
        copied += sum(x in held for x in tree.tokens.tolist())
        steps, _ = training(torch.cat([ids[0, : n + 1], tree.tokens])[None])
        for s, row in enumerate([d.last_logits, *(x[0, -1] for x in drafted)]):
            want = dict(zip(draft_ids + d.copy_ids, row.tolist()))
            got = steps[s][n - 1]
            assert got.keys() == want.keys(), (s, n)
            assert max(abs(got[x] - want[x]) for x in want) < 1e-4, (s, n)
    assert copied > 0  # the drafter proposed copy tokens, so their mapping back to target ids was exercised
    # The mixture itself, from scratch at the last begin (n positions): position i's key drafts x_{i+1}.
    feats, _ = forward_features(model, ids[:, :n], None, head.layer_ids)
    with torch.no_grad():
        x = head.norm(d.last_o)[0, 0]
        g = torch.sigmoid(head.ptr_gate(x))
        a = (head.ptr_q(x) @ head.ptr_k(feats.last[0]).T / x.numel() ** 0.5).softmax(-1)
        want = torch.zeros(io.vocab_size)
        want[head.draft_ids()] = (1 - g) * head.lm_head(x).softmax(-1)
        want.index_add_(0, ids[0, 1 : n + 1], g * a)
    torch.testing.assert_close(d._to_probs(d.last_logits.exp()), want, atol=1e-5, rtol=1e-4)

    steps, metrics = training(ids)
    with torch.no_grad():
        target_logits = model(input_ids=ids).logits[0].float()
    for s in range(STEPS):
        loss = 0.0
        for t in range(T - 2 - s):  # index t predicts x_{t+2+s} over draft vocab + the copy tokens of x_1 .. x_{t+1}
            held = draft_ids + sorted({x for x in ids[0, 1 : t + 2].tolist() if x not in vocab})
            assert sorted(steps[s][t]) == sorted(held), (s, t)
            p = target_logits[t + 1 + s, held].softmax(-1)
            log_q = torch.tensor([steps[s][t][x] for x in held]).log_softmax(-1)
            loss = loss + float(int(target_logits[t + 1 + s].argmax()) in held) * -(p * log_q).sum()
        assert abs(float(loss) / T - metrics[f"loss/{s}"]) < 1e-4 * max(1.0, metrics[f"loss/{s}"]), s


# ----------------------------------------------------------------------------------------------- MTP
def test_mtp_step_k_is_the_drafters_step_k_and_predicts_t_plus_1_plus_k(tiny_target):
    model, _, io = tiny_target
    torch.manual_seed(0)
    head = mtp.build(mtp.MTPConfig(num_modules=STEPS), io).eval()
    _spread(head, 0.08, seed=3)
    ids = torch.randint(3, 250, (1, T), generator=torch.Generator().manual_seed(4))

    def training(seq: torch.Tensor) -> tuple[list[torch.Tensor], dict]:
        """Per step k: the logits the loss scores (rows t = 0.. with t+1+k < T), and the metrics."""
        feats, _ = forward_features(model, seq)
        batch = {"input_ids": seq, "attention_mask": torch.ones_like(seq), "loss_mask": torch.ones_like(seq),
                 "last": feats.last}
        with recording(io.lm_head) as got, torch.no_grad():
            _, metrics = mtp.loss(head, batch, io)
        return got, metrics

    for n in range(3, T - STEPS):
        d = mtp.drafter(head, io)
        d.begin(ids[:, :n], forward_features(model, ids[:, :n])[0], int(ids[0, n]))
        with recording(io.lm_head) as drafted:
            tree = d.draft(STEPS, 0.0)
        seq = torch.cat([ids[0, : n + 1], tree.tokens])[None]
        got, _ = training(seq)
        for k in range(1, STEPS + 1):
            torch.testing.assert_close(got[k - 1][n - 1], drafted[k - 1], atol=1e-4, rtol=1e-4,
                                       msg=lambda m, k=k, n=n: f"MTP step {k} at index {n - 1}: {m}")
    got, metrics = training(ids)
    for k in range(1, STEPS + 1):
        assert got[k - 1].shape[0] == T - 1 - k  # rows t whose label x[t+1+k] exists
        ce = F.cross_entropy(got[k - 1], ids[0, 1 + k:])
        assert abs(float(ce) - metrics[f"loss/{k - 1}"]) < 1e-5 * max(1.0, float(ce)), k


# ----------------------------------------------------------------------------------------------- Medusa
def test_medusa_head_i_predicts_t_plus_2_plus_i_in_training_and_drafting(tiny_target):
    model, _, io = tiny_target
    torch.manual_seed(0)
    cfg = medusa.MedusaConfig(num_heads=STEPS, tree=[[0], [0, 0], [0, 0, 0]])
    head = medusa.build(cfg, io).eval()
    _spread(head, 0.05, seed=5)
    ids = torch.randint(3, 250, (1, T), generator=torch.Generator().manual_seed(6))
    feats, _ = forward_features(model, ids)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids),
             "last": feats.last}
    with torch.no_grad():
        _, metrics = medusa.loss(head, batch, io)
        logits = head(feats.last[0]).float()  # [heads, T, V]
    for i in range(STEPS):
        ce = F.cross_entropy(logits[i, : T - 2 - i], ids[0, 2 + i:])  # head i at t scores x[t+2+i]
        assert abs(float(ce) - metrics[f"loss/{i}"]) < 1e-5 * max(1.0, float(ce)), i
    # Drafting: the root x_n sits at n; depth d+1 (token n+1+d) comes from head d at n-1, the same head and
    # position the loss pairs with x[(n-1)+2+d].
    n = 8
    d = medusa.drafter(head, io)
    d.begin(ids[:, :n], forward_features(model, ids[:, :n])[0], int(ids[0, n]))
    tree = d.draft(STEPS, 0.0)
    assert tree.tokens.tolist() == logits[:, n - 1].argmax(-1).tolist()
