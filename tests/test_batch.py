"""Batched verification (eval/batch.py): greedy identity per row against plain batched greedy, and the sweep.

    .venv/bin/python -m pytest -q tests/test_batch.py
"""

from __future__ import annotations

import copy
import itertools
import random
import time
from pathlib import Path

import pytest
import torch
from drafters_common import chi_square_pvalue, exact_law
from test_policy import PROMPT4, head4, vocab4_model  # noqa: F401  (fixtures)

import eval.decoder as decoder
from data.config import load_config
from data.kvcache import DynamicKV, left_pad
from eval.batch import BatchRun, Method, SharedPrefill, batched_generate, interleave_batches, sweep
from eval.costs import DraftCost, VerifyCost, place_head
from eval.drafters import DeferredSync, HybridDrafter, ModelDrafter
from eval.policy import AdaptivePolicy, LoadAware
from heads import registry
from heads.base import DraftTree

ROOT = Path(__file__).resolve().parents[1]


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
        self.ref = self.refs[tuple(prompt_ids.reshape(-1).tolist())]
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
            self.ref = self.refs[tuple(prompt_ids.reshape(-1).tolist())]
            self.pos = 1

        def commit(self, accepted, features, next_token):
            self.pos += len(accepted) + 1

    spec = batched_generate(model, prompts, 10, tok.pad_token_id, k=3,
                            make_drafter=lambda: Junk(refs, 0.0, 0, io.vocab_size))
    assert torch.equal(spec.tokens, plain.tokens)


def _refs(model, tok, prompts, n):
    plain = batched_generate(model, prompts, n, tok.pad_token_id)
    return plain, {tuple(p): plain.tokens[i].tolist() for i, p in enumerate(prompts)}


def test_each_row_keeps_its_own_accepted_length(tiny_target):
    """Row 0 drafts its true continuation, row 1 junk: row 0 still advances k+1 per pass (never the batch minimum)."""
    model, tok, io = tiny_target
    prompts = _prompts(tok, 2)
    n, k = 21, 4
    plain, refs = _refs(model, tok, prompts, n)
    good = dict(refs)
    good[tuple(prompts[1])] = [(t + 7) % io.vocab_size for t in refs[tuple(prompts[1])]]

    class Lenient(OracleDrafter):
        def begin(self, prompt_ids, features, next_token):
            self.ref, self.pos = self.refs[tuple(prompt_ids.reshape(-1).tolist())], 1

        def commit(self, accepted, features, next_token):
            self.pos += len(accepted) + 1

    spec = batched_generate(model, prompts, n, tok.pad_token_id, k=k,
                            make_drafter=lambda: Lenient(good, 0.0, 0, io.vocab_size, full=True))
    assert torch.equal(spec.tokens, plain.tokens)
    fast, slow = spec.row_stats
    assert fast.target_passes == (n - 1) // (k + 1) and fast.tau == pytest.approx(k + 1)
    assert slow.target_passes == n - 1 and slow.accepted_tokens == 0
    # rows leave the batch when done: 4 passes with both rows, then row 1 alone
    assert spec.passes == n - 1


@pytest.fixture(scope="module")
def family_heads(tiny_target):
    _, _, io = tiny_target
    torch.manual_seed(0)
    return {name: registry.get(name).build(load_config(ROOT / registry.get(name).tiny).head, io)
            for name in registry.names()}


@pytest.mark.parametrize("draft_dtype", ["target", "bfloat16"])
@pytest.mark.parametrize("hybrid", [False, True], ids=["head", "head+ngram"])
@pytest.mark.parametrize("family", registry.names())
def test_batched_heads_of_every_family_are_greedy_identical(tiny_target, family_heads, family, hybrid, draft_dtype):
    """A head's drafter per row, fed its row's captured features; with the n-gram merged in, trees per row; the
    head drafting in the target's dtype or in bfloat16 (eval.draft_dtype)."""
    model, tok, io = tiny_target
    prompts = _prompts(tok, 3) + [_prompts(tok, 4)[3] * 2]  # ragged prompt lengths; a repetitive row for the n-gram
    n = 14
    plain, _ = _refs(model, tok, prompts, n)
    head = copy.deepcopy(family_heads[family])
    place_head(head, torch.device("cpu"), torch.float32, draft_dtype)
    make = registry.get(family).drafter_factory(head, io, "auto", 2)
    drafter = (lambda: HybridDrafter(make())) if hybrid else make
    spec = batched_generate(model, prompts, n, tok.pad_token_id, k=2, make_drafter=drafter)
    assert torch.equal(spec.tokens, plain.tokens)
    assert spec.stats.drafted_tokens > 0


@pytest.mark.parametrize("hybrid", [False, True], ids=["head", "head+ngram"])
@pytest.mark.parametrize("family,tree", [(n, t) for n in registry.names() for t in ("static", "dynamic")
                                         if t in registry.get(n).trees])
def test_batched_trees_are_greedy_identical(tiny_target, family_heads, family, tree, hybrid):
    """eval.tree static (Medusa's choices, the block drafter's top-k tree over its slots) and dynamic (EAGLE-2's,
    over EAGLE's steps or the block drafter's slots; top-3, 5 nodes) per row of a batch, alone and with the
    n-gram merged in: a tree per row, drafted together where the family can."""
    model, tok, io = tiny_target
    prompts = _prompts(tok, 3) + [_prompts(tok, 4)[3] * 2]
    n = 14
    plain, _ = _refs(model, tok, prompts, n)
    sizes = {"topk": 3, "tokens": 5} if tree == "dynamic" else {}
    make = registry.get(family).drafter_factory(family_heads[family], io, tree, 3, **sizes)
    drafter = (lambda: HybridDrafter(make())) if hybrid else make
    spec = batched_generate(model, prompts, n, tok.pad_token_id, k=3, make_drafter=drafter)
    assert torch.equal(spec.tokens, plain.tokens)
    assert spec.stats.drafted_tokens > spec.passes  # trees: more than one node a pass


def test_runs_from_one_shared_prefill_are_the_runs_that_prefill_alone(tiny_target, family_heads):
    """The sweep's runs start from one prefill of their prompts (SharedPrefill, forked per run): plain and the
    EAGLE-3 head + n-gram make the same tokens, passes and acceptance as runs that prefill for themselves,
    and one prefill per set of captured layers serves every round; a run on other prompts is refused."""
    model, tok, io = tiny_target
    prompts = _prompts(tok, 3) + [_prompts(tok, 4)[3] * 2]
    make = registry.get("eagle3").drafter_factory(copy.deepcopy(family_heads["eagle3"]), io, "auto", 2)

    def hybrid():
        return HybridDrafter(make())

    def runs(shared):
        return interleave_batches([BatchRun(model, prompts, 12, tok.pad_token_id, shared=shared),
                                   BatchRun(model, prompts, 12, tok.pad_token_id, k=2, make_drafter=hybrid, shared=shared)])

    own_plain, own_spec = runs(None)
    shared = SharedPrefill(model, prompts, tok.pad_token_id)
    for _ in range(2):  # the second round forks a prefill that the first round's runs went on from
        plain, spec = runs(shared)
        assert torch.equal(plain.tokens, own_plain.tokens) and torch.equal(spec.tokens, own_spec.tokens)
        assert spec.passes == own_spec.passes and spec.stats.drafted_tokens == own_spec.stats.drafted_tokens > 0
        assert spec.stats.accepted_per_position == own_spec.stats.accepted_per_position
    assert torch.equal(own_plain.tokens, own_spec.tokens)
    assert len(shared._made) == 2  # one prefill per set of captured layers (plain's, the head's) for both rounds
    with pytest.raises(ValueError, match="other prompts"):
        BatchRun(model, prompts[:2], 12, tok.pad_token_id, shared=shared)


@pytest.mark.parametrize("hybrid", [False, True], ids=["head", "head+ngram"])
def test_fixed_k_rows_draft_their_eagle_chains_together(tiny_target, family_heads, hybrid, monkeypatch):
    """At a fixed k the rows' EAGLE chains come from one head pass per depth for the whole batch
    (EagleDrafter.draft_together) and their commits from one more (settle_together), and the run is the run
    the rows drafting and committing one after another make: the same tokens, passes and acceptance (the
    chains and commits themselves: tests/test_eagle.py), with k head passes a pass instead of B k."""
    from heads.eagle import EagleDrafter

    model, tok, io = tiny_target
    prompts = _prompts(tok, 3) + [_prompts(tok, 4)[3] * 2]
    head = copy.deepcopy(family_heads["eagle3"])
    make = registry.get("eagle3").drafter_factory(head, io, "chain", 3)
    drafter = (lambda: HybridDrafter(make())) if hybrid else make
    rows = []
    real_rows = type(head).rows
    monkeypatch.setattr(type(head), "rows", lambda self, emb, *a: rows.append(tuple(emb.shape[:2])) or real_rows(self, emb, *a))
    together = batched_generate(model, prompts, 14, tok.pad_token_id, k=3, make_drafter=drafter)
    passes = rows[len(prompts):]  # after each row's begin
    alone_from = next((i for i, (b, _) in enumerate(passes) if b == 1), len(passes))
    head_passes = len(rows)
    rows.clear()
    off = BatchRun(model, prompts, 14, tok.pad_token_id, k=3, make_drafter=drafter, together=False)
    assert torch.equal(interleave_batches([off])[0].tokens, together.tokens)
    assert rows and not any(b > 1 for b, _ in rows)  # together=False: every head pass is one request's
    rows.clear()
    monkeypatch.setattr(EagleDrafter, "draft_together", None)
    monkeypatch.setattr(EagleDrafter, "settle_together", None)
    alone = batched_generate(model, prompts, 14, tok.pad_token_id, k=3, make_drafter=drafter)
    assert torch.equal(together.tokens, alone.tokens) and together.passes == alone.passes
    assert together.stats.drafted_tokens == alone.stats.drafted_tokens > 0
    assert together.stats.accepted_per_position == alone.stats.accepted_per_position
    assert not any(b > 1 for b, _ in rows)  # alone: every head pass is one request's
    # together: after the begins every draft step and commit is one head pass for the batch, until the batch
    # is down to its last row
    assert alone_from > 0 and all(b == 1 for b, _ in passes[alone_from:]) and 2 * head_passes < len(rows)


@pytest.mark.parametrize("hybrid", [False, True], ids=["head", "head+ngram"])
def test_policy_rows_draft_and_catch_up_together(tiny_target, family_heads, hybrid, monkeypatch):
    """Under a policy the rows whose choice lets the head draft get their chains together, their deferred
    commits (DeferredSync) settled together first: the run equals the rows drafting one after another (tokens,
    passes, acceptance, chosen lengths), with some head passes over several requests and none alone."""
    from heads.eagle import EagleDrafter

    model, tok, io = tiny_target
    prompts = _prompts(tok, 4)
    head = copy.deepcopy(family_heads["eagle3"])
    make = registry.get("eagle3").drafter_factory(head, io, "chain", 3)
    drafter = (lambda: HybridDrafter(make())) if hybrid else (lambda: DeferredSync(make()))
    sources = ("head", "ngram") if hybrid else ("draft",)
    rows = []
    real_rows = type(head).rows
    monkeypatch.setattr(type(head), "rows", lambda self, emb, *a: rows.append(emb.shape[0]) or real_rows(self, emb, *a))
    drafted_together = []
    real_together = EagleDrafter._draft_rows
    monkeypatch.setattr(EagleDrafter, "_draft_rows", lambda r, t: drafted_together.append(len(r)) or real_together(r, t))
    together = batched_generate(model, prompts, 24, tok.pad_token_id, k=3, make_drafter=drafter,
                                make_policy=lambda: _policy(sources))
    batched = sum(1 for b in rows if b > 1)
    assert drafted_together  # some passes drafted several rows' chains at once
    rows.clear()
    monkeypatch.setattr(EagleDrafter, "draft_together", None)
    monkeypatch.setattr(EagleDrafter, "settle_together", None)
    alone = batched_generate(model, prompts, 24, tok.pad_token_id, k=3, make_drafter=drafter,
                             make_policy=lambda: _policy(sources))
    assert torch.equal(together.tokens, alone.tokens) and together.passes == alone.passes
    assert together.stats.drafted_tokens == alone.stats.drafted_tokens > 0
    assert together.stats.accepted_per_position == alone.stats.accepted_per_position
    assert together.stats.chosen_k == alone.stats.chosen_k
    assert batched > 0 and not any(b > 1 for b in rows)


def _together_head(family, io, family_heads):
    """The head of the tiny config of a family whose rows draft together; dspark: DFlash's with DSpark's layout
    and a Markov head (its slots drawn one by one, every row's bias of a slot in one call)."""
    if family != "dspark":
        return copy.deepcopy(family_heads[family])
    cfg = load_config(ROOT / registry.get("dflash").tiny).head
    cfg.sample_from_anchor, cfg.markov_rank = True, 8
    torch.manual_seed(1)
    head = registry.get("dflash").build(cfg, io)
    torch.nn.init.normal_(head.markov_head.markov_w2.weight, std=0.5)  # a bias that moves the draws
    return head


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
@pytest.mark.parametrize("family", ["dflash", "dspark", "medusa", "mtp"])
def test_fixed_k_rows_of_dflash_medusa_and_mtp_heads_draft_together(tiny_target, family_heads, family, temperature,
                                                                    monkeypatch):
    """A DFlash head's rows draft their blocks in one block pass for the batch (DFlashDrafter.draft_together, its
    held commits projected in one pass: settle_together); a Medusa head's trees come from one pass of each head,
    an MTP head's chains from one pass of each step's module. The run is the run of the rows drafting one after
    another: the same tokens (sampled rows: the same draws of each row's generator), passes and acceptance, with
    head passes over several requests."""
    model, tok, io = tiny_target
    prompts = _prompts(tok, 3) + [_prompts(tok, 4)[3] * 2]
    head = _together_head(family, io, family_heads)
    seeds = itertools.count()
    if family == "medusa":  # top-k trees: no draws
        make = registry.get(family).drafter_factory(head, io, "auto", 3)
    else:  # each row's drafter its own generator (from the global one, rows drafted together would interleave)
        from heads import dflash, mtp
        module = mtp if family == "mtp" else dflash

        def make():
            return module.drafter(head, io, generator=torch.Generator().manual_seed(next(seeds)))
    cls = type(make())
    widths = []  # the batch width of every drafting pass of the head
    if family == "medusa":
        real = type(head).forward
        monkeypatch.setattr(type(head), "forward", lambda self, last, heads=None: widths.append(
            1 if last.dim() == 1 else last.shape[0]) or real(self, last, heads))
    elif family == "mtp":
        real = type(head.mtp[0]).forward
        monkeypatch.setattr(type(head.mtp[0]), "forward", lambda self, emb, *a, **kw: widths.append(emb.shape[0])
                            or real(self, emb, *a, **kw))
    else:
        real = type(head).block_states
        monkeypatch.setattr(type(head), "block_states", lambda self, emb, *a: widths.append(emb.shape[0])
                            or real(self, emb, *a))
    run = dict(k=3, make_drafter=make, temperature=temperature, top_k=0 if temperature == 0 else 20, seed=7)
    seeds = itertools.count()
    together = batched_generate(model, prompts, 14, tok.pad_token_id, **run)
    batched = list(widths)
    widths.clear()
    monkeypatch.setattr(cls, "draft_together", None)
    if hasattr(cls, "settle_together"):
        monkeypatch.setattr(cls, "settle_together", None)
    seeds = itertools.count()
    alone = batched_generate(model, prompts, 14, tok.pad_token_id, **run)
    assert torch.equal(together.tokens, alone.tokens) and together.passes == alone.passes
    assert together.stats.drafted_tokens == alone.stats.drafted_tokens > 0
    assert together.stats.accepted_per_position == alone.stats.accepted_per_position
    assert max(batched) == len(prompts) and set(widths) == {1}  # together: the batch's blocks in one pass
    assert len(batched) < len(widths)
    if temperature == 0:
        plain = batched_generate(model, prompts, 14, tok.pad_token_id)
        assert torch.equal(together.tokens, plain.tokens)


def _policy(sources=("draft",), prior=0.9):
    verify = VerifyCost({1: 0.05, 2: 0.055, 4: 0.06, 8: 0.07, 16: 0.09}, context_len=64)
    return AdaptivePolicy(verify, {s: DraftCost(0.0005, 0.0002) for s in sources}, {s: [prior] * 4 for s in sources})


def _surface(slope):
    """T(B, n) = (1 + slope * (B*n - 1)) * 50 ms: slope 0 is a GPU-like flat pass, slope 1 a compute-bound one."""
    return {b: VerifyCost({n: 0.05 * (1 + slope * (b * n - 1)) for n in (1, 2, 3, 5, 9)}, 64) for b in (1, 4, 16)}


class Counting(OracleDrafter):
    """A full oracle that counts its drafts and follows commits by tokens (DeferredSync hands them over so)."""

    calls = 0
    begins = 0

    def begin(self, prompt_ids, features, next_token):
        Counting.begins += 1
        super().begin(prompt_ids, features, next_token)

    def draft(self, k, temperature):
        Counting.calls += 1
        return super().draft(k, temperature)

    def commit_tokens(self, tokens, features, next_token):
        self.pos += len(tokens) + 1


def test_load_aware_gate_drafts_when_it_pays_and_not_when_it_costs():
    """Per-row choices priced by T(B, n) / B; the gate keeps them on a flat surface and drops them on a steep one."""
    rows = [(object(), _policy()) for _ in range(16)]
    flat, steep = LoadAware(_surface(0.0)), LoadAware(_surface(1.0))
    chosen = flat.choose(rows, [8] * 16)
    assert all(c["draft"] > 0 for c in chosen) and flat.gated == 0
    rows = [(object(), _policy()) for _ in range(16)]
    chosen = steep.choose(rows, [8] * 16)
    assert all(c["draft"] == 0 for c in chosen)
    # between the measured 4 and 16 the surface is interpolated in B
    assert steep.curve(10)(1) == pytest.approx((steep.curve(4)(1) + steep.curve(16)(1)) / 2)


def test_load_aware_prices_a_rows_head_draft_at_the_batchs_draft_share():
    """Rows whose heads draft together (eval.batch) pay their share of one batched head pass: on a flat,
    GPU-like surface, 16 rows of 6 ms drafts priced as 16 drafts of their own make every pass plain (30 tokens
    for 146 ms against plain's 16 for 50), priced at a measured share of 1/16 they all draft; a share applies
    to the head's proposers only, at the largest measured size not above the batch, 1.0 below them all."""
    def rows(sources=("draft",)):
        return [(type("D", (), {"SOURCES": sources})(), AdaptivePolicy(VerifyCost({1: 0.05, 2: 0.055, 4: 0.06, 8: 0.07, 16: 0.09}, 64),
                                          {s: DraftCost(0.001, 0.005) for s in sources},
                                          {s: [0.9] * 4 for s in sources})) for _ in range(16)]

    alone = LoadAware(_surface(0.0))
    assert all(c["draft"] == 0 for c in alone.choose(rows(), [8] * 16)) and alone.gated == 0
    shared = LoadAware(_surface(0.0), draft_share={1: 1.0, 4: 0.25, 16: 1 / 16})
    assert (shared.share(16), shared.share(10), shared.share(4), shared.share(3)) == (1 / 16, 0.25, 0.25, 1.0)
    assert all(c["draft"] > 0 for c in shared.choose(rows(), [8] * 16))
    # an n-gram's lookups are per row: a batch of n-gram proposers is priced at its own cost still
    ngram = rows(("ngram",))
    assert all(c["ngram"] == 0 for c in shared.choose(ngram, [8] * 16))
    assert ngram[0][1].shared == {"draft": 1 / 16, "head": 1 / 16}
    with pytest.raises(ValueError, match="draft shares"):
        LoadAware(_surface(0.0), draft_share={4: 0.0})


@pytest.mark.parametrize("family", registry.names())
def test_draft_share_is_measured_for_every_family(tiny_target, family_heads, family):
    """measure_draft_share begins, drafts and commits requests of every family's drafter (their own features:
    aux layers for EAGLE-3 / DFlash, the last state for Medusa / MTP) and returns shares in (0, 1]."""
    from eval.costs import measure_draft_share

    model, tok, io = tiny_target
    make = registry.get(family).drafter_factory(copy.deepcopy(family_heads[family]), io, "auto", 2)
    share = measure_draft_share(model, make, _prompts(tok, 1)[0], [1, 2], k=2, repeats=1)
    assert share[1] == 1.0 and 0 < share[2] <= 1.0


def test_measure_draft_share_times_the_rows_drafts_together_against_one_after_another(tiny_target, family_heads,
                                                                                      monkeypatch):
    """eval.costs.measure_draft_share: per batch size, a share in (0, 1] from requests in a decoding state
    drafted through the drafter class's draft_together (called once per timed batch); 1.0 at batch 1 and for a
    drafter that drafts no requests together (the n-gram)."""
    from eval.costs import measure_draft_share
    from eval.drafters import NgramDrafter
    from heads.eagle import EagleDrafter

    model, tok, io = tiny_target
    make = registry.get("eagle3").drafter_factory(copy.deepcopy(family_heads["eagle3"]), io, "chain", 3)
    calls = []
    real = EagleDrafter.draft_together
    monkeypatch.setattr(EagleDrafter, "draft_together", staticmethod(lambda ds, ks, t: calls.append(
        (len(ds), set(ks), all(d.n == len(_prompts(tok, 1)[0]) - 1 for d in ds))) or real(ds, ks, t)))
    share = measure_draft_share(model, make, _prompts(tok, 1)[0], [1, 3], k=3, repeats=2)
    assert set(share) == {1, 3} and share[1] == 1.0 and 0 < share[3] <= 1.0
    # 3 timed batches (a warm-up and 2 repeats), of 3 requests each, drafting 3, each begun and committed
    assert calls == [(3, {3}, True)] * 3
    assert measure_draft_share(model, NgramDrafter, _prompts(tok, 1)[0], [1, 4], k=3) == {1: 1.0, 4: 1.0}


@pytest.mark.parametrize("load", [0.02, 1.0, 50.0])
def test_rows_price_their_drafts_at_the_surface_level_whatever_the_load(load):
    """A flat surface pays for every draft at any load factor: the rows' drafting seconds were timed beside the
    surface, so the factor the run's passes teach scales both. The rows' share priced with the factor on the pass
    only made drafts 50 times dearer than their pass at 0.02 (a tiny target, or a quieter machine than the
    measurement's) and every row stopped drafting (mutant row_share_priced_at_the_load)."""
    flat = LoadAware(_surface(0.0))
    for _ in range(5):
        flat.observe(4, 1, 0.05 * load)
    assert flat.curve(4).scale == pytest.approx(load)
    rows = [(object(), _policy()) for _ in range(4)]
    assert all(c["draft"] > 0 for c in flat.choose(rows, [8] * 4)) and flat.gated == 0


def _load_aware_batch(tiny_target, rows: int, n: int, k: int, oracle: type, load: LoadAware):
    """A load-aware batch of `rows` prompts, n tokens each, drafted by a full `oracle` (Counting) behind
    DeferredSync; checked token-identical to plain decoding. Returns the BatchResult (Counting.calls reset)."""
    model, tok, io = tiny_target
    prompts = _prompts(tok, rows)
    plain, refs = _refs(model, tok, prompts, n)
    Counting.calls = Counting.begins = 0
    spec = batched_generate(model, prompts, n, tok.pad_token_id, k=k,
                            make_drafter=lambda: DeferredSync(oracle(refs, 0.0, 0, io.vocab_size, full=True)),
                            make_policy=_policy, load=load)
    assert torch.equal(spec.tokens, plain.tokens)
    return spec


def test_load_aware_batch_with_costly_drafting_never_calls_the_drafter(tiny_target):
    """A steep surface: every pass plain, the drafter never drafts and is never even begun (its begin and commits
    wait in DeferredSync), same tokens. Mutant deferred_sync_begins_at_once."""
    spec = _load_aware_batch(tiny_target, 4, 10, 2, Counting, LoadAware({4: _surface(1.0)[16]}))
    assert Counting.calls == 0 and Counting.begins == 0 and spec.stats.drafted_tokens == 0


def test_load_aware_batch_drafts_on_a_flat_surface(tiny_target):
    assert _load_aware_batch(tiny_target, 4, 13, 3, Counting, LoadAware(_surface(0.0))).tau > 2.0
    assert Counting.begins == 4  # each row's drafter begun once, at its first draft


def test_load_aware_stops_drafting_where_drafting_passes_deliver_less_than_plain():
    """The gate's prices leave out what it cannot measure (a head's drafting, commits, bookkeeping): a drafting
    pass timed whole at ten times its priced seconds turns that batch size's drafting off, and larger sizes'
    and near ones' that have not drafted, not smaller ones'."""
    load = LoadAware(_surface(0.0))
    rows = [(object(), _policy()) for _ in range(4)]
    assert all(c["draft"] > 0 for c in load.choose(rows, [8] * 4)) and load.realised(4) == 1.0
    _, expected, priced = load._planned
    load.observe_cycle(4, expected, 10 * priced)  # the tokens expected, at a tenth of the priced speed
    assert load.realised(4) == pytest.approx(0.1) and load.time_ratio(4) == pytest.approx(0.1)
    assert all(c["draft"] == 0 for c in load.choose(rows, [8] * 4))
    load.observe_cycle(4, 4, 0.2)  # a plain pass teaches nothing
    assert load.realised(4) == pytest.approx(0.1)
    # a batch that shrinks to 5 or 3 rows starts from batch 4's time, and so does a larger one (what the gate
    # cannot price grows with the rows); a smaller one beyond the factor 1.5 does not
    assert load.realised(5) == load.realised(3) == load.realised(16) == pytest.approx(0.1)
    assert load.realised(2) == load.realised(1) == pytest.approx(1.0)
    assert all(c["draft"] == 0 for c in load.choose([(object(), _policy()) for _ in range(5)], [8] * 5))
    assert all(c["draft"] == 0 for c in load.choose([(object(), _policy()) for _ in range(16)], [8] * 16))
    assert all(c["draft"] > 0 for c in load.choose([(object(), _policy()) for _ in range(2)], [8] * 2))
    load.observe_cycle(16, 0, 1.0)  # not a drafting pass: teaches nothing; batch 16 keeps batch 4's rate
    assert load.realised(16) == pytest.approx(0.1)


def test_load_aware_realised_rate_scales_the_full_pricing_not_only_its_bound():
    """Rows whose drafting is dear (20 ms + 10 ms a token against a 50 ms pass): the skip bound, which leaves
    drafting time out, still says a draft could pay at a realised rate that puts the priced gain just under
    the margin, and the full pricing must then drop every draft. Mutant load_aware_ignores_realised_rate."""
    def dear():
        verify = VerifyCost({1: 0.05, 2: 0.055, 4: 0.06, 8: 0.07, 16: 0.09}, context_len=64)
        return AdaptivePolicy(verify, {"draft": DraftCost(0.02, 0.01)}, {"draft": [0.9] * 4})

    load = LoadAware(_surface(0.0))
    rows = [(object(), dear()) for _ in range(2)]
    assert all(c["draft"] > 0 for c in load.choose(rows, [8] * 2))
    _, expected, priced = load._planned
    gain = expected / priced / (2 / load.curve(2)(1))
    load.observe_cycle(2, expected, priced * gain)  # the tokens expected, slower by the predicted gain
    assert load.realised(2) * gain == pytest.approx(1.0)
    assert not load.cannot_pay(rows, [8] * 2)
    assert all(c["draft"] == 0 for c in load.choose(rows, [8] * 2))


def test_load_aware_gate_prices_drafting_at_the_load_it_prices_the_target():
    """A load that slows every pass (plain passes observed at 1.5x the surface) slows the drafters timed beside
    it as much: a draft the gate drops at the surface's own level stays dropped. Scaling the target alone made
    dear drafting look cheaper under load and let a draft 1% short of the margin through. Mutant
    load_aware_drafting_unscaled_by_load."""
    def dear():
        verify = VerifyCost({1: 0.05, 2: 0.055, 4: 0.06, 8: 0.07, 16: 0.09}, context_len=64)
        return AdaptivePolicy(verify, {"draft": DraftCost(0.02, 0.01)}, {"draft": [0.9] * 4})

    probe = LoadAware(_surface(0.0), margin=1.0)
    assert probe.choose([(object(), dear())], [8])[0]["draft"] > 0
    _, expected, priced = probe._planned
    gain = expected / priced * probe.curve(1)(1)  # over plain's 1 / T(1, 1)
    assert gain > 1.0
    for factor, margin, drafts in ((1.5, 1.01 * gain, False), (1.0, 1.01 * gain, False), (1.5, 0.99 * gain, True)):
        load = LoadAware(_surface(0.0), margin=margin)
        for _ in range(4):
            load.observe(1, 1, factor * load.curve(1).fit(1))
        assert load.curve(1).scale == pytest.approx(factor)
        assert (load.choose([(object(), dear())], [8])[0]["draft"] > 0) == drafts, (factor, margin)


def test_load_aware_pools_tokens_over_sizes_and_times_each_size():
    """Fewer tokens than expected lower every size's rate (acceptance is the rows'), slower passes only their
    own size's and larger ones'."""
    load = LoadAware(_surface(0.0))
    two = [(object(), _policy()) for _ in range(2)]
    assert all(c["draft"] > 0 for c in load.choose(two, [8] * 2))
    _, expected, priced = load._planned
    load.observe_cycle(2, expected / 2, priced)  # half the tokens, at the priced speed
    assert load.time_ratio(2) == pytest.approx(1.0)
    assert load.realised(1) == load.realised(2) == load.realised(16) == pytest.approx(0.5)


def test_a_drafting_pass_is_timed_against_its_price_at_the_load_its_own_pass_shows():
    """A size's first drafting pass is priced before any pass at that size was timed; its verify forward then
    shows the machine at 1.45 times the surface, and the whole pass takes what the plan costs at that load. Its
    time ratio must be 1 (nothing the gate could not price), or the learned factor and the ratio count the load
    twice and the size never drafts again: batch 2 of a GSM8K sweep, time ratio 0.57 (docs/batching.md).
    Mutant drafting_pass_timed_at_the_load_it_was_priced_at."""
    load = LoadAware(_surface(0.0))
    two = [(object(), _policy()) for _ in range(2)]
    assert all(c["draft"] > 0 for c in load.choose(two, [8] * 2)) and load.curve(2).scale == 1.0
    _, expected, priced = load._planned
    load.observe(2, 4, 1.45 * load.curve(2).fit(4))  # eval.batch times the verify forward first
    load.observe_cycle(2, expected, 1.45 * priced)
    assert load.time_ratio(2) == pytest.approx(1.0) and load.realised(2) == pytest.approx(1.0)
    assert all(c["draft"] > 0 for c in load.choose([(object(), _policy()) for _ in range(2)], [8] * 2))


def test_an_untimed_size_starts_at_the_nearest_timed_sizes_load():
    """The machine's load slows every batch size: batch 2's first pricing, before any of its passes is timed,
    is at batch 1's factor (not the calibration's), and its own passes then take over. Mutant
    untimed_size_priced_at_the_calibration_level."""
    load = LoadAware(_surface(0.3))
    for _ in range(3):
        load.observe(1, 1, 1.45 * load.curve(1).fit(1))
    assert load.curve(2).scale == pytest.approx(1.45)
    assert load.curve(16).scale == pytest.approx(1.45)
    load.observe(2, 1, load.curve(2).fit(1))  # its own pass at the surface's level: weight 1 against the seed's 0.9
    assert load.curve(2).scale == pytest.approx((0.9 * 1.45 + 1.0) / 1.9)
    assert LoadAware(_surface(0.3)).curve(4).scale == 1.0  # nothing timed: the surface's own level


def test_load_aware_new_size_is_not_shut_by_a_smaller_ones_last_unlucky_passes():
    """Batch 1 drafts six passes: four emit 1.2 times the tokens expected, the last two 0.2 times. Batch 2 has
    never drafted and its surface promises 1.42 times plain's rate. The tokens, pooled and decayed slowly, say
    0.83 of expected, so batch 2 drafts (0.83 x 1.42 beats the 1.05 margin). Decayed like the seconds, 0.7 a
    pass, they would say 0.62, and batch 2, inheriting it, would never draft, never time its own passes: the
    sweep that gave up the fixed hybrid's 14-36% at batch 2-8 (docs/batching.md). Mutant
    tokens_decayed_per_pass_like_time."""
    load = LoadAware(_surface(0.3))
    one = [(object(), _policy())]
    for emitted in (1.2, 1.2, 1.2, 1.2, 0.2, 0.2):  # times the expected tokens
        assert load.choose(one, [8])[0]["draft"] > 0
        _, expected, priced = load._planned
        load.observe_cycle(1, emitted * expected, priced)
    assert load.time_ratio(1) == pytest.approx(1.0) and load.realised(1) == pytest.approx(0.83, abs=0.01)
    assert all(c["draft"] > 0 for c in load.choose([(object(), _policy()) for _ in range(2)], [8] * 2))


def _random_gate_case(rng: random.Random):
    """A random batch for the gate: 1-16 rows of one- or two-proposer policies with random priors and history,
    random budgets, and a random nondecreasing surface T(B, n) for that batch size."""
    b = rng.randint(1, 16)
    sources = ("head", "ngram") if rng.random() < 0.5 else ("draft",)
    rows = []
    for _ in range(b):
        pol = _policy(sources)
        pol.prior = {s: [rng.random() ** rng.choice((1, 3)) for _ in range(pol.k_max)] for s in sources}
        for s in sources:  # some history: counts that move the rates off the prior
            pol.judged[s] = [rng.uniform(0, 6) for _ in range(pol.k_max)]
            pol.accepted[s] = [rng.uniform(0, j) for j in pol.judged[s]]
        drafter = type("Two", (), {"SOURCES": sources})() if len(sources) == 2 else object()
        rows.append((drafter, pol))
    steps = itertools.accumulate(rng.uniform(0, 0.02 * b) for _ in range(17))
    surface = {b: VerifyCost({n: 0.05 + x for n, x in zip(range(1, 18), steps)}, 64)}
    return rows, [rng.randint(0, 8) for _ in range(b)], surface


def test_gate_bound_skips_only_batches_the_gate_would_make_plain():
    """LoadAware.cannot_pay is an upper bound on the gate's score: wherever it says no row can pay, the full
    per-row pricing drafts nothing either. Its power: it does skip some batches, and batches where it does
    not skip do draft. A planted bound that prices a depth by its best proposer (max) instead of their sum
    skips a batch the gate would draft, and fails here."""
    rng = random.Random(5)
    skipped = drafted = 0
    for _ in range(400):
        rows, budgets, surface = _random_gate_case(rng)
        load = LoadAware(surface)
        bound = load.cannot_pay(rows, budgets)
        load.cannot_pay = lambda *a: False  # the full pricing, as before the bound
        chosen = load.choose(rows, budgets)
        any_draft = any(v for c in chosen for v in c.values())
        assert not (bound and any_draft), "the bound skipped a batch the gate would have drafted"
        skipped += bound
        drafted += any_draft
    assert skipped > 40 and drafted > 40
    # Where two proposers each reach depth 1 half the time, together they add 0.75 tokens for two nodes; priced
    # at T(3) = 1.55 T(1) that pays (1.75 / 1.55 > 1.05): the bound must not skip it (a max bound would).
    pol = _policy(("head", "ngram"))
    pol.prior = {s: [0.5] + [0.0] * (pol.k_max - 1) for s in ("head", "ngram")}
    pol.costs = {s: DraftCost(0.0, 0.0) for s in ("head", "ngram")}
    rows = [(type("Two", (), {"SOURCES": ("head", "ngram")})(), pol)]
    load = LoadAware({1: VerifyCost({1: 0.05, 2: 0.0775, 3: 0.0775, 9: 0.2}, 64)})
    assert not load.cannot_pay(rows, [1])
    assert load.choose(rows, [1]) == [{"head": 1, "ngram": 1}]


def test_gate_bound_consults_no_policy_when_nothing_can_pay():
    """On a steep surface with a useless drafter the pass is plain without asking any row's policy (no
    per-row pricing, no n-gram lookup, no re-probe); on a flat one the policies choose as before."""

    class Refuses(AdaptivePolicy):
        def choose(self, drafter, budget):
            raise AssertionError("a policy was consulted")

    def refusing(prior):
        verify = VerifyCost({1: 0.05, 2: 0.055}, context_len=64)
        return Refuses(verify, {"draft": DraftCost(0.0005, 0.0002)}, {"draft": [prior] * 4})

    steep = LoadAware({16: _surface(1.0)[16]})
    assert steep.choose([(object(), refusing(0.05)) for _ in range(16)], [8] * 16) == [{"draft": 0}] * 16
    flat = LoadAware(_surface(0.0))
    with pytest.raises(AssertionError, match="consulted"):
        flat.choose([(object(), refusing(0.9)) for _ in range(16)], [8] * 16)


def test_gate_backs_off_pricing_after_passes_it_made_plain():
    """A pricing that ends plain is followed by 1, 3, then at most MAX_BACKOFF unpriced plain passes (pricing is
    a percent of a batch-1 pass); a batch size that drafts again is priced every pass. Without the back-off the
    40 passes below would price 40 times."""
    from eval.policy import MAX_BACKOFF

    class Priced(AdaptivePolicy):
        calls = 0
        pays = False

        def choose(self, drafter, budget):
            Priced.calls += 1
            return {"draft": 2}

        def expected(self, choice):  # (tokens, drafting seconds, nodes): two nodes that add nothing, or pay
            return (3.0, 0.0, 2) if Priced.pays else (1.0, 0.01, 2)

    load = LoadAware(_surface(0.0))
    rows = [(object(), _policy())]
    rows[0][1].__class__ = Priced
    assert not load.cannot_pay(rows, [8])  # the bound alone would price every pass
    for _ in range(40):
        assert load.choose(rows, [8]) == [{"draft": 0}]
    assert Priced.calls == 7  # passes 0, 2, 6, 14, 22, 30, 38
    Priced.pays, Priced.calls = True, 0
    first = next(i for i in range(MAX_BACKOFF + 1) if load.choose(rows, [8]) == [{"draft": 2}])
    assert first <= MAX_BACKOFF and Priced.calls == 1
    for _ in range(5):
        assert load.choose(rows, [8]) == [{"draft": 2}]
    assert Priced.calls == 6
    # another batch size keeps its own back-off
    four = [(object(), _policy()) for _ in range(4)]
    assert all(c["draft"] > 0 for c in load.choose(four, [8] * 4))


class Slow(Counting):
    """Counting, with 100 ms of drafting per call that no cost model knows of."""

    def draft(self, k, temperature):
        time.sleep(0.1)
        return super().draft(k, temperature)


def test_load_aware_batch_turns_off_a_drafter_slower_than_priced(tiny_target):
    """On a flat surface with near-free drafting priced in, a perfect drafter that costs 100 ms a call drafts
    for a pass to three, then the realised rate gates it off; outputs unchanged."""
    spec = _load_aware_batch(tiny_target, 2, 24, 3, Slow, LoadAware(_surface(0.0)))
    # ungated, the perfect drafter would draft every pass: about 2 rows x 24 / 4 = 12 calls. Measured: 3 passes
    # (the first pass is priced on the surface's 50 ms, later ones on the tiny model's measured ~20 ms, and the
    # decayed sums of seconds weigh that first pass in)
    assert spec.stats.drafted_tokens > 0 and 0 < Counting.calls <= 6


def test_sweep_report_shape_and_crossover(tiny_target):
    model, tok, io = tiny_target
    prompts = _prompts(tok, 2)
    _, refs = _refs(model, tok, prompts, 8)
    oracle = Method("oracle", 3, lambda: OracleDrafter(refs, 0.0, 1, io.vocab_size))
    aware = Method("aware", 3, lambda: DeferredSync(Counting(refs, 0.0, 1, io.vocab_size, full=True)),
                   make_policy=_policy, load_aware=True)
    out = sweep(model, prompts, tok.pad_token_id, [1, 2], [oracle, aware], max_new_tokens=8, surface=_surface(0.0))
    assert [r["batch_size"] for r in out["rows"]] == [1, 2]
    assert out["methods"] == ["oracle", "aware"] and out["policy"]["aware"] == "load-aware"
    for r in out["rows"]:
        for name in ("oracle", "aware"):
            m = r["methods"][name]
            assert r["plain_tok_s"] > 0 and m["tok_s"] > 0 and m["identical"] and m["latency_s"] > 0
            assert m["speedup"] == pytest.approx(m["tok_s"] / r["plain_tok_s"])
    for name in ("oracle", "aware"):
        expect = next((r["batch_size"] for r in out["rows"] if r["methods"][name]["speedup"] <= 1.0), None)
        assert out["crossover"][name] == expect
    # batch 1 of the fixed-k oracle is the single-stream decoder's run on the same row: the same tau
    assert out["single_stream_tau"]["oracle"] == pytest.approx(out["rows"][0]["methods"]["oracle"]["tau"])


def test_sweep_keeps_one_gate_per_load_aware_method(tiny_target, monkeypatch):
    """Every run of a load-aware method in the sweep (each batch size, each round) goes through the same
    LoadAware, so its learned load and realised rate carry over; gated drafts are counted per run."""
    import eval.batch as batch_mod

    model, tok, io = tiny_target
    prompts = _prompts(tok, 2)
    _, refs = _refs(model, tok, prompts, 6)
    made, seen = [], set()

    class Tracked(LoadAware):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made.append(self)

        def choose(self, rows, budgets):
            seen.add(id(self))
            return super().choose(rows, budgets)

    monkeypatch.setattr(batch_mod, "LoadAware", Tracked)
    aware = Method("aware", 3, lambda: DeferredSync(Counting(refs, 0.0, 1, io.vocab_size, full=True)),
                   make_policy=_policy, load_aware=True)
    out = sweep(model, prompts, tok.pad_token_id, [1, 2], [aware], max_new_tokens=6, surface=_surface(1.0),
                repeats=2)
    assert len(made) == 1 and seen == {id(made[0])}
    assert sum(r["methods"]["aware"]["gated_drafts"] for r in out["rows"]) <= made[0].gated


class Idle:
    """A drafter that never proposes anything: its runs do a plain run's work."""

    capture_layers = None

    def begin(self, prompt_ids, features, next_token):
        pass

    def draft(self, k, temperature):
        return DraftTree.chain(torch.empty(0, dtype=torch.long))

    def commit(self, accepted, features, next_token):
        pass


def _drifting_clock(monkeypatch) -> None:
    """eval.batch's clock advances only inside target forwards, each 5% slower than the one before: a
    machine slowing down steadily under load."""
    import eval.batch as batch_mod

    clock = {"t": 0.0, "calls": 0}
    real_run = DynamicKV.run

    def slow_run(self, *a, **kw):
        clock["calls"] += 1
        clock["t"] += 1.05 ** clock["calls"]
        return real_run(self, *a, **kw)

    monkeypatch.setattr(DynamicKV, "run", slow_run)
    monkeypatch.setattr(batch_mod, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: clock["t"])}))


def test_interleaved_runs_share_the_drift_that_back_to_back_runs_split(tiny_target, monkeypatch):
    model, tok, _ = tiny_target
    prompts = _prompts(tok, 2)
    _drifting_clock(monkeypatch)
    first, second = (batched_generate(model, prompts, 10, tok.pad_token_id) for _ in range(2))
    assert second.decode_s / first.decode_s > 1.5  # the same work, back to back: the drift decides
    a, b = interleave_batches([BatchRun(model, prompts, 10, tok.pad_token_id) for _ in range(2)])
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.tokens, first.tokens)
    assert b.decode_s / a.decode_s == pytest.approx(1.0, abs=0.06)


def test_no_batch_run_always_follows_the_same_one():
    """Mutant batch_runs_in_a_fixed_cycle: as tests/test_decoder.py's test for single streams, for the sweep's
    runs: a pass right after the heavy run's costs 1.5, and two identical light runs must pay it alike."""
    state = {"last": None}

    class Fake:
        def __init__(self, name: str, passes: int):
            self.name, self.left, self.seconds = name, passes, 0.0

        @property
        def done(self) -> bool:
            return self.left == 0

        def step(self) -> None:
            self.seconds += 1.5 if state["last"] == "heavy" and self.name != "heavy" else 1.0
            state["last"], self.left = self.name, self.left - 1

        def result(self) -> float:
            return self.seconds

    _, a, b = interleave_batches([Fake("heavy", 60), Fake("a", 60), Fake("b", 60)])
    assert a / b == pytest.approx(1.0, abs=0.1) and 60 * 1.1 < a < 60 * 1.4


def test_sweep_times_a_method_doing_plain_work_at_plain_speed_under_drift(tiny_target, monkeypatch):
    """A drafter that never drafts costs what plain costs; the sweep must say ~1.0x on a drifting machine
    (back-to-back runs read about 0.6x or 1.6x, by round order)."""
    model, tok, _ = tiny_target
    prompts = _prompts(tok, 2)
    _drifting_clock(monkeypatch)
    out = sweep(model, prompts, tok.pad_token_id, [1, 2], [Method("idle", 3, Idle)], max_new_tokens=10)
    for r in out["rows"]:
        for s in r["methods"]["idle"]["speedups"]:
            assert s == pytest.approx(1.0, abs=0.06), r


def test_load_aware_methods_take_their_extra_rounds_beside_plain_alone(tiny_target, monkeypatch):
    """load_aware_repeats: the load-aware method runs that many rounds, each paired with its own round's plain
    run (under drift every ratio stays ~1.0), while a fixed method runs `repeats` rounds only."""
    model, tok, _ = tiny_target
    prompts = _prompts(tok, 2)
    _drifting_clock(monkeypatch)
    fixed_runs = []

    def fixed() -> Idle:
        fixed_runs.append(1)
        return Idle()

    aware = Method("aware", 3, Idle, make_policy=lambda: _policy(("draft",), prior=0.0), load_aware=True)
    out = sweep(model, prompts, tok.pad_token_id, [1, 2], [Method("fixed", 3, fixed), aware], max_new_tokens=8,
                surface=_surface(1.0), repeats=2, load_aware_repeats=5)
    # a drafter per row and round (2 rounds of 1 row and of 2 rows), and one for the single-stream tau check
    assert out["load_aware_repeats"] == 5 and len(fixed_runs) == 2 * (1 + 2) + 1
    for r in out["rows"]:
        assert len(r["methods"]["fixed"]["speedups"]) == 2
        assert len(r["methods"]["aware"]["speedups"]) == 5 and r["methods"]["aware"]["drafted_tokens"] == [0] * 5
        for s in r["methods"]["aware"]["speedups"]:
            assert s == pytest.approx(1.0, abs=0.06), r


def _batched_pvalue(model, draft_model, rows: int, batches: int) -> float:
    """Chi-square p-value of batched speculative sampling (T 1, top-3, k 2, 4 new tokens per row, a sampling
    ModelDrafter per row) against plain sampling's exact law; every row of every batch is one sample."""
    exact = exact_law(model, PROMPT4, 4, 1.0, 3)
    counts: dict[tuple[int, ...], int] = {}
    seeds = itertools.count()
    for b in range(batches):
        res = batched_generate(model, [PROMPT4] * rows, 4, 0, k=2, temperature=1.0, top_k=3, seed=1000 * b,
                               make_drafter=lambda: ModelDrafter(draft_model,
                                                                 generator=torch.Generator().manual_seed(next(seeds))))
        for row in res.tokens.tolist():
            counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    return chi_square_pvalue(exact, counts, rows * batches)


def test_batched_sampling_keeps_the_law_and_a_biased_verifier_fails(vocab4_model, head4, monkeypatch):  # noqa: F811
    """T > 0 rows go through the decoder's own rule: plain sampling's law; resampling from p after a rejection
    (the named bias of tests/test_sampling_exactness.py) is caught by the same test."""
    assert _batched_pvalue(vocab4_model, head4, 30, 20) > 1e-3
    monkeypatch.setattr(decoder, "residual_distribution", lambda p, q, token: p)
    pv = _batched_pvalue(vocab4_model, head4, 30, 20)
    assert pv < 1e-4, f"the biased batched verifier passed (p = {pv:.2e})"


def test_padded_trees_and_ragged_keep_match_each_row_alone(tiny_target):
    """DynamicKV over left-padded rows with a tree each: every row's logits are its logits alone (its positions,
    its ancestors), and after keep_rows of non-prefix paths the next pass still matches row by row."""
    from data.kvcache import DynamicKV

    model, tok, _ = tiny_target
    prompts = _prompts(tok, 3)[:2]
    ids, mask = left_pad(prompts, tok.pad_token_id)
    trees = [([5, 6, 7, 8], [-1, 0, -1, 2]), ([9, 10, 11, 12], [-1, -1, 1, 0])]
    paths = [[0, 3, 4], [0, 2]]  # row 0 keeps nodes 2, 3 (a branch that is not a prefix); row 1 keeps node 1
    kv = DynamicKV(model)
    kv.run(ids, pad=mask)
    kv.keep(range(ids.shape[1]))
    root = [40, 41]
    block = torch.tensor([[root[r]] + trees[r][0] for r in range(2)])
    logits, _ = kv.run(block, torch.tensor([trees[r][1] for r in range(2)]))
    kv.keep_rows(paths)
    after, _ = kv.run(torch.tensor([[50], [51]]))
    for r, p in enumerate(prompts):
        alone = DynamicKV(model)
        alone.run(torch.tensor([p]))
        alone.keep(range(len(p)))
        ref, _ = alone.run(torch.tensor([[root[r]] + trees[r][0]]), torch.tensor(trees[r][1]))
        torch.testing.assert_close(logits[r], ref[0], atol=1e-4, rtol=1e-4)
        alone.keep(paths[r])
        ref_after, _ = alone.run(torch.tensor([[50 + r]]))
        torch.testing.assert_close(after[r, -1], ref_after[0, -1], atol=1e-4, rtol=1e-4)


def test_scaled_curve_keeps_the_measured_shape_and_follows_the_load():
    """Timed passes at one width (plain passes, 3x slower than measured) scale every width alike."""
    from eval.policy import ScaledCurve

    curve = ScaledCurve(VerifyCost({1: 0.1, 2: 0.15, 4: 0.3}, 64))
    for _ in range(20):
        curve.observe(1, 0.3)
    assert curve(1) == pytest.approx(0.3) and curve(4) / curve(1) == pytest.approx(3.0)


def test_deferred_commits_join_in_order_past_the_log_chunk():
    """70 deferred commits (more than two of _FeatureLog's chunks): one commit_tokens of the joined path, its
    features in order, the same as committing them one by one would leave."""
    from heads.base import Features

    class Inner:
        capture_layers = ()

        def begin(self, *a):
            self.calls = []

        def commit_tokens(self, tokens, features, next_token):
            self.calls.append((list(tokens), features, next_token))

        def draft(self, k, temperature):
            return DraftTree.chain(torch.tensor([1]))

    inner = Inner()
    d = DeferredSync(inner)
    d.begin(torch.tensor([[1, 2]]), None, 3)
    for i in range(70):
        d.commit([], Features(last=torch.full((1, 1, 2), float(i)), aux=torch.full((1, 1, 4), float(-i))), 100 + i)
    assert not hasattr(inner, "calls")  # not even begun yet
    d.draft(1, 0.0)
    [(tokens, feats, nxt)] = inner.calls  # begun, then one commit
    assert tokens == [100 + i for i in range(69)] and nxt == 169
    assert feats.last[0, :, 0].tolist() == [float(i) for i in range(70)]
    assert feats.aux[0, :, 0].tolist() == [float(-i) for i in range(70)]


def test_deferred_commits_keep_their_features_when_the_pass_buffers_are_reused():
    """A static cache on CUDA returns its graph's output buffers, which the next replay overwrites
    (data.kvcache.StaticKV._replay): deferred commits must hand the drafter the features each pass HAD, not what
    the buffer holds by the time it drafts again. Simulated on CPU: one buffer, refilled before every commit."""
    from heads.base import Features

    class Inner:
        capture_layers = ()

        def begin(self, *a):
            self.calls = []

        def commit_tokens(self, tokens, features, next_token):
            self.calls.append((list(tokens), features.last.clone(), next_token))

        def draft(self, k, temperature):
            return DraftTree.chain(torch.tensor([1]))

    inner = Inner()
    d = DeferredSync(inner)
    d.begin(torch.tensor([[1, 2]]), None, 3)
    out = Features(last=torch.zeros(1, 1, 2), aux=torch.zeros(1, 1, 4))  # the graph's output buffers
    for i in range(40):  # past one _FeatureLog chunk
        out.last.fill_(float(i))  # the pass's replay writes its features into the same buffers
        out.aux.fill_(float(-i))
        d.commit([], out.index(slice(0, 1)), 100 + i)
    out.last.fill_(-1.0)  # the next pass's replay, before the drafter catches up
    d.draft(1, 0.0)
    [(_, last, _)] = inner.calls
    assert last[0, :, 0].tolist() == [float(i) for i in range(40)]


def test_bench_batch_runs_on_the_tiny_target(tmp_path):
    """scripts/bench_batch.py end to end on the tiny target with a fresh head: the drafting-off runs draft
    nothing and match plain token for token, as does the plain control; every row splits each pass into the
    forward and the rest."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("bench_batch", ROOT / "scripts" / "bench_batch.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = mod.main(["--target", "tiny-random-llama", "--batch-sizes", "2", "--new-tokens", "4", "--repeats", "2",
                    "--json", str(tmp_path / "b.json")])
    assert json.loads((tmp_path / "b.json").read_text()) == json.loads(json.dumps(out))
    single, batch = out["rows"]
    assert all(r["identical"] and r["drafted_tokens"] == 0 for r in out["rows"])
    for key in ("off_vs_plain", "control_vs_plain"):  # the control is plain run again beside the other two
        lo, hi = batch[f"{key}_range"]
        assert lo <= batch[key] <= hi and batch[f"{key}_paired"] > 0
    for r in (single, batch):
        assert 0 < r["plain_outside_ms"] < r["plain_pass_ms"] and 0 < r["off_outside_ms"] < r["off_pass_ms"]
        assert r["loop_vs_plain"] == 1 + (r["off_outside_ms"] - r["plain_outside_ms"]) / r["plain_pass_ms"]


def test_bench_batch_pairs_each_pass_with_plain_and_rotates_the_build_order():
    """bench_batch's estimators on made-up seconds: pass by pass, each run's pass against plain's pass of the same
    cycle (not the control's, not another repeat's); per repeat, the ratio of seconds per pass. _rotated builds
    the runs in an order rotated by the repeat and hands the results back by name."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_batch", ROOT / "scripts" / "bench_batch.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    tok = torch.zeros(4, dtype=torch.long)
    plain = [[1.0, 2.0, 4.0, 8.0], [3.0, 5.0, 6.0, 9.0], [6.0, 7.0, 5.0, 9.0]]  # the machine drifting pass by pass

    def run(r: int) -> dict:
        p = plain[r]
        return {m: mod._Run(f * sum(p) / 4, 0.1, tok, 0, [f * x for x in p]) for m, f in
                (("plain", 1.0), ("control", 1.02), ("off", 1.05))}

    row = mod._measure("made up", 1, run, 3)
    assert row["off_vs_plain_paired"] == pytest.approx(1.05) and row["control_vs_plain_paired"] == pytest.approx(1.02)
    assert row["off_vs_plain"] == pytest.approx(1.05) and row["identical"]
    built = []
    makers = {m: (lambda m=m: built.append(m) or m) for m in ("plain", "control", "off")}
    for r, first in enumerate(["plain", "control", "off", "plain"]):
        built.clear()
        assert mod._rotated(lambda runs: [f"ran {x}" for x in runs], makers, r) == {m: f"ran {m}" for m in makers}
        assert built[0] == first and sorted(built) == sorted(makers)


@pytest.mark.parametrize("config", [None, "tiny-dflash.yaml", "tiny-medusa.yaml", "tiny-mtp.yaml"])
def test_bench_batch_together_compares_drafting_together_with_row_by_row(tmp_path, config):
    """scripts/bench_batch.py --together on the tiny target, a fresh head of the quickstart's EAGLE-3 shape or of
    a tiny config of another family: both fixed-k runs match plain token for token."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_batch", ROOT / "scripts" / "bench_batch.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = mod.main(["--target", "tiny-random-llama", "--together", "--k", "2", "--batch-sizes", "1,3",
                    "--new-tokens", "6", "--repeats", "2"] + ([] if config is None else
                                                              ["--config", str(ROOT / "configs" / config)]))
    assert [t["batch_size"] for t in out["together"]] == [1, 3]
    assert all(t["identical"] and t["together_tok_s"] > 0 and t["alone_tok_s"] > 0 for t in out["together"])
    assert out["head"] == f"fresh, of {config or 'smollm2-135m.yaml'}"
