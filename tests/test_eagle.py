"""EAGLE heads: shifts, TTT attention pattern, draft vocab, losses, drafting, head folders.

    .venv/bin/python -m pytest -q tests/test_eagle.py
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from data.features import forward_features, greedy_ids
from heads import eagle
from heads.base import Features, HeadMismatchError, load_head, save_head
from heads.tree import CandidatePool


def _batch(model, head, ids, loss_mask=None):
    feats, _ = forward_features(model, ids, None, head.layer_ids)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "loss_mask": torch.ones_like(ids) if loss_mask is None else loss_mask,
            "last": feats.last, "aux": feats.aux, "target_argmax": greedy_ids(model, feats.last).long()}


def _eagle3(io, **kw):
    torch.manual_seed(0)
    cfg = eagle.Eagle3Config(layer_ids=[1, 2, 3], draft_vocab_size=io.vocab_size, ttt_length=3, **kw)
    return cfg, eagle.build(cfg, io)


# ----------------------------------------------------------------------------------------------- shifts
def test_shift_left_worked_example():
    a = torch.tensor([[10, 11, 12, 13]])
    assert eagle.shift_left(a, 2).tolist() == [[12, 13, 0, 0]]
    assert eagle.shift_left(a, 0).tolist() == [[10, 11, 12, 13]]
    assert eagle.shift_left(a, 5).tolist() == [[0, 0, 0, 0]]
    feats = torch.arange(8.0).view(1, 4, 2)  # feature shifts move whole vectors along time
    assert eagle.shift_left(feats, 1)[0].tolist() == [[2, 3], [4, 5], [6, 7], [0, 0]]
    with pytest.raises(ValueError, match="must be >= 0"):
        eagle.shift_left(a, -1)


def test_step_alignment_worked_example():
    ids = torch.tensor([[10, 11, 12, 13]])
    mask = torch.tensor([[0, 1, 1, 1]])
    tok0, m0 = eagle.step_alignment(ids, mask, 0)
    tok1, m1 = eagle.step_alignment(ids, mask, 1)
    assert tok0.tolist() == [[11, 12, 13, 0]] and m0.tolist() == [[1, 1, 0, 0]]
    assert tok1.tolist() == [[12, 13, 0, 0]] and m1.tolist() == [[1, 0, 0, 0]]


# ----------------------------------------------------------------------------------------------- TTT mask
def test_ttt_attention_matches_the_documented_pattern():
    """T = 4, step 2: keys laid out [step-0 t'=0..3 | step-1 t=0..3 | step-2 t=0..3]; query t sees the
    causal step-0 keys and only its own index at steps 1 and 2 (FORMATS: index 0 at step 1 sees k^0_0, k^1_0)."""
    torch.manual_seed(0)
    t, heads, kv, d = 4, 4, 2, 8
    q = torch.randn(1, heads, t, d)
    keys = [torch.randn(1, kv, t, d) for _ in range(3)]
    vals = [torch.randn(1, kv, t, d) for _ in range(3)]
    mask = torch.tensor([
        # step-0 keys   step-1 keys   step-2 keys
        [1, 0, 0, 0,    1, 0, 0, 0,   1, 0, 0, 0],
        [1, 1, 0, 0,    0, 1, 0, 0,   0, 1, 0, 0],
        [1, 1, 1, 0,    0, 0, 1, 0,   0, 0, 1, 0],
        [1, 1, 1, 1,    0, 0, 0, 1,   0, 0, 0, 1],
    ], dtype=torch.bool)
    dense = eagle.masked_attention(q, torch.cat(keys, 2), torch.cat(vals, 2), mask)
    assert torch.allclose(eagle.ttt_attention(q, keys, vals), dense, atol=1e-6)
    # step 1 uses the first 8 columns' pattern restricted to steps 0 and 1
    dense1 = eagle.masked_attention(q, torch.cat(keys[:2], 2), torch.cat(vals[:2], 2), mask[:, :8])
    assert torch.allclose(eagle.ttt_attention(q, keys[:2], vals[:2]), dense1, atol=1e-6)


# ----------------------------------------------------------------------------------------------- draft vocab
def test_draft_vocab_worked_example_and_round_trip():
    d2t, t2d = eagle.draft_vocab_from_counts(np.array([5, 0, 9, 9, 1]), 3)
    assert d2t.tolist() == [0, 1, 1] and t2d.tolist() == [True, False, True, True, False]
    # round trip: every draft id maps to a target id marked in t2d, and all marked ids are reached once
    counts = np.random.default_rng(0).integers(0, 4, size=300)
    d2t, t2d = eagle.draft_vocab_from_counts(counts, 100)
    target_ids = torch.arange(100) + d2t
    assert t2d[target_ids].all() and int(t2d.sum()) == 100
    assert torch.equal(target_ids, t2d.nonzero().reshape(-1))
    assert int((d2t != 0).sum()) > 0  # an all-zero d2t would silently mean "the first 100 ids"
    with pytest.raises(ValueError, match=r"draft_vocab_size 300 is larger than the \d+ distinct tokens"):
        eagle.draft_vocab_from_counts(counts, 300)


def test_prepare_uses_loss_masked_tokens_and_head_maps_back(tiny_target):
    import datasets

    _, _, io = tiny_target
    ds = datasets.Dataset.from_list([
        {"input_ids": [1, 2, 3, 7, 7, 9], "loss_mask": [0, 0, 0, 1, 1, 1], "length": 6},
        {"input_ids": [2, 9, 40], "loss_mask": [0, 1, 1], "length": 3},
    ])
    cfg = eagle.Eagle3Config(layer_ids=[1, 2, 3], draft_vocab_size=3)
    init = eagle.prepare(cfg, ds, io)
    assert (torch.arange(3) + init["d2t"]).tolist() == [7, 9, 40]  # 1, 2, 3 are prompt tokens
    head = eagle.build(cfg, io)
    head.load_state_dict(init, strict=False)
    assert head.to_target_ids(torch.tensor([0, 1, 2])).tolist() == [7, 9, 40]
    q = head.to_target_probs(torch.tensor([0.5, 0.3, 0.2]), io.vocab_size)
    assert q[[7, 9, 40]].tolist() == pytest.approx([0.5, 0.3, 0.2]) and float(q.sum()) == pytest.approx(1.0)
    # the lm_head starts from the target's rows for those ids (final-norm scale folded in)
    scale = io.norm(torch.ones(1, io.hidden_size)).reshape(-1)
    assert torch.allclose(init["lm_head.weight"], io.lm_head.weight[[7, 9, 40]] * scale, atol=1e-6)
    with pytest.raises(ValueError, match="larger than the 3 distinct tokens"):
        eagle.prepare(eagle.Eagle3Config(layer_ids=[1, 2, 3], draft_vocab_size=4), ds, io)


# ----------------------------------------------------------------------------------------------- losses
@pytest.mark.parametrize("family", ["eagle1", "eagle3"])
def test_loss_decreases_when_overfitting_one_batch(tiny_target, family):
    model, _, io = tiny_target
    torch.manual_seed(0)
    cfg = eagle.Eagle1Config() if family == "eagle1" else eagle.Eagle3Config(
        layer_ids=[1, 2, 3], draft_vocab_size=io.vocab_size, ttt_length=2)
    head = eagle.build(cfg, io)
    ids = torch.randint(0, io.vocab_size, (2, 24))
    batch = _batch(model, head, ids)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    # Cross-entropy against the random target's near-uniform soft labels has their entropy (~5.5 nats) as
    # its floor: EAGLE-1 is judged on its feature term, EAGLE-3 on its step-0 KL (loss minus that floor).
    floor = 0.0
    if family == "eagle3":
        p = io.lm_head(batch["last"]).softmax(-1)
        ent = -(p * p.log()).sum(-1)[:, 1:-1]  # labels at t+1 for the indices t with a token t+2
        floor = float(ent.sum()) / ids.numel()
    key = "loss/feature" if family == "eagle1" else "loss/0"
    losses, top1 = [], []
    for _ in range(40):
        loss, m = eagle.loss(head, batch, io)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(m[key] - floor)
        top1.append(m["top1/0"])
    assert all(b < a for a, b in zip(losses[::10], losses[10::10]))
    assert losses[-1] < 0.3 * losses[0]
    assert top1[0] < 0.1 and top1[-1] > 0.15


def test_eagle3_metrics_count_loss_masked_positions(tiny_target):
    model, _, io = tiny_target
    _, head = _eagle3(io)
    ids = torch.randint(0, io.vocab_size, (1, 10))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1, 1]])
    _, m = eagle.loss(head, _batch(model, head, ids, mask), io)
    # step s at index t predicts x_{t+2+s}: the masked tokens 2..9 that step s can reach are 2+s..9
    assert [m["n/0"], m["n/1"], m["n/2"]] == [8, 7, 6]


def test_eagle3_loss_with_a_draft_vocab_equals_the_full_logits_reference(tiny_target):
    """The loss computes only the draft vocab's rows of the target's logits and reads the stored argmax;
    it must equal the definition computed from the full logits (soft label = the full logits at the
    draft ids, softmaxed; mask = loss mask times "the full argmax is in the draft vocab")."""
    model, _, io = tiny_target
    torch.manual_seed(0)
    n = 40
    head = eagle.build(eagle.Eagle3Config(layer_ids=[1, 2, 3], draft_vocab_size=n, ttt_length=1), io)
    counts = torch.randint(0, 5, (io.vocab_size,), generator=torch.Generator().manual_seed(1)).numpy()
    head.d2t, head.t2d = eagle.draft_vocab_from_counts(counts, n)
    ids = torch.randint(0, io.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    batch = _batch(model, head, ids)
    with torch.no_grad():
        loss, m = eagle.loss(head, batch, io)
        full = io.lm_head(batch["last"]).float()
        draft = head.draft_ids()
        assert not bool(head.t2d[full.argmax(-1)].all())  # some positions' argmax lies outside the vocab
        o = head.midlayer.finish(*_step0(head, io, batch))
        logq = head.logits(o, io).float().log_softmax(-1)
        p = full[..., draft].softmax(-1)[:, 1:]  # the label at index t is the target at t+1
        mask = (head.t2d[full.argmax(-1)][:, 1:] & (torch.arange(11) < 10)).float()  # index t needs x_{t+2}
        want = -(mask * (p * logq[:, :-1]).sum(-1)).sum() / ids.numel()
    assert float(loss) == pytest.approx(float(want), rel=1e-5)
    assert m["n/0"] == 2 * 10


def _step0(head, io, batch):
    """TTT step 0 of `head` on `batch` up to attention: (attention output, residual)."""
    hidden = head.project(Features(last=batch["last"], aux=batch["aux"]))
    b, t = batch["input_ids"].shape
    cos, sin = eagle.rotary(io, hidden, torch.arange(t).expand(b, t))
    q, k, v, resid = head.rows(io.embed(eagle.shift_left(batch["input_ids"], 1)), hidden, cos, sin)
    return eagle.ttt_attention(q, [k], [v]), resid


# ----------------------------------------------------------------------------------------------- drafting
def test_chain_drafting_computes_what_training_time_test_trains(tiny_target):
    """Greedy drafts from the drafter (own KV cache, own outputs fed back) equal the TTT steps at the
    last prompt index when the sequence continues with those drafts: training and inference agree."""
    model, _, io = tiny_target
    _, head = _eagle3(io)
    head.eval()
    ids = torch.randint(0, io.vocab_size, (1, 9))
    n = 6
    prompt, nxt = ids[:, :n], int(ids[0, n])
    feats, _ = forward_features(model, prompt, None, head.layer_ids)
    d = eagle.drafter(head, io)
    d.begin(prompt, feats, nxt)
    tree = d.draft(3, 0.0)
    seq = torch.cat([prompt[0], torch.tensor([nxt]), tree.tokens])[None]
    step_logits = []
    hook = head.lm_head.register_forward_hook(lambda mod, inp, out: step_logits.append(out[0, n - 1]))
    with torch.no_grad():
        eagle.loss(head, _batch(model, head, seq), io)
    hook.remove()
    assert [int(head.to_target_ids(lg.argmax())) for lg in step_logits] == tree.tokens.tolist()
    # the drafter's own logits for its first draft are the TTT step-0 logits
    assert torch.allclose(d.last_logits, step_logits[0], atol=1e-4)


def test_commit_rolls_back_to_the_accepted_path(tiny_target):
    model, _, io = tiny_target
    _, head = _eagle3(io)
    ids = torch.randint(0, io.vocab_size, (1, 12))
    feats, _ = forward_features(model, ids, None, head.layer_ids)
    # drafter A: begin at 6, draft, accept node 0 only, next token ids[8]
    a = eagle.drafter(head, io)
    a.begin(ids[:, :6], feats.slice(0, 6), int(ids[0, 6]))
    a.draft(4, 0.0)
    a.tree_tokens[0] = int(ids[0, 7])  # pretend the draft was x7 so the accepted path is the real sequence
    a.commit([0], feats.slice(6, 8), int(ids[0, 8]))
    # drafter B: begin directly at 8 with the same prefix
    b = eagle.drafter(head, io)
    b.begin(ids[:, :8], feats.slice(0, 8), int(ids[0, 8]))
    assert a.n == b.n == 8
    assert torch.allclose(a.cache.layers[0].keys, b.cache.layers[0].keys, atol=1e-5) and torch.allclose(a.last_logits, b.last_logits, atol=1e-4)


def _family_head(io, family: str):
    """A fresh EAGLE-3 (the module's usual one), EAGLE-3 with head.pointer (half the vocab in its draft vocab, the
    request's tokens in the other half reached by the pointer) or EAGLE-1 head, in eval mode."""
    if family == "eagle3":
        _, head = _eagle3(io)
    elif family == "eagle3_pointer":
        torch.manual_seed(0)
        head = eagle.build(eagle.Eagle3Config(layer_ids=[1, 2, 3], draft_vocab_size=io.vocab_size // 2, ttt_length=3,
                                              pointer=True), io)
    else:
        torch.manual_seed(0)
        head = eagle.build(eagle.Eagle1Config(), io)
    return head.eval()


def _perturbed(head):
    """A copy of `head` with different weights: a second head for requests of two heads in one call."""
    other = copy.deepcopy(head)
    with torch.no_grad():
        for w in other.parameters():
            w.add_(0.5 * torch.randn_like(w))
    return other


@pytest.mark.parametrize("family", ["eagle3", "eagle1", "eagle3_pointer"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_drafting_together_equals_each_requests_own_draft(tiny_target, family, temperature):
    """EagleDrafter.draft_together (the batched decoder's rows, one head pass per depth): requests with
    committed rows of different lengths and different draft lengths get the chain their own draft makes,
    sampled ones from their own generator with the same q, and their own state is left as it was."""
    model, _, io = tiny_target
    head = _family_head(io, family)
    torch.manual_seed(1)
    ids = torch.randint(0, io.vocab_size, (1, 16))
    feats, _ = forward_features(model, ids, None, head.layer_ids)

    def begun(n: int, seed: int):
        d = eagle.drafter(head, io, generator=torch.Generator().manual_seed(seed))
        d.begin(ids[:, :n], feats.slice(0, n), int(ids[0, n]))
        return d

    lengths, ks = [5, 11, 8, 3], [3, 1, 4, 0]
    alone = [begun(n, 10 + i) for i, n in enumerate(lengths)]
    together = [begun(n, 10 + i) for i, n in enumerate(lengths)]
    eagle.EagleDrafter.draft_together(together, ks, temperature)
    for a, t, k in zip(alone, together, ks):
        want, got = a.draft(k, temperature), t.draft(k, temperature)
        assert got.tokens.tolist() == want.tokens.tolist() and len(got) == k
        assert (got.probs is None) == (want.probs is None)
        if want.probs is not None:
            assert torch.allclose(got.probs, want.probs, atol=1e-5)
        assert t.tree_tokens == a.tree_tokens and t.n == a.n
        assert torch.equal(t.cache.layers[0].keys, a.cache.layers[0].keys)
    # requests of two heads in one call: each drafted with its own head
    other = _perturbed(head)
    mixed = [begun(5, 1), begun(9, 2)]
    mixed[1].head = other
    mixed[1].begin(ids[:, :9], feats.slice(0, 9), int(ids[0, 9]))
    solo = eagle.drafter(other, io, generator=torch.Generator().manual_seed(2))
    solo.begin(ids[:, :9], feats.slice(0, 9), int(ids[0, 9]))
    eagle.EagleDrafter.draft_together([*mixed, begun(7, 3)], [3, 3, 3], temperature)
    assert mixed[1].ready is None  # the only request of its head: left to its own draft
    assert mixed[1].draft(3, temperature).tokens.tolist() == solo.draft(3, temperature).tokens.tolist()
    # a chain made together is for the draft it was made for: another length drafts on its own
    eagle.EagleDrafter.draft_together(together, [2, 2, 2, 2], temperature)
    assert len(together[0].draft(1, temperature)) == 1 and together[0].ready is None


@pytest.mark.parametrize("family", ["eagle3", "eagle1", "eagle3_pointer"])
def test_settling_together_equals_each_requests_own_commit(tiny_target, family):
    """EagleDrafter.settle_together (the batched decoder's held commits, one head pass per head): requests with
    committed rows of different lengths and paths of different lengths end in the state their own commits
    make (rows, keys, last logits, the next draft), a request of another head settles with its own head, and
    a held commit is settled by the request's own next draft."""
    model, _, io = tiny_target
    head = _family_head(io, family)
    torch.manual_seed(1)
    ids = torch.randint(0, io.vocab_size, (1, 20))
    feats, _ = forward_features(model, ids, None, head.layer_ids)
    other = _perturbed(head)

    def begun(n: int, hold: bool, h=head):
        d = eagle.drafter(h, io)
        d.hold = hold
        d.begin(ids[:, :n], feats.slice(0, n), int(ids[0, n]))
        return d

    starts, paths, heads = [5, 11, 8, 3, 9], [3, 1, 4, 2, 2], [head, head, head, head, other]
    alone = [begun(n, False, h) for n, h in zip(starts, heads)]
    together = [begun(n, True, h) for n, h in zip(starts, heads)]
    for drafters in (alone, together):
        for d, n, m in zip(drafters, starts, paths):  # the path x_{n+1} .. x_{n+m}: features at n .. n+m-1
            d.commit_tokens(ids[0, n + 1:n + m].tolist(), feats.slice(n, n + m), int(ids[0, n + m]))
    assert all(t.held is not None and t.n == n for t, n in zip(together, starts))
    rows = []
    real_rows = type(head).rows
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(head), "rows", lambda self, emb, *a: rows.append(emb.shape[0]) or real_rows(self, emb, *a))
        eagle.EagleDrafter.settle_together(together)
    assert sorted(rows) == [1, 4]  # the four requests of one head in one pass, the other head's alone
    for a, t in zip(alone, together):
        assert t.held is None and t.n == a.n
        assert torch.allclose(t.cache.layers[0].keys, a.cache.layers[0].keys, atol=1e-5)
        assert torch.allclose(t.cache.layers[0].values, a.cache.layers[0].values, atol=1e-5)
        assert torch.allclose(t.last_logits, a.last_logits, atol=1e-4)
        assert t.draft(3, 0.0).tokens.tolist() == a.draft(3, 0.0).tokens.tolist()
    # a held commit is run by the request's own next draft (and by a second commit, before it is held)
    d, ref = begun(6, True), begun(6, False)
    for x in (d, ref):
        x.commit_tokens([int(ids[0, 7])], feats.slice(6, 8), int(ids[0, 8]))
        x.commit_tokens([], feats.slice(8, 9), int(ids[0, 9]))
    assert d.n == 8 and d.held is not None
    assert d.draft(2, 0.0).tokens.tolist() == ref.draft(2, 0.0).tokens.tolist() and d.n == ref.n == 9


def test_dynamic_tree_is_topological_and_ancestor_closed(tiny_target):
    model, _, io = tiny_target
    _, head = _eagle3(io)
    ids = torch.randint(0, io.vocab_size, (1, 8))
    feats, _ = forward_features(model, ids, None, head.layer_ids)
    d = eagle.drafter(head, io, tree="dynamic", top_k=3, total_tokens=10)
    d.begin(ids, feats, 5)
    tree = d.draft(4, 0.0)
    assert len(tree) == 10 and tree.probs is None and tree.sampling == "topk"
    parents = tree.parents.tolist()
    assert all(-1 <= p < i for i, p in enumerate(parents))
    assert sum(p == -1 for p in parents) <= 3
    sampled = d.draft(4, 0.7)
    assert sampled.probs.shape == (10, io.vocab_size)
    assert torch.allclose(sampled.probs.sum(-1), torch.ones(10), atol=1e-5)


def test_nodes_is_how_many_nodes_each_draft_returns(tiny_target):
    """eval.policy prices a pass's verify rows by `nodes(k)`: it must be len(draft(k)) for chains and for
    dynamic trees whose budget binds (total_tokens) or does not (top_k, then top_k^2 per depth)."""
    model, _, io = tiny_target
    _, head = _eagle3(io)
    ids = torch.randint(0, io.vocab_size, (1, 8), generator=torch.Generator().manual_seed(4))
    feats, _ = forward_features(model, ids, None, head.layer_ids)
    for kw in ({"tree": "chain"}, {"tree": "chain", "depth": 2}, {"tree": "dynamic", "top_k": 2, "total_tokens": 3},
               {"tree": "dynamic", "top_k": 3, "total_tokens": 60}, {"tree": "dynamic", "top_k": 2, "total_tokens": 7}):
        d = eagle.drafter(head, io, **kw)
        d.begin(ids, feats, 5)
        for k in range(5):
            assert d.nodes(k) == len(d.draft(k, 0.0)), (kw, k)


def test_dynamic_tree_skips_only_expansions_that_cannot_make_the_selection(tiny_target, monkeypatch):
    """Mutant dynamic_tree_prunes_live_nodes: CandidatePool.cutoff leaves unexpanded the nodes scoring below the
    total_tokens-th best so far. Over random peaked draft distributions (a top child often keeps most of its
    parent's probability, as a trained head's does: only then is a node near the cutoff worth expanding), the
    trees must be those of expanding every node (cutoff -inf), node for node, while rows are saved."""
    _, _, io = tiny_target
    _, head = _eagle3(io)
    vocab = 12

    def row(path: tuple[int, ...]) -> torch.Tensor:  # the draft logits after `path`, the same whenever asked
        g = torch.Generator().manual_seed(hash(path) % (2**31))
        return torch.randn(vocab, generator=g) * float(torch.empty(1).uniform_(1.0, 6.0, generator=g))

    def path(pool, i):
        out = []
        while i >= 0:
            out.append(pool.nodes[i].token)
            i = pool.nodes[i].parent
        return tuple(reversed(out))

    expanded, request = [], [0]  # rows per head pass; the request whose distributions are drawn

    def fake_expand(self, pool, expand):
        expanded.append(len(expand))
        return torch.stack([row((request[0],) + path(pool, i)) for i in expand])

    monkeypatch.setattr(eagle.EagleDrafter, "_expand", fake_expand)

    def trees():
        out = []
        for seed in range(60):
            for top_k, total, depth in ((2, 3, 3), (3, 4, 4), (2, 5, 5), (4, 6, 3)):
                d = eagle.drafter(head, io, tree="dynamic", top_k=top_k, total_tokens=total)
                request[0] = seed
                d.last_logits = row((seed,))
                t = d._draft_dynamic(depth, 0.0)
                out.append((t.tokens.tolist(), t.parents.tolist()))
        return out

    pruned, pruned_rows = trees(), sum(expanded)
    expanded.clear()
    monkeypatch.setattr(CandidatePool, "cutoff", lambda self, total: float("-inf"))
    full, full_rows = trees(), sum(expanded)
    assert pruned == full
    assert pruned_rows < 0.8 * full_rows


def test_factory_hands_a_dynamic_tree_its_sizes(tiny_target):
    """eval.tree_topk and eval.tree_tokens reach the drafter (eval/run.py passes them for tree: dynamic)."""
    _, _, io = tiny_target
    _, head = _eagle3(io)
    d = eagle.drafter_factory(head, io, "dynamic", 3, topk=2, tokens=5)()
    assert (d.tree, d.top_k, d.total_tokens) == ("dynamic", 2, 5)
    assert eagle.drafter_factory(head, io, "dynamic", 3)().total_tokens == 60  # EAGLE-2's own defaults


def test_dynamic_tree_of_one_child_per_node_is_the_chain_row_for_row(tiny_target):
    """top_k = 1 makes the EAGLE-2 tree a chain: every draft row must see the same token, hidden input, keys
    and RoPE position as the chain drafter's (depth-d node at position n-1+d), so the logits agree."""
    model, _, io = tiny_target
    _, head = _eagle3(io)
    head.eval()
    ids = torch.randint(0, io.vocab_size, (1, 9), generator=torch.Generator().manual_seed(3))
    feats, _ = forward_features(model, ids, None, head.layer_ids)
    logits = {}
    for tree in ("chain", "dynamic"):
        d = eagle.drafter(head, io, tree=tree, top_k=1, total_tokens=5)
        d.begin(ids, feats, 7)
        logits[tree] = []
        hook = head.lm_head.register_forward_hook(lambda mod, inp, out, t=tree: logits[t].append(out.reshape(-1)))
        drafted = d.draft(5, 0.0)
        hook.remove()
        logits[tree].insert(0, d.last_logits)
        assert drafted.parents.tolist() == [-1, 0, 1, 2, 3], tree
    assert len(logits["chain"]) == len(logits["dynamic"]) == 5
    for depth, (a, b) in enumerate(zip(logits["chain"], logits["dynamic"]), start=1):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5, msg=lambda m, d=depth: f"depth {d}: {m}")


@pytest.mark.parametrize("tree", ["chain", "dynamic"])
def test_greedy_speculative_output_equals_plain_decoding(tiny_target, tree):
    from drafters_common import hf_greedy

    from eval.decoder import speculative_generate

    model, _, io = tiny_target
    for family in ("eagle1", "eagle3", "eagle3_pointer"):
        torch.manual_seed(1)
        cfg = eagle.Eagle1Config() if family == "eagle1" else eagle.Eagle3Config(
            layer_ids=[1, 2, 3], draft_vocab_size=200, ttt_length=2, pointer=family == "eagle3_pointer")
        head = eagle.build(cfg, io)
        prompt = torch.randint(0, io.vocab_size, (1, 10))
        ref, eos = hf_greedy(model, prompt, 20)
        d = eagle.drafter(head, io, tree=tree, top_k=3, total_tokens=8)
        out, stats = speculative_generate(model, prompt, d, k=3, max_new_tokens=20, eos_token_id=eos)
        assert out.tolist() == ref.tolist(), family
        assert stats.tau >= 1.0


# ----------------------------------------------------------------------------------------------- folders
def test_head_folder_round_trip_and_mismatches_are_named(tiny_target, tmp_path):
    from data.config import TargetConfig
    from data.target import load_target

    _, _, io = tiny_target
    cfg, head = _eagle3(io)
    save_head(tmp_path / "h", head, cfg, io)
    loaded, cfg2, _ = load_head(tmp_path / "h", io)
    assert cfg2 == cfg
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), loaded.state_dict().values()))

    other = copy.copy(io)
    other.config = copy.deepcopy(io.config)
    other.config.hidden_size = 32
    with pytest.raises(HeadMismatchError, match="hidden_size is 64 but the target has 32"):
        load_head(tmp_path / "h", other)
    other.config = copy.deepcopy(io.config)
    other.config.vocab_size = 300
    with pytest.raises(HeadMismatchError, match="vocab_size is 259 but the target has 300"):
        load_head(tmp_path / "h", other)
    _, _, qwen = load_target(TargetConfig(name_or_path="tiny-random-qwen2", device="cpu"))
    with pytest.raises(HeadMismatchError, match="made for target"):
        load_head(tmp_path / "h", qwen)
    meta = json.loads((tmp_path / "h" / "config.json").read_text())
    meta["layer_ids"] = [0, 1, 2]
    (tmp_path / "h" / "config.json").write_text(json.dumps(meta))
    with pytest.raises(HeadMismatchError, match=r"layer_ids \[0, 1, 2\] do not match \[1, 2, 3\]"):
        load_head(tmp_path / "h", io)


def test_default_layer_ids():
    assert eagle.default_layer_ids(32) == [2, 16, 29]  # Llama-3.1-8B, as SpecForge / EAGLE
    assert eagle.default_layer_ids(30) == [2, 15, 27]  # SmolLM2-135M
    assert eagle.default_layer_ids(4) == [1, 2, 3]  # tiny targets: the defaults would collide
    with pytest.raises(ValueError, match="must be ascending"):
        eagle.feature_layers(eagle.Eagle3Config(layer_ids=[3, 1]), type("C", (), {"num_hidden_layers": 4})())


def test_features_are_required(tiny_target):
    _, _, io = tiny_target
    _, head = _eagle3(io)
    with pytest.raises(ValueError, match="needs `aux`"):
        head.project(Features(last=torch.zeros(1, 2, io.hidden_size)))


def test_norm_before_residual_makes_the_residual_the_normed_state(tiny_target):
    """head.norm_before_residual (speculators' flag): y = hidden_norm(g) + o_proj(attn); off, y = g + ...
    The drafter shares `rows`, so tests/test_alignment.py's unroll check covers drafting with it on."""
    model, _, io = tiny_target
    _, off = _eagle3(io)
    _, on = _eagle3(io, norm_before_residual=True)
    with torch.no_grad():
        on.midlayer.hidden_norm.weight.mul_(1.5)
        off.load_state_dict(on.state_dict())
        batch = _batch(model, on, torch.randint(0, io.vocab_size, (1, 8)))
        (_, r_on), (_, r_off) = _step0(on, io, batch), _step0(off, io, batch)
        hidden = on.project(Features(last=batch["last"], aux=batch["aux"]))
    assert torch.equal(r_on, on.midlayer.hidden_norm(hidden)) and torch.equal(r_off, hidden)
    assert not torch.allclose(eagle.loss(on, batch, io)[0], eagle.loss(off, batch, io)[0])
