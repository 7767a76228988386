"""Adaptive drafting (eval.policy) and hybrid head + n-gram trees (eval.drafters.HybridDrafter) stay exact.

Greedy: the output equals model.generate and plain decoding whatever the policy does (the adaptive one, a
random one, one that never drafts) for chains, trees and hybrids. Sampling: the law of plain sampling
(tests/drafters_common.py) under a random policy, for a sampled chain and for a hybrid of a sampled chain
with n-gram branches; the same hybrid with the n-gram nodes judged as draws from a uniform q must fail.
Sync: when the accepted path comes from an n-gram branch the head's next draft is the draft of a fresh head
begun on the committed sequence (EAGLE-3 with target features, a separate draft model).

    .venv/bin/python -m pytest -q tests/test_policy.py
"""

from __future__ import annotations

import itertools
import random
import time
from pathlib import Path

import pytest
import torch
from drafters_common import sampling_pvalue
from test_decoder import (  # noqa: F401  (fixtures)
    MAX_NEW,
    RandomTreeDrafter,
    StaticTreeDrafter,
    other,
    prompt,
    reference,
    sharp_model,
    target,
)
from transformers import LlamaConfig, LlamaForCausalLM

import eval.costs as costs
import eval.drafters as drafters
from data.features import forward_features
from data.target import target_io
from eval.costs import DraftCost, VerifyCost
from eval.decoder import GenerationStats, plain_generate, speculative_generate
from eval.drafters import DeferredSync, HybridDrafter, ModelDrafter, NgramDrafter, layer_prefix_model
from eval.policy import AdaptivePolicy, LearnedVerifyCost, isotonic, measured_prior
from heads import eagle, medusa, mtp
from heads.base import DraftTree

ROOT = Path(__file__).resolve().parents[1]

# A CPU-like verify curve (ms): drafting pays only for well-accepted drafts.
VERIFY = VerifyCost({1: 0.057, 2: 0.075, 4: 0.11, 8: 0.125, 16: 0.2}, context_len=64)


@pytest.fixture(scope="module")
def vocab4_model():
    """A 4-token Llama whose 4-token sequence law is enumerable (sampling-law tests under a policy)."""
    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=4, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, initializer_range=0.6)
    return LlamaForCausalLM(cfg).eval()


class RandomPolicy:
    """Adversarial: every pass a random length in 0..budget for every proposer, ignoring all evidence."""

    def __init__(self, seed: int, p_zero: float = 0.3):
        self.rng, self.p_zero = random.Random(seed), p_zero

    def reset(self, k):
        pass

    def choose(self, drafter, budget):
        choice = {s: 0 if self.rng.random() < self.p_zero else self.rng.randint(0, budget)
                  for s in getattr(drafter, "SOURCES", ("draft",))}
        return choice

    def observe(self, tree, accepted, seconds):
        pass


class DraftingSpy(RandomPolicy):
    """A RandomPolicy that records the seconds every observe_drafting call hands it."""

    def __init__(self, seed: int, p_zero: float = 0.3):
        super().__init__(seed, p_zero)
        self.seen: list[float] = []

    def observe_drafting(self, seconds):
        self.seen.append(seconds)


class NeverPolicy(RandomPolicy):
    def choose(self, drafter, budget):
        return {"draft": 0}


def adaptive(sources=("draft",), prior=0.5, **kw):
    return AdaptivePolicy(VERIFY, {s: DraftCost(0.002, 0.001) for s in sources}, {s: [prior] * 4 for s in sources}, **kw)


class Recorder:
    """Wraps a drafter: tracks the committed sequence itself and records (committed length, k, drafted tokens)."""

    def __init__(self, inner):
        self.inner, self.capture_layers = inner, inner.capture_layers
        self.records: list[tuple[int, int, list[int]]] = []

    def begin(self, prompt_ids, features, next_token):
        self.seq = prompt_ids.reshape(-1).tolist() + [next_token]
        self.inner.begin(prompt_ids, features, next_token)

    def draft(self, k, temperature):
        tree = self.inner.draft(k, temperature)
        self.records.append((len(self.seq), k, tree.tokens.tolist()))
        return tree

    def commit(self, accepted, features, next_token):
        self.commit_tokens([self.records[-1][2][a] for a in accepted], features, next_token)

    def commit_tokens(self, tokens, features, next_token):
        self.seq += list(tokens) + [next_token]
        self.inner.commit_tokens(tokens, features, next_token)


def _tracker(d):
    """test_decoder's reference-tracking drafters, with an empty last draft: a policy may commit before any draft."""
    d.tree = DraftTree.chain(torch.empty(0, dtype=torch.long))
    return d


def _eagle3(io):
    torch.manual_seed(0)
    return eagle.build(eagle.Eagle3Config(layer_ids=[1, 2, 3], draft_vocab_size=io.vocab_size, ttt_length=2), io)


# ----------------------------------------------------------------------------------------------- greedy identity
@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_identical_under_any_policy(target, other, prompt, reference, seed):  # noqa: F811 (fixtures imported from test_decoder)
    plain, _ = plain_generate(target, prompt, MAX_NEW)
    assert plain.tolist() == reference.tolist()
    makers = [NgramDrafter, lambda: DeferredSync(ModelDrafter(other)),
              lambda: _tracker(RandomTreeDrafter(reference, seed)),
              lambda: _tracker(StaticTreeDrafter(reference, seed)), lambda: HybridDrafter(ModelDrafter(other))]
    for make in makers:
        sources = getattr(make(), "SOURCES", ("draft",))
        for policy in (RandomPolicy(seed), NeverPolicy(seed), adaptive(sources), adaptive(sources, prior=0.95)):
            out, st = speculative_generate(target, prompt, make(), 4, MAX_NEW, policy=policy)
            assert out.tolist() == reference.tolist(), (type(policy).__name__, make)
            assert sum(st.chosen_k[next(iter(st.chosen_k))].values()) == st.target_passes


@pytest.mark.parametrize("family", ["eagle3-dynamic", "medusa", "mtp"])
def test_hybrid_over_every_head_family_is_identical(sharp_model, family):  # noqa: F811 (fixture imported from test_decoder)
    """The n-gram merged into an EAGLE-2 dynamic tree, a Medusa static tree and an MTP chain (untrained heads)."""
    io = target_io(sharp_model)
    ids = torch.randint(97, (1, 12), generator=torch.Generator().manual_seed(1))
    ref, _ = plain_generate(sharp_model, ids, MAX_NEW)
    torch.manual_seed(0)
    if family == "eagle3-dynamic":
        head = eagle.build(eagle.Eagle3Config(layer_ids=[0, 1], draft_vocab_size=97, ttt_length=2), io)
        make = lambda: eagle.drafter(head, io, tree="dynamic", top_k=3, total_tokens=8)  # noqa: E731
    elif family == "medusa":
        head = medusa.build(medusa.MedusaConfig(num_heads=3), io)
        make = lambda: medusa.drafter(head, io)  # noqa: E731
    else:
        head = mtp.build(mtp.MTPConfig(num_modules=2), io)
        make = lambda: mtp.drafter(head, io)  # noqa: E731
    for policy in (None, RandomPolicy(0), adaptive(("head", "ngram"), prior=0.9)):
        out, st = speculative_generate(sharp_model, ids, HybridDrafter(make(), OracleNgram(ref.tolist())), 3, MAX_NEW,
                                       policy=policy)
        assert out.tolist() == ref.tolist(), (family, policy)
        assert st.accepted_by_source.get("ngram", 0) > 0


def test_never_drafting_policy_is_plain_decoding_with_the_drafter_in_sync(target, prompt, reference):  # noqa: F811 (fixtures imported from test_decoder)
    d = Recorder(NgramDrafter())
    out, st = speculative_generate(target, prompt, d, 4, MAX_NEW, policy=NeverPolicy(0))
    assert out.tolist() == reference.tolist() and st.tau == 1.0 and st.draft_rate == 0.0
    assert st.chosen_k == {"draft": {0: MAX_NEW - 1}} and not d.records
    # commit ran every pass: the drafter saw every token but the last (committed after the final pass).
    assert d.seq == prompt[0].tolist() + reference[:-1].tolist()


def test_hybrid_tree_merges_prefixes_and_tags_sources():
    class Chain:
        capture_layers = None

        def __init__(self, toks):
            self.toks = toks

        def draft(self, k, temperature):
            return DraftTree.chain(torch.tensor(self.toks[:k]))

    ngram = NgramDrafter()
    ngram.begin(torch.tensor([[5, 1, 2, 7, 8, 9, 5]]), None, 1)  # suffix (5, 1) last continued with 2 7 8 9
    d = HybridDrafter(Chain([2, 7, 3]), ngram)
    tree = d.draft(4, 0.0)
    assert tree.tokens.tolist() == [2, 7, 3, 8, 9] and tree.parents.tolist() == [-1, 0, 1, 1, 3]
    assert tree.sources == ["head+ngram", "head+ngram", "head", "ngram", "ngram"] and tree.probs is None
    assert d.draft(4, 0.0, budgets={"head": 0, "ngram": 2}).tokens.tolist() == [2, 7]
    assert d.proposal("ngram", 3) == 3 and d.proposal("head", 3) is None


def test_adaptive_policy_backs_off_and_reprobes():
    pol = adaptive(prior=0.9, probe_every=3)
    pol.reset(2)
    assert pol.choose(NgramDrafter(), 10) == {"draft": 2}  # the calibrated k first
    assert pol.choose(NgramDrafter(), 10)["draft"] >= 2  # a well-accepted prior keeps drafting
    miss = DraftTree.chain(torch.tensor([1, 2, 3]))
    for _ in range(20):
        pol.observe(miss, [])
    assert pol.rates("draft")[0] < 0.3
    picks = [pol.choose(NgramDrafter(), 10)["draft"] for _ in range(22)]
    # plain passes, and one-token probes after 3, 6, 12 plain passes (the gap doubles while probes fail)
    assert [i for i, k in enumerate(picks) if k] == [2, 8, 20] and set(picks) == {0, 1}
    for _ in range(20):
        pol.observe(miss, [0, 1, 2])
    assert pol.choose(NgramDrafter(), 10)["draft"] >= 3  # the request became predictable: drafts again
    assert pol.choose(NgramDrafter(), 1)["draft"] <= 1  # never past the budget


def test_a_known_proposal_is_reprobed_whole():
    class Proposals:
        SOURCES = ("head", "ngram")

        def proposal(self, source, k):
            return min(5, k) if source == "ngram" else None

    pol = adaptive(("head", "ngram"), prior=0.05, probe_every=2)
    pol.reset(0)
    picks = [pol.choose(Proposals(), 10) for _ in range(2)]
    assert picks == [{"head": 0, "ngram": 0}, {"head": 1, "ngram": 5}]  # the head probes 1 token, the n-gram all 5


def test_no_draft_is_priced_deeper_than_the_drafter_can_draft(sharp_model):  # noqa: F811 (fixture imported from test_decoder)
    """Mutant policy_ignores_max_depth: a block drafter of 3 drafting slots (heads.types.Drafter's max_depth)
    returns 3 tokens whatever k asks, so a policy that prices 8 pays for 5 depths of extrapolated acceptance it
    never gets; with verification nearly free deep drafts look best, and the choice must stop at the drafter's
    depth: alone, as a hybrid's head (max_depth_of, through DeferredSync), and for every family that has one."""

    class Block:
        capture_layers, max_depth = None, 3

    flat = VerifyCost({1: 1.0, 9: 1.01, 17: 1.02}, context_len=64)
    pol = AdaptivePolicy(flat, {"draft": DraftCost(0.0, 0.0)}, {"draft": [0.9]}, k_max=8)
    pol.reset(0)
    assert pol.choose(type("Chain", (), {"capture_layers": None})(), 10) == {"draft": 8}  # unbounded: as deep as allowed
    assert pol.choose(Block(), 10) == {"draft": 3} and pol.choose(Block(), 2) == {"draft": 2}

    class Hybrid(HybridDrafter):
        def proposal(self, source, k):
            return 0 if source == "ngram" else None  # no n-gram match this pass

    both = {s: DraftCost(0.0, 0.0) for s in ("head", "ngram")}
    pol = AdaptivePolicy(flat, both, {"head": [0.9], "ngram": [0.9]}, k_max=8)
    pol.reset(0)
    assert pol.choose(Hybrid(Block()), 10) == {"head": 3, "ngram": 0}
    # the families' own depths: MTP's separate modules, Medusa's tree; EAGLE none (DFlash's: tests/test_dflash.py)
    io = target_io(sharp_model)
    torch.manual_seed(0)
    eagle3 = eagle.build(eagle.Eagle3Config(layer_ids=[0, 1], draft_vocab_size=97, ttt_length=2), io)
    got = {"mtp": mtp.drafter(mtp.build(mtp.MTPConfig(num_modules=2), io), io).max_depth,
           "mtp recursive": mtp.drafter(mtp.build(mtp.MTPConfig(recursive=True, num_steps=2), io), io).max_depth,
           "medusa": medusa.drafter(medusa.build(medusa.MedusaConfig(num_heads=3), io), io).max_depth,
           "eagle3": getattr(eagle.drafter(eagle3, io), "max_depth", None)}
    assert got == {"mtp": 2, "mtp recursive": None, "medusa": 3, "eagle3": None}


def test_a_tree_is_priced_at_the_nodes_its_drafter_says_it_drafts():
    """Mutant policy_ignores_declared_nodes: EAGLE-2's dynamic tree of top_k 2 and 3 nodes drafts 2 nodes at
    depth 1 and 3 at any depth after (EagleDrafter.nodes). Priced at its learned width (2 nodes a depth), depth
    3 would look like 6 nodes past the flat part of the verify curve; priced at its own count it is 3 nodes,
    and no deeper than 3 (3 nodes reach depth 3 at most): alone, and as a hybrid's head through DeferredSync."""

    class Tree:
        capture_layers = None

        def nodes(self, k):
            return min(3, 2 * k)

    steep = VerifyCost({1: 1.0, 4: 1.0, 5: 3.0, 17: 3.0}, context_len=64)
    pol = AdaptivePolicy(steep, {"draft": DraftCost(0.0, 0.0)}, {"draft": [0.5]}, k_max=8)
    pol.reset(0)
    pol.width["draft"] = 2.0  # what the trees of 2 nodes at depth 1 taught it
    assert pol.choose(type("Undeclared", (), {"capture_layers": None})(), 10) == {"draft": 1}
    assert pol.choose(Tree(), 10) == {"draft": 3}
    assert pol.expected({"draft": 3})[2] == 3

    class Hybrid(HybridDrafter):
        def proposal(self, source, k):
            return 0 if source == "ngram" else None  # no n-gram match this pass

    pol = AdaptivePolicy(steep, {s: DraftCost(0.0, 0.0) for s in ("head", "ngram")},
                         {"head": [0.5], "ngram": [0.5]}, k_max=8)
    pol.reset(0)
    pol.width["head"] = 2.0
    assert pol.choose(Hybrid(Tree()), 10) == {"head": 3, "ngram": 0}


def test_the_ngram_is_priced_by_its_match_order():
    """Mutant ngram_priced_as_one_average: the hybrid's n-gram proposals alternate between 3-token matches whose
    two drafted tokens are always accepted and 1-token matches whose drafts never are. Two tokens pay only when
    a(1) > 0.61 here (T(3) = 1.9 T(1)), so one average (0.5) would price both out; keyed by match order, every
    3-token match is drafted and the 1-token ones are left to the re-probes."""

    class Matches:
        SOURCES = ("head", "ngram")
        order = 3

        def proposal(self, source, k):
            return min(2, k) if source == "ngram" else None

        def proposal_key(self, source):
            return f"ngram@{self.order}" if source == "ngram" else source

    verify = VerifyCost({1: 1.0, 2: 1.45, 3: 1.9}, context_len=64)
    pol = AdaptivePolicy(verify, {s: DraftCost(0.0, 0.0) for s in ("head", "ngram")},
                         {"head": [0.0], "ngram": [0.7]}, k_max=2, probe_every=4)
    pol.reset(0)
    d, picks = Matches(), {3: [], 1: []}
    for i in range(60):
        d.order = 3 if i % 2 == 0 else 1
        n = pol.choose(d, 2)["ngram"]
        picks[d.order].append(n)
        tree = DraftTree.chain(torch.tensor([5, 6][:n]))
        tree.sources = ["ngram"] * n
        pol.observe(tree, [0, 1][:n] if d.order == 3 else [])
    assert picks[3][-15:] == [2] * 15
    assert sum(1 for n in picks[1][-15:] if n) <= 3  # re-probes only
    assert pol.rates("ngram", "ngram@3")[0] > 0.9 and pol.rates("ngram", "ngram@1")[0] < 0.61
    assert pol.upper_rates("ngram")[0] == pytest.approx(pol.rates("ngram", "ngram@3")[0])


def test_the_hybrid_keys_its_ngram_proposal_by_match_order():
    ngram = NgramDrafter()
    ngram.begin(torch.tensor([[5, 1, 2, 7, 8, 9, 4, 1]]), None, 2)  # (4 1 2) unseen; (1 2) continued with 7 8 9
    d = HybridDrafter(DeferredSync(NgramDrafter()), ngram)
    assert d.proposal("ngram", 3) == 3 and d.proposal_key("ngram") == "ngram@2" and d.proposal_key("head") == "head"
    ngram.commit_tokens([], None, 6)  # suffix (2, 6) never seen, (6) neither: no match
    assert d.proposal("ngram", 3) == 0 and d.proposal_key("ngram") == "ngram@0"


def test_drafting_priced_at_what_it_was_seen_to_cost():
    """Mutant drafting_cost_never_learned: a head calibrated at 1 ms a draft whose drafting passes take 20 ms
    (a catch-up, tree work the calibration never saw) is priced at what they took, and stops drafting at an
    acceptance that pays at 1 ms and not at 20; the n-gram, whose passes cost what they were priced at, keeps
    its own price."""
    verify = VerifyCost({1: 0.040, 2: 0.042, 3: 0.044}, context_len=64)
    pol = AdaptivePolicy(verify, {"head": DraftCost(0.001, 0.0), "ngram": DraftCost(0.0001, 0.0)},
                         {"head": [0.3], "ngram": [0.0]}, k_max=2, probe_every=1000, explore_z=0.0)
    pol.reset(0)  # no exploration: nothing is observed here, so the estimate would stay as uncertain as the prior
    d = type("Head", (), {"SOURCES": ("head", "ngram")})()
    assert pol.choose(d, 2)["head"] > 0  # 1.3 tokens for 1.1 passes' time: drafts
    for _ in range(8):  # acceptance stays the prior's (nothing observed): only the price changes
        if not pol.choose(d, 2)["head"]:
            break
        pol.observe_drafting(0.020)
    assert pol.draft_scale("head") > 5 and pol.draft_scale("ngram") == 1.0
    assert pol.choose(d, 2)["head"] == 0  # 20 ms of drafting for 0.3-0.5 tokens: plain is faster
    pol.observe_drafting(0.5)  # a plain pass priced nothing: nothing learned
    assert pol.draft_scale("head") < 20


def test_the_decoder_reports_the_drafters_own_seconds(target, prompt, reference):  # noqa: F811 (fixtures imported from test_decoder)
    """observe_drafting gets, after every drafting pass and only then, the drafter's seconds (its draft and
    commit, here each sleeping 3 ms), not the policy's own choice (sleeping 30 ms); the stats' forward time is
    the target's forwards alone, none of those sleeps."""
    class Slow(NgramDrafter):
        def draft(self, k, temperature):
            time.sleep(0.003)
            return super().draft(k, temperature)

        def commit_tokens(self, tokens, features, next_token):
            time.sleep(0.003)
            super().commit_tokens(tokens, features, next_token)

    class Spy(DraftingSpy):
        def choose(self, drafter, budget):
            time.sleep(0.03)
            return super().choose(drafter, budget)

    pol = Spy(0, p_zero=0.5)
    out, st = speculative_generate(target, prompt, Slow(), 4, MAX_NEW, policy=pol)
    assert out.tolist() == reference.tolist()
    drafting_passes = sum(1 for n in st.nodes_per_pass if n)
    assert len(pol.seen) == drafting_passes > 3
    assert all(0.003 <= x < 0.03 for x in pol.seen)
    assert 0 < st.forward_time_s < st.verify_time_s
    assert st.decode_time_s - st.forward_time_s >= 0.03 * st.target_passes + 0.003 * drafting_passes


def test_the_drafting_cost_leaves_out_a_deferred_catch_up(target, prompt, reference):  # noqa: F811
    """What a DeferredSync spends handing over deferred work (here the prompt's begin, sleeping 50 ms, paid by
    the first draft) is paid once: observe_drafting leaves it out, the stats' drafting time keeps it. Priced
    into every later draft (eval.policy.AdaptivePolicy.draft_scale), a quickstart gsm8k request with two early
    rejections drafted on 6 of its 127 passes."""
    class SlowBegin(NgramDrafter):
        def begin(self, prompt_ids, features, next_token):
            time.sleep(0.05)
            super().begin(prompt_ids, features, next_token)

        def lookup(self, k):  # always a draft, as a head's: the n-gram's match, else the last token repeated
            return super().lookup(k) or [self.tokens[-1]] * k

    for drafter in (DeferredSync(SlowBegin()), HybridDrafter(SlowBegin())):
        pol = DraftingSpy(1, p_zero=0.5)
        out, st = speculative_generate(target, prompt, drafter, 4, MAX_NEW, policy=pol)
        assert out.tolist() == reference.tolist()
        assert len(pol.seen) > 3 and max(pol.seen) < 0.03
        assert st.draft_time_s >= 0.05 + sum(pol.seen)


def test_measured_prior_stops_at_the_first_untested_depth():
    st = GenerationStats(accepted_per_position=[3, 1, 0], judged_per_position=[4, 2, 0])
    assert measured_prior(st) == pytest.approx([0.75, 2 / 3]) and st.acceptance_rates == [0.75, 0.5, 0.0]
    assert AdaptivePolicy(VERIFY, {"draft": DraftCost(0, 0)}, {"draft": measured_prior(st)}).prior["draft"][:4] == \
        pytest.approx([0.75, 2 / 3, 2 / 3, 2 / 3])


# The quickstart head's calibration (2026-12-05): raw rates 0.45 / 0.54 / 0.67 / 1.0 / 0.5 on 31 / 13 / 6 / 4 / 4
# judgments. On passage questions its policy drafted 5 deep at a first-depth estimate of 0.3, pricing depth 4's
# chance 1.0; no second draft token was ever accepted there.
QS_ACCEPTED, QS_JUDGED = [14, 7, 4, 4, 2], [31, 13, 6, 4, 4]
# About that run's costs: a plain pass 54 ms, one drafted token 64, five 70 (its timed passes' medians), and the
# calibration's draft line (1.1 ms + 1.4 ms per token).
QS_VERIFY = VerifyCost({1: 0.0544, 2: 0.0642, 3: 0.0670, 4: 0.0690, 5: 0.0700, 6: 0.0742, 7: 0.0760, 8: 0.0790,
                        9: 0.0810}, context_len=200)
QS_DRAFT = DraftCost(0.0011, 0.0014)


def test_a_deep_rate_judged_a_few_times_is_pulled_toward_the_depth_above():
    st = GenerationStats(accepted_per_position=QS_ACCEPTED + [0, 0, 0], judged_per_position=QS_JUDGED + [2, 0, 0])
    # each depth: (accepted + 4 * the shrunk rate above) / (judged + 4); depth 1 as measured
    expect = [14 / 31]
    for a, j in zip(QS_ACCEPTED[1:] + [0], QS_JUDGED[1:] + [2]):
        expect.append((a + 4 * expect[-1]) / (j + 4))
    assert measured_prior(st) == pytest.approx(expect) and expect[3] == pytest.approx(0.804, abs=1e-3)
    # a rate judged hundreds of times keeps its value; one judged once is mostly the depth above's
    often = GenerationStats(accepted_per_position=[50, 300, 0], judged_per_position=[100, 400, 0])
    assert measured_prior(often) == pytest.approx([0.5, 0.75], abs=3e-3)
    assert costs.shrunk_rates([1, 1], [2, 1]) == pytest.approx([0.5, 0.6])


def test_a_chance_deep_rate_does_not_buy_deep_drafts():
    """A last measured rate is repeated to every deeper depth (eval.speedup.extend_rates): 2 accepted of 2 at
    depth 2, behind 8 of 40 at depth 1, priced raw says every token past the first is certain and buys an 8-deep
    draft at the quickstart's costs; shrunk (0.47 there) it buys at most 2 (mutant prior_trusts_few_judgments)."""
    st = GenerationStats(accepted_per_position=[8, 2, 0], judged_per_position=[40, 2, 0])
    raw = [a / j for a, j in zip(st.accepted_per_position[:2], st.judged_per_position[:2])]
    chosen = {}
    for name, prior in (("raw", raw), ("shrunk", measured_prior(st))):
        pol = AdaptivePolicy(QS_VERIFY, {"draft": QS_DRAFT}, {"draft": prior})
        chosen[name] = pol.best_lengths(["draft"], {"draft": 8})["draft"]
    assert chosen["raw"] == 8 and chosen["shrunk"] <= 2, chosen


def test_the_verify_curve_is_priced_nondecreasing():
    dip = VerifyCost({1: 0.057, 2: 0.09, 4: 0.07, 8: 0.2}, context_len=64)  # T(4) < T(2): noise
    assert isotonic(dip).seconds == pytest.approx({1: 0.057, 2: 0.08, 4: 0.08, 8: 0.2})
    spike = VerifyCost({1: 0.1, 2: 0.3, 3: 0.15, 4: 0.15, 8: 0.2}, context_len=64)  # T(2) a spike: pooled, not max
    assert isotonic(spike).seconds == pytest.approx({1: 0.1, 2: 0.2, 3: 0.2, 4: 0.2, 8: 0.2})
    pol = AdaptivePolicy(dip, {"draft": DraftCost(0, 0)}, {"draft": [0.5]})
    ts = [pol._verify(n) for n in range(1, 12)]
    assert ts == sorted(ts) and pol._verify(3) == pytest.approx(0.08)


def test_fast_length_search_is_the_cost_model_argmax():
    rng = random.Random(0)
    for trial in range(30):
        sources = ("head", "ngram") if trial % 3 else ("draft",)
        pol = AdaptivePolicy(VERIFY, {s: DraftCost(rng.uniform(0, 0.01), rng.uniform(0, 0.005)) for s in sources},
                             {s: [rng.random() for _ in range(5)] for s in sources}, k_max=6)
        pol.width[sources[0]] = rng.choice([1.0, 1.5, 3.0])
        limit = {s: rng.randint(0, 6) for s in sources}
        grid = itertools.product(*(range(limit[s] + 1) for s in sources))
        brute = max(grid, key=lambda ls: pol.predicted_speedup(dict(zip(sources, ls))) - 1e-12 * sum(ls))
        fast = pol.best_lengths(sources, limit)
        assert pol.predicted_speedup(fast) == pytest.approx(pol.predicted_speedup(dict(zip(sources, brute))))


def test_the_plain_bound_never_changes_the_choice():
    """best_lengths returns plain without pricing each candidate when the deepest E over the cheapest pass cannot
    beat the margin. Near break-even (low acceptance, costs and margins around a draft's worth, curves of any
    nondecreasing shape) its choice is still the exhaustive search's, plain or not, and the bound is what decides
    most of the plain passes. Planted: the bound's E from the first depth only, or its pass priced at the most
    nodes, each return plain where a deeper draft pays, and fail here."""
    rng = random.Random(1)
    plain_by_bound = drafting = 0
    for trial in range(400):
        sources = ("head", "ngram") if trial % 2 else ("draft",)
        raw = {n: n * rng.uniform(0.0, 0.02) for n in (2, 3, 4, 6, 8, 12)} | {1: 0.05}
        curve = VerifyCost({n: 0.05 + sum(v for m, v in raw.items() if 1 < m <= n) for n in raw}, context_len=0)
        pol = AdaptivePolicy(curve, {s: DraftCost(rng.uniform(0, 0.01), rng.uniform(0, 0.004)) for s in sources},
                             {s: [rng.uniform(0.0, 0.7) for _ in range(6)] for s in sources}, k_max=6,
                             margin=rng.choice([1.0, 1.02, 1.1]))
        pol.width[sources[0]] = rng.choice([1.0, 2.0])
        limit = {s: rng.randint(0, 6) for s in sources}
        speeds = {ls: pol.predicted_speedup(dict(zip(sources, ls)))
                  for ls in itertools.product(*(range(limit[s] + 1) for s in sources)) if any(ls)}
        best = max(speeds.values(), default=0.0)
        chosen = pol.best_lengths(sources, limit)
        if best > pol.margin * (1 + 1e-9):
            drafting += 1
            assert pol.predicted_speedup(chosen) == pytest.approx(best, rel=1e-12), trial
        else:
            assert not any(chosen.values()), trial
            calls = []
            pol._t_version = -1  # every T(n) through the counted function
            counted, pol.verify = pol.verify, lambda n, f=pol.verify, seen=calls: seen.append(n) or f(n)
            pol.verify.version = counted.version
            pol.best_lengths(sources, limit)
            pol.verify = counted
            plain_by_bound += len(set(calls)) <= 2 and len(speeds) > 1  # T(1) and the cheapest pass only
    # drafts, plain passes the bound decides, and plain passes it leaves to the full search, each well exercised
    assert drafting >= 50 and plain_by_bound >= 100 and 400 - drafting - plain_by_bound >= 50, (drafting, plain_by_bound)


# ----------------------------------------------------------------------------------------------- sync
class OracleNgram(NgramDrafter):
    """An n-gram proposer that knows the greedy continuation `ref` (2 tokens at a time): its branches get
    accepted, a random head's not."""

    def __init__(self, ref: list[int]):
        super().__init__()
        self.ref = ref

    def begin(self, prompt_ids, features, next_token):
        self.prompt_len = prompt_ids.shape[1]
        super().begin(prompt_ids, features, next_token)

    def lookup(self, k):
        done = len(self.tokens) - self.prompt_len  # new tokens committed, the root included
        return self.ref[done:done + min(k, 2)]  # short: many passes, the head drafting in some


@pytest.mark.parametrize("family,wrap", [("eagle3", "hybrid"), ("model", "hybrid"), ("eagle3", "deferred")])
def test_head_stays_in_sync_when_ngram_branches_are_accepted(sharp_model, family, wrap):  # noqa: F811 (fixture imported from test_decoder)
    """Also when its commits were deferred over plain passes (DeferredSync, inside every HybridDrafter).

    sharp_model's predictions depend on the whole context, so a head fed a wrong or reordered path drafts
    differently from a fresh one."""
    io = target_io(sharp_model)
    ids = torch.randint(97, (1, 12), generator=torch.Generator().manual_seed(0))
    ref, _ = plain_generate(sharp_model, ids, MAX_NEW)
    if family == "eagle3":
        torch.manual_seed(0)
        head = eagle.build(eagle.Eagle3Config(layer_ids=[0, 1], draft_vocab_size=97, ttt_length=2), io)
        make = lambda: eagle.drafter(head, io)  # noqa: E731
    else:
        make = lambda: ModelDrafter(layer_prefix_model(sharp_model, 1))  # noqa: E731
    rec = Recorder(make())
    d = HybridDrafter(rec, OracleNgram(ref.tolist())) if wrap == "hybrid" else DeferredSync(rec)
    out, st = speculative_generate(sharp_model, ids, d, 3, MAX_NEW, policy=RandomPolicy(3, p_zero=0.6))
    assert out.tolist() == ref.tolist() and len(set(ref.tolist())) > 10
    if wrap == "hybrid":
        assert st.accepted_by_source.get("ngram", 0) >= 5  # paths the head did not propose were committed
    assert len(rec.records) > 3
    drafted_at = [m for m, _, _ in rec.records]
    assert max(b - a for a, b in zip(drafted_at, drafted_at[1:])) >= 4  # several commits deferred at once
    full = torch.cat([ids[0], out])[None]
    assert rec.seq == full[0, :len(rec.seq)].tolist()  # the head was handed the tokens really committed
    feats = None
    if rec.capture_layers is not None:
        feats, _ = forward_features(sharp_model, full, None, list(rec.capture_layers))
    for m, k, toks in rec.records:
        fresh = make()
        fresh.begin(full[:, :m - 1], None if feats is None else feats.slice(0, m - 1), int(full[0, m - 1]))
        assert fresh.draft(k, 0.0).tokens.tolist() == toks, f"head out of sync after {m} committed tokens"


# ----------------------------------------------------------------------------------------------- sampling law
PROMPT4 = [1, 3, 2, 0, 1, 3]


@pytest.fixture(scope="module")
def head4():
    """A second vocab-4 model drafting by sampling: its q is not the target's p, so rejections happen."""
    torch.manual_seed(9)
    cfg = LlamaConfig(vocab_size=4, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, initializer_range=0.6)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(-3.0)  # q unlike p: many rejections
    return model


def _sampled(model, i):
    return ModelDrafter(model, generator=torch.Generator().manual_seed(10_000 + i))


def test_sampling_exact_under_a_random_policy(vocab4_model, head4):
    def run():
        return sampling_pvalue(vocab4_model, PROMPT4, lambda i: _sampled(head4, i), samples=400,
                               make_policy=lambda i: RandomPolicy(i))

    pv = run()
    assert pv > 1e-3, f"chi-square p = {pv:.2e}"


def test_hybrid_sampling_is_exact_and_a_biased_hybrid_fails(vocab4_model, head4, monkeypatch):
    def run():
        return sampling_pvalue(vocab4_model, PROMPT4, lambda i: HybridDrafter(_sampled(head4, i)),
                               samples=500, make_policy=lambda i: RandomPolicy(i, p_zero=0.1))

    assert run() > 1e-3
    # The named bias: n-gram nodes judged as i.i.d. draws from a uniform q instead of the one-hot q.
    monkeypatch.setattr(drafters, "deterministic_q", lambda toks, like: torch.full(
        (len(toks), like.shape[-1]), 1.0 / like.shape[-1], dtype=like.dtype))
    pv = run()
    assert pv < 1e-6, f"the biased hybrid passed (p = {pv:.2e})"


def test_hybrid_with_a_topk_tree_samples_exactly(vocab4_model):
    """An EAGLE-2 dynamic tree (deterministic top-k children, sampling "topk") plus n-gram branches."""
    io = target_io(vocab4_model)
    torch.manual_seed(0)
    head = eagle.build(eagle.Eagle3Config(layer_ids=[0, 1], draft_vocab_size=4, ttt_length=2), io)
    pv = sampling_pvalue(vocab4_model, PROMPT4,
                         lambda i: HybridDrafter(eagle.drafter(head, io, tree="dynamic", top_k=2, total_tokens=4)),
                         samples=400, make_policy=lambda i: RandomPolicy(i, p_zero=0.1))
    assert pv > 1e-3, f"chi-square p = {pv:.2e}"


def test_timed_passes_teach_the_verify_curve():
    """Alternating 1- and 4-token passes at 0.05 and 0.25 s: T(4) / T(1) is learned from the adjacent pairs
    (the probe's flat 1.0 weighted 4), the level from every pass; T(8) pooled up to T(4), never below it."""
    probe = VerifyCost({1: 0.05, 2: 0.05, 4: 0.05, 8: 0.05}, 64)
    learned = LearnedVerifyCost(probe, probe_weight=4.0, decay=1.0)
    assert learned(3) == pytest.approx(0.05) and learned.version == 0
    for _ in range(12):
        learned.observe(1, 0.05)
        learned.observe(4, 0.25)
    assert learned.ratio(4) == pytest.approx((4 * 1.0 + 23 * 5.0) / 27)  # 23 neighbouring (1, 4) pairs, each 5.0
    assert learned.ratio(2) == learned.ratio(1) == 1.0  # never timed: the probe's shape
    # T(8), never timed, is the probe's ratio 1.0: pooled with T(4) at their weights (4 against 4 + 23)
    est = learned.estimate().seconds
    assert learned(4) == learned(8) == pytest.approx((27 * est[4] + 4 * est[8]) / 31)
    assert learned.version == 24


def test_the_learned_verify_curve_keeps_its_shape_while_the_machine_drifts():
    """Mutant verify_shape_never_learned (and the per-size means before it): a request that drafts a 3-node tree
    on every pass after a spell of plain passes, the machine 30% slower during the plain spell, T(4) = 1.1 T(1)
    at any moment. Per-size means read
    T(4) from the fast spell against T(1) from the slow one, and the nondecreasing fit priced the tree at one
    plain pass (the quickstart head drafted at a first-token acceptance of 0.17 and ran 0.93x). The probe's
    shape stands until neighbouring passes of both sizes measure it, as those of a later alternating spell do
    (where T(4) = 1.25 T(1))."""
    probe = VerifyCost({1: 0.050, 2: 0.052, 4: 0.055, 8: 0.080}, 64)  # the probe's shape: T(4) = 1.1 T(1)
    learned = LearnedVerifyCost(probe)
    t1 = 0.05
    for _ in range(20):
        learned.observe(1, 1.3 * t1)  # the slow spell, plain passes only
    for _ in range(20):
        learned.observe(4, 1.1 * t1)  # the fast spell, the next request drafting trees only
    # one neighbouring pair where the spells meet (0.85) against the probe's 1.1 weighted 4
    assert learned(4) / learned(1) == pytest.approx((4 * 1.1 + 1.1 / 1.3) / 5, abs=0.01)
    for i in range(40):  # then drafting turns on and off, the machine drifting steadily; T(4) = 1.25 T(1) now
        speed = 1.0 + 0.01 * i
        learned.observe(1, speed * t1)
        learned.observe(4, speed * 1.25 * t1)
    # the probe's 1.1 (weight 4) against the decayed samples' 1.25 (a count of 10 at decay 0.9)
    assert learned(4) / learned(1) == pytest.approx((4 * 1.1 + 10 * 1.25) / 14, abs=0.02)
    assert learned(1) == pytest.approx(1.39 * t1, rel=0.05)  # the level follows the drift


def test_plain_passes_anchor_the_learned_single_token_cost(tiny_target):
    """Every plain pass of the eval is a measurement of T(1) at that turn's context, timed beside the drafters':
    each enters the run's learned curve as it happens, replacing a probe that read T(1) 10x too slow, and the
    probe's shape stands where no neighbouring passes of another size were timed."""
    from types import SimpleNamespace

    from eval.turns import Target, Turns, prompt_ids

    model, tok, io = tiny_target
    probe = VerifyCost({1: 10.0, 2: 10.0, 4: 10.0}, 64)  # a spell on the probe: 10 s a pass
    subject = SimpleNamespace(factory=lambda k: (lambda: None))
    turns = Turns(Target(model, tok, io, torch.device("cpu"), [tok.eos_token_id]), subject,
                  SimpleNamespace(k=2, verify=probe), SimpleNamespace(max_new_tokens=6, cache="dynamic"), 0, None)
    ids = prompt_ids(tok, [{"role": "user", "content": "Hello"}], torch.device("cpu"))
    _, st = turns.generate("plain", ids, 0.0, 0)
    assert turns.learned.version == st.target_passes == 5
    assert 0 < turns.learned(1) < 0.01 * 10.0 and turns.learned(4) == pytest.approx(turns.learned(1))


def test_a_turn_runs_its_methods_pass_interleaved(tiny_target, monkeypatch):
    """eval.turns.Turns.turn runs plain and the decoder's methods side by side, one pass each in turn: on a
    machine that slows down steadily, two methods doing the same work time alike (back to back, the second
    would read about 1.5x slower)."""
    from types import SimpleNamespace

    from test_decoder import drifting_clock

    from eval.decoder import plain_steps
    from eval.turns import Target, Turns, prompt_ids

    model, tok, io = tiny_target
    probe = VerifyCost({1: 0.05, 2: 0.05, 4: 0.05}, 64)
    subject = SimpleNamespace(factory=lambda k: (lambda: None))
    turns = Turns(Target(model, tok, io, torch.device("cpu"), [tok.eos_token_id]), subject,
                  SimpleNamespace(k=2, verify=probe), SimpleNamespace(max_new_tokens=12), 0, None)
    ids = prompt_ids(tok, [{"role": "user", "content": "Hello"}], torch.device("cpu"))
    drifting_clock(monkeypatch, 1.04)
    # every method does plain's work here, so only the timing can tell them apart
    monkeypatch.setattr(Turns, "steps", lambda self, name, ids, temp, seed: plain_steps(model, ids, 12))
    out = turns.turn(["plain", "same"], ids, 0.0, 0)
    assert list(out) == ["plain", "same"] and torch.equal(out["plain"][0], out["same"][0])
    assert out["same"][1].total_time_s / out["plain"][1].total_time_s == pytest.approx(1.0, abs=0.05)


def test_policy_stops_drafting_when_its_timed_passes_are_slow():
    # The probe says verifying is free, so a 0.6-accepted draft pays; the run's own passes say a 4-token pass
    # costs five plain ones, which no acceptance below 1 repays. Two policies share the learner (as eval.run's
    # requests do): what one request timed, the next one prices.
    probe = VerifyCost({n: 0.05 for n in (1, 2, 3, 4, 5, 8)}, 64)
    learned = LearnedVerifyCost(probe)
    first = AdaptivePolicy(learned, {"draft": DraftCost(0.0, 0.0005)}, {"draft": [0.6] * 4})
    first.reset(0)
    assert first.choose(NgramDrafter(), 10)["draft"] >= 2
    for _ in range(30):  # T(1 + k) = T(1) * (1 + 4k/3): T(4) = 5 T(1)
        for n in range(1, 9):
            first.observe(DraftTree.chain(torch.arange(n - 1)), [], 0.05 * (1 + 4 * (n - 1) / 3))
    second = AdaptivePolicy(learned, {"draft": DraftCost(0.0, 0.0005)}, {"draft": [0.6] * 4})
    second.reset(0)
    assert second.choose(NgramDrafter(), 10)["draft"] == 0
    assert first.choose(NgramDrafter(), 10)["draft"] == 0


def test_two_chance_rejections_do_not_turn_a_useful_head_off():
    """Mutant no_exploration: the quickstart's block drafter on gsm8k (prior 0.27 at depth 1; a one-token draft
    costs 9% of a pass; T(2) = 1.01 T(1); the eval's 5% margin) had its first two drafts rejected: the estimate
    fell to 0.14, below the price of a draft, and its re-probes kept it plain for a 120-pass answer on which it
    went on to accept 0.46 of its first tokens. While the estimate is that uncertain a one-token draft is tried;
    a head rejected every time stops within a dozen passes and then only re-probes."""
    from eval.turns import SINGLE_STREAM_MARGIN

    verify = VerifyCost({1: 0.0355, 2: 0.0360, 3: 0.0380}, 64)
    cost = {"draft": DraftCost(0.0023, 0.0009)}  # the quickstart block drafter's calibration (eval report)

    def policy(z: float) -> AdaptivePolicy:
        pol = AdaptivePolicy(verify, cost, {"draft": [0.27, 0.35]}, margin=SINGLE_STREAM_MARGIN, explore_z=z)
        pol.reset(0)
        return pol

    miss = DraftTree.chain(torch.tensor([1]))
    for z, drafts in ((1.0, 1), (0.0, 0)):
        pol = policy(z)
        assert pol.choose(object(), 8)["draft"] >= 1
        pol.observe(miss, [])
        pol.observe(miss, [])
        assert pol.rates("draft")[0] < 0.15
        assert pol.choose(object(), 8)["draft"] == drafts
    useless = policy(1.0)
    picks = []
    for _ in range(100):
        picks.append(useless.choose(object(), 8)["draft"])
        if picks[-1]:
            useless.observe(DraftTree.chain(torch.arange(picks[-1])), [])
    assert sum(map(bool, picks[:12])) >= 6 and sum(map(bool, picks[12:])) <= 6  # explores, then re-probes only
    with pytest.raises(ValueError, match="explore_z"):
        AdaptivePolicy(verify, cost, {"draft": [0.5]}, explore_z=-1.0)


def test_a_known_proposal_is_not_explored_one_token():
    """Mutant ngram_explored_one_token: a proposal known before drafting (the n-gram's match) is worth its deep
    positions, so a pass priced plain explores only proposers that guess (heads); one-token explorations of the
    hybrid's n-gram cost the quickstart's hybrid 0.04-0.05x on mt_bench and humaneval."""
    flat = VerifyCost({1: 0.05, 2: 0.05, 4: 0.05, 8: 0.05}, 64)

    class Proposals:
        SOURCES = ("ngram", "head")

        def proposal(self, source, k):
            return min(5, k) if source == "ngram" else None

    pol = AdaptivePolicy(flat, {s: DraftCost(0.0, 0.0) for s in ("ngram", "head")},
                         {"ngram": [0.02] * 4, "head": [0.02] * 4}, margin=1.05, probe_every=1000)
    pol.reset(0)
    assert pol.choose(Proposals(), 8) == {"ngram": 0, "head": 1}  # 1.02 tokens a pass priced plain; 1.10 at best


def test_margin_turns_down_drafts_predicted_barely_faster():
    """With a margin, a draft predicted 3% faster than plain is not taken and one predicted 10% faster is; the
    eval's single-stream policies use eval.turns.SINGLE_STREAM_MARGIN (5%)."""
    from eval.turns import SINGLE_STREAM_MARGIN

    flat = VerifyCost({1: 0.05, 2: 0.05, 4: 0.05, 8: 0.05}, 64)

    def choice(acceptance: float, margin: float) -> int:
        pol = AdaptivePolicy(flat, {"draft": DraftCost(0.0, 0.0)}, {"draft": [acceptance] + [0.0] * 7},
                             margin=margin, explore_z=0.0)  # the estimate's price alone (no exploration)
        pol.reset(0)
        return pol.choose(object(), 8)["draft"]  # a drafter without a known proposal (a head)

    assert choice(0.03, 1.0) == 1 and choice(0.03, SINGLE_STREAM_MARGIN) == 0
    assert choice(0.10, SINGLE_STREAM_MARGIN) == 1
    with pytest.raises(ValueError, match="margin"):
        AdaptivePolicy(flat, {"draft": DraftCost(0.0, 0.0)}, {"draft": [0.5]}, margin=0.9)


def test_bench_policy_prices_exploration_both_ways(tmp_path, capsys):
    """scripts/bench_policy.py's simulation: at the quickstart's costs, exploring gains where a head is useful
    (first-token acceptance 0.45) and costs under 1% where nothing is accepted; its table and JSON agree."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("bench_policy", ROOT / "scripts" / "bench_policy.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "policy.json"
    bench.main(["--alphas", "0,0.45", "--requests", "40", "--json", str(out)])
    res = json.loads(out.read_text())
    assert res["1"]["0.45"]["speedup"] > res["0"]["0.45"]["speedup"] + 0.02
    assert res["1"]["0.45"]["drafted"] > res["0"]["0.45"]["drafted"]
    assert res["0"]["0"]["speedup"] - 0.01 < res["1"]["0"]["speedup"] < 1.0
    assert f'{res["1"]["0.45"]["speedup"]:.3f}x' in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        bench.main(["--draft-ms", "1"])
    assert e.value.code == 2
