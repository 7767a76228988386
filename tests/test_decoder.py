"""The speculative decoder on tiny fp32 models: greedy outputs identical to model.generate for chains and trees
and every drafter, oracle/adversarial drafters, KV rollback, features handed to drafters, tree utilities, costs.

    .venv/bin/python -m pytest -q tests/test_decoder.py
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from data.config import TargetConfig
from data.features import FeatureCapture
from data.kvcache import CACHE_KINDS, DynamicKV, StaticKV, new_kv, rollback_cache
from data.target import byte_tokenizer, load_model, tiny_config
from eval.costs import (
    DraftCost,
    VerifyCost,
    calibrate,
    choose_k,
    expected_tokens,
    ideal_speedup,
    measure_verify_cost,
    predicted_speedup,
    shrunk_rates,
)
from eval.decoder import (
    GenerationStats,
    interleave,
    plain_generate,
    plain_steps,
    speculative_generate,
    speculative_steps,
    target_distribution,
    verify_tree,
)
from eval.drafters import ModelDrafter, NgramDrafter, layer_prefix_model, self_speculative_drafter
from heads.base import DraftTree, Features
from heads.tree import DEFAULT_CHOICES, StaticTree, is_chain, tree_depth, tree_layout

MAX_NEW = 40


# ----------------------------------------------------------------------------------------------- helpers
@pytest.fixture(scope="module")
def target():
    """The tiny Llama architecture (hidden 64, 4 layers, byte vocab 259) with a larger init (0.3, seed 1), so
    that its greedy continuation of the prompt is varied: with the default init it repeats one token, and
    then an off-by-one in the cache or a wrong EOS cut produces the same tokens and no test can see it."""
    torch.manual_seed(1)
    cfg = tiny_config("tiny-random-llama", len(byte_tokenizer()))
    cfg.initializer_range = 0.3
    return LlamaForCausalLM(cfg).eval().requires_grad_(False)


@pytest.fixture(scope="module")
def prompt(tiny_target):
    tok = tiny_target[1]
    text = tok.apply_chat_template(
        [{"role": "user", "content": "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return"}],
        add_generation_prompt=True, tokenize=False,
    )
    return torch.tensor([tok.encode(text)])


@pytest.fixture(scope="module")
def reference(target, prompt):
    """model.generate's greedy continuation (transformers' own loop, the ground truth)."""
    out = target.generate(prompt, do_sample=False, max_new_tokens=MAX_NEW)[0, prompt.shape[1]:]
    assert len(out) == MAX_NEW and len(set(out.tolist())) >= 10, f"the reference is not varied: {out.tolist()}"
    return out


@pytest.fixture(scope="module")
def eos_at(reference):
    """(index, token): an end token chosen mid-continuation, its first occurrence at index >= 5."""
    ref = reference.tolist()
    i = next(i for i in range(5, len(ref) - 8) if ref[i] not in ref[:i])
    return i, ref[i]


class _Tracker:
    """Base of the test drafters: tracks how many tokens are committed, so it can look up the reference."""

    capture_layers = None

    def __init__(self, reference: torch.Tensor, seed: int = 0, vocab: int = 259):
        self.ref = reference.tolist()
        self.vocab = vocab
        self.rng = random.Random(seed)
        self.n = 0  # committed new tokens, root included
        self.tree: DraftTree | None = None

    def truth(self, depth: int) -> int:
        """The reference token `depth` steps below the root (the root is new token n-1)."""
        i = self.n - 1 + depth
        return self.ref[i] if i < len(self.ref) else 0

    def begin(self, prompt_ids, features, next_token):
        assert next_token == self.ref[0]
        self.n = 1

    def commit(self, accepted, features, next_token):
        toks = self.tree.tokens.tolist()
        got = [toks[a] for a in accepted] + [next_token]
        assert got == self.ref[self.n:self.n + len(got)]
        self.n += len(got)


class OracleDrafter(_Tracker):
    """Always right (right=True) or always wrong chains."""

    def __init__(self, reference, right: bool):
        super().__init__(reference)
        self.right = right

    def draft(self, k, temperature):
        toks = [self.truth(d) if self.right else (self.truth(d) + 1) % self.vocab for d in range(1, k + 1)]
        self.tree = DraftTree.chain(torch.tensor(toks))
        return self.tree


class AdversarialDrafter(_Tracker):
    """Random tokens, with a reference token now and then so some passes accept a few."""

    def draft(self, k, temperature):
        toks = [self.truth(d) if self.rng.random() < 0.3 else self.rng.randrange(self.vocab) for d in range(1, k + 1)]
        self.tree = DraftTree.chain(torch.tensor(toks))
        return self.tree


class StaticTreeDrafter(_Tracker):
    """A static Medusa-style tree whose per-depth candidates hold the reference token at a random rank."""

    def __init__(self, reference, seed: int = 0, choices=DEFAULT_CHOICES, vocab: int = 259):
        super().__init__(reference, seed, vocab)
        self.shape = StaticTree(choices)

    def draft(self, k, temperature):
        shape = self.shape if k >= self.shape.depth else self.shape.truncate(k)
        cands = []
        for d in range(1, shape.depth + 1):
            row = self.rng.sample(range(self.vocab), shape.topk)
            if self.rng.random() < 0.8:
                row[self.rng.randrange(shape.topk)] = self.truth(d)
            cands.append(row)
        self.tree = shape.build(torch.tensor(cands))
        return self.tree


class RandomTreeDrafter(_Tracker):
    """Random tree shapes (like EAGLE-2 dynamic trees); each node is the reference token with probability 1/2.

    With capture_layers set it also records the features it is handed, to check them against a full pass.
    """

    def __init__(self, reference, seed: int = 0, capture_layers=None, vocab: int = 259):
        super().__init__(reference, seed, vocab)
        self.capture_layers = capture_layers
        self.received: list[Features] = []

    def begin(self, prompt_ids, features, next_token):
        super().begin(prompt_ids, features, next_token)
        if self.capture_layers is not None:
            assert features.last.shape[1] == prompt_ids.shape[1]
            self.received.append(features)

    def draft(self, k, temperature):
        n = self.rng.randrange(0, 3 * k + 1)
        parents, depths, toks = [], [], []
        for i in range(n):
            p = self.rng.randrange(-1, i)
            d = 1 if p < 0 else depths[p] + 1
            if d > k:
                p, d = -1, 1
            parents.append(p)
            depths.append(d)
            toks.append(self.truth(d) if self.rng.random() < 0.5 else self.rng.randrange(self.vocab))
        self.tree = DraftTree(torch.tensor(toks, dtype=torch.long), torch.tensor(parents, dtype=torch.long))
        return self.tree

    def commit(self, accepted, features, next_token):
        if self.capture_layers is not None:
            assert features.last.shape[1] == len(accepted) + 1
            self.received.append(features)
        super().commit(accepted, features, next_token)


# ----------------------------------------------------------------------------------------------- greedy identity
@pytest.fixture(params=CACHE_KINDS)
def cache(request):
    """Every identity test runs on the dynamic and the static (preallocated, graph-ready) cache."""
    return request.param


def _check_identical(target, prompt, reference, drafter, k, eos=None, cache="dynamic"):
    out, stats = speculative_generate(target, prompt, drafter, k, MAX_NEW, eos_token_id=eos, cache=cache)
    assert out.tolist() == reference.tolist()
    assert stats.new_tokens == len(reference)
    return stats


@pytest.fixture(scope="module")
def other():
    """A second random model with the same byte tokenizer: a separate draft model."""
    return load_model(TargetConfig(name_or_path="tiny-random-qwen2", device="cpu"))


@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_identical_every_drafter_chains(target, other, prompt, reference, k, cache):
    eos = target.generation_config.eos_token_id
    drafters = [
        NgramDrafter(),
        NgramDrafter(n_max=1),
        ModelDrafter(other, cache=cache),
        ModelDrafter(target, cache=cache),
        self_speculative_drafter(target, 2, cache=cache),
        AdversarialDrafter(reference, seed=k),
    ]
    for d in drafters:
        _check_identical(target, prompt, reference, d, k, eos, cache)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_identical_static_and_random_trees(target, prompt, reference, seed, cache):
    for k in (2, 5):
        st = _check_identical(target, prompt, reference, StaticTreeDrafter(reference, seed), k, cache=cache)
        assert st.tau > 1.2  # the reference sits in the tree often enough to be accepted
        st = _check_identical(target, prompt, reference, RandomTreeDrafter(reference, seed), k, cache=cache)
        assert st.accepted_tokens > 0


def test_oracle_gives_k_plus_one_and_wrong_gives_one(target, prompt, reference, cache):
    k = 4
    # max_new 1 + 7*(k+1): the prefill token, then exactly 7 full passes.
    n = 1 + 7 * (k + 1)
    ref = target.generate(prompt, do_sample=False, max_new_tokens=n)[0, prompt.shape[1]:]
    assert len(ref) == n
    out, st = speculative_generate(target, prompt, OracleDrafter(ref, right=True), k, n, cache=cache)
    assert out.tolist() == ref.tolist() and st.tau == k + 1 and st.target_passes == 7
    assert st.acceptance_rates == [1.0] * k
    out, st = speculative_generate(target, prompt, OracleDrafter(ref, right=False), k, n, cache=cache)
    assert out.tolist() == ref.tolist() and st.tau == 1.0 and st.target_passes == n - 1
    # The last pass has one token left to make, so it drafts nothing.
    assert st.acceptance_rates == [0.0] * k and st.judged_per_position == [n - 2] + [0] * (k - 1)
    # The target drafting for itself is an oracle through the real draft-model cache bookkeeping.
    out, st = speculative_generate(target, prompt, ModelDrafter(target, cache=cache), k, n, cache=cache)
    assert out.tolist() == ref.tolist() and st.tau == k + 1


def test_eos_and_max_new_tokens_match_plain(target, prompt, reference, eos_at):
    i, eos = eos_at  # an end token first produced mid-continuation (never the prefill token)
    want = target.generate(prompt, do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=[eos, 10**6])
    want = want[0, prompt.shape[1]:].tolist()
    assert want == reference[:i + 1].tolist()
    # The oracle's first chain (k = i + 3) holds the eos at depth i with accepted tokens after it: they must
    # not be emitted. The other drafters meet the eos at whatever depth their passes reach.
    for drafter, k in ((OracleDrafter(reference, right=True), i + 3), (NgramDrafter(), 5),
                       (StaticTreeDrafter(reference), 5), (RandomTreeDrafter(reference, 1), 4)):
        out, st = speculative_generate(target, prompt, drafter, k, MAX_NEW, eos_token_id=[eos, 10**6])
        assert out.tolist() == want, type(drafter).__name__
        assert st.new_tokens == len(want)
    out, st = speculative_generate(target, prompt, OracleDrafter(reference, right=True), i + 3, MAX_NEW,
                                   eos_token_id=eos)
    assert st.target_passes == 1 and st.accepted_tokens == i + 3  # the eos really was inside an accepted draft
    plain, _ = plain_generate(target, prompt, MAX_NEW, eos_token_id=eos)
    assert plain.tolist() == want
    for m in (1, 2, 7):
        out, _ = speculative_generate(target, prompt, OracleDrafter(reference, right=True), 5, m)
        assert out.tolist() == reference[:m].tolist()


def test_plain_generate_matches_hf(target, prompt, reference, cache):
    out, st = plain_generate(target, prompt, MAX_NEW, cache=cache)
    assert out.tolist() == reference.tolist() and st.tau == 1.0 and st.target_passes == MAX_NEW - 1


def drifting_clock(monkeypatch, rate: float = 1.03) -> None:
    """eval.decoder's clock advances only inside target forwards, each `rate` times slower than the one before:
    a machine slowing down steadily under load."""
    import eval.decoder as decoder_mod

    clock = {"t": 0.0, "calls": 0}
    real_run = DynamicKV.run

    def slow_run(self, *a, **kw):
        clock["calls"] += 1
        clock["t"] += rate ** clock["calls"]
        return real_run(self, *a, **kw)

    monkeypatch.setattr(DynamicKV, "run", slow_run)
    monkeypatch.setattr(decoder_mod, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: clock["t"])}))


def test_interleaved_generations_share_the_drift_that_back_to_back_ones_split(target, prompt, reference,
                                                                              monkeypatch):
    drifting_clock(monkeypatch)
    n = 12
    first, second = (plain_generate(target, prompt, n)[1] for _ in range(2))
    assert second.total_time_s / first.total_time_s > 1.3  # the same work, back to back: the drift decides
    (a_ids, a), (b_ids, b), (s_ids, s) = interleave([plain_steps(target, prompt, n), plain_steps(target, prompt, n),
                                                     speculative_steps(target, prompt, NgramDrafter(), 3, n)])
    for ids in (a_ids, b_ids, s_ids):
        assert torch.equal(ids, reference[:n])
    assert b.total_time_s / a.total_time_s == pytest.approx(1.0, abs=0.04)
    assert a.target_passes == n - 1 and s.new_tokens == n


def test_no_run_always_follows_the_same_one(monkeypatch):
    """Mutant interleave_in_a_fixed_cycle: a step right after the heavy run's step costs 1.5 instead of 1 (a pass
    after a heavier one is slower on these CPUs). Two identical light runs interleaved with the heavy one must
    read alike; in a fixed cycle the one placed after the heavy run would pay the penalty on every step."""
    import eval.decoder as decoder_mod

    clock = {"t": 0.0, "last": None}

    def run(name: str, steps: int):
        yield
        for _ in range(steps):
            clock["t"] += 1.5 if clock["last"] == "heavy" and name != "heavy" else 1.0
            clock["last"] = name
            yield
        return torch.empty(0), GenerationStats()

    monkeypatch.setattr(decoder_mod, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: clock["t"])}))
    (_, heavy), (_, a), (_, b) = interleave([run("heavy", 60), run("a", 60), run("b", 60)])
    assert a.total_time_s / b.total_time_s == pytest.approx(1.0, abs=0.1)
    assert 60 * 1.1 < a.total_time_s < 60 * 1.4  # each light run follows the heavy one in about half the cycles


def test_gemma3_sliding_window_trees(prompt, cache):
    """Past the tiny Gemma-3's sliding window (64) the tree mask must apply the window too."""
    model = load_model(TargetConfig(name_or_path="tiny-random-gemma3", device="cpu"))
    n = 60  # prompt ~40 + 60 > 64
    ref = model.generate(prompt, do_sample=False, max_new_tokens=n)[0, prompt.shape[1]:]
    assert prompt.shape[1] + len(ref) > model.config.sliding_window + 8
    for drafter in (RandomTreeDrafter(ref, 0), NgramDrafter()):
        out, _ = speculative_generate(model, prompt, drafter, 4, n, cache=cache)
        assert out.tolist() == ref.tolist()


# ----------------------------------------------------------------------------------------------- features, caches
def test_drafter_receives_features_of_committed_positions(target, prompt, reference, cache):
    layers = (1, 3)
    drafter = RandomTreeDrafter(reference, seed=3, capture_layers=layers)
    out, _ = speculative_generate(target, prompt, drafter, 4, MAX_NEW, cache=cache)
    seq = torch.cat([prompt[0], out])[None]
    with FeatureCapture(target, layers) as cap:
        target(input_ids=seq, use_cache=False)
    full = cap.features()
    last = torch.cat([f.last for f in drafter.received], dim=1)
    aux = torch.cat([f.aux for f in drafter.received], dim=1)
    n = last.shape[1]  # the final pass commits nothing, so its tokens are missing at the end
    assert prompt.shape[1] < n < seq.shape[1]
    torch.testing.assert_close(last, full.last[:, :n], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(aux, full.aux[:, :n], atol=1e-4, rtol=1e-4)


def test_rollback_gathers_accepted_tree_nodes(target, prompt):
    """After a tree pass accepting nodes 1 and 3 (not a prefix), the cache equals a sequential pass's."""
    root, toks = 65, [70, 71, 72, 73, 74]
    parents = [-1, -1, 1, 2, 0]  # root -> 70, root -> 71 -> 72 -> 73, 70 -> 74
    anc, depths = tree_layout(parents)
    cache = DynamicCache()
    target(input_ids=prompt, cache=cache, use_cache=True)
    past = cache.get_seq_length()
    allowed = torch.ones(6, past + 6, dtype=torch.bool)
    allowed[:, past:] = anc
    mask = torch.zeros(1, 1, 6, past + 6).masked_fill(~allowed, torch.finfo(torch.float32).min)
    pos = past + torch.tensor([[0] + depths.tolist()])
    target(input_ids=torch.tensor([[root] + toks]), cache=cache, use_cache=True, attention_mask=mask, position_ids=pos)
    rollback_cache(cache, past + 1, len(toks), [1, 2, 3])
    ref = DynamicCache()
    target(input_ids=torch.cat([prompt, torch.tensor([[root, 71, 72, 73]])], dim=1), cache=ref, use_cache=True)
    assert cache.get_seq_length() == ref.get_seq_length() == past + 4
    for a, b in zip(cache.layers, ref.layers):
        torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.values, b.values, atol=1e-5, rtol=1e-5)
    # A prefix keep is a plain crop.
    rollback_cache(cache, past, 4, [0, 1])
    assert cache.get_seq_length() == past + 2
    torch.testing.assert_close(cache.layers[0].keys, ref.layers[0].keys[:, :, : past + 2])


def test_static_cache_matches_dynamic_through_trees_and_growth(target, prompt, reference):
    """Tree passes keeping a non-prefix path, on a static cache that grows mid-way: same logits as dynamic.
    Reused for a whole generation, the static cache starts empty again."""
    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(259, (1, 70), generator=g)
    dyn, sta = DynamicKV(target), StaticKV(target, max_len=70)
    assert sta.max_len == 128 and not sta.graphs  # rounded up to aligned masks; no graphs on CPU
    parents = torch.tensor([-1, 0, 0, 2])  # root -> a -> b, a -> c -> d: keep the path root, a, c, d
    for kv in (dyn, sta):
        kv.run(ctx, logits_to_keep=1)
        kv.keep(range(70))
    for _ in range(20):  # 70 + 20 * 4 rows > 128: the static cache grows with rows to carry over
        ids = torch.randint(259, (1, 5), generator=g)
        (a, _), (b, _) = dyn.run(ids, parents), sta.run(ids, parents)
        # Float noise only: the two caches reduce attention over differently shaped (masked) key sets.
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        for kv in (dyn, sta):
            kv.keep([0, 1, 3, 4])
    assert sta.max_len > 128 and sta.length == dyn.length == 150
    _check_identical(target, prompt, reference, StaticTreeDrafter(reference, 0), 5, cache=sta)
    assert new_kv(target, sta) is sta and sta.length == 0
    with pytest.raises(ValueError, match="same model"):
        new_kv(layer_prefix_model(target, 1), sta)
    with pytest.raises(ValueError, match="cache must be one of"):
        new_kv(target, "paged")


@pytest.mark.cuda
def test_static_cache_replays_cuda_graphs_exactly(target, prompt):
    """On a GPU the static cache captures every verify size as a CUDA graph and replays it: chains and trees
    decode the same tokens as plain decoding on the dynamic cache, with the graphs really captured."""
    model = copy.deepcopy(target).cuda()
    ids = prompt.cuda()
    plain, _ = plain_generate(model, ids, MAX_NEW)
    kv = StaticKV(model, max_len=ids.shape[1] + MAX_NEW + 64)
    assert kv.graphs
    for drafter, k in ((NgramDrafter(), 4), (StaticTreeDrafter(plain, 0), 5)):
        out, _ = speculative_generate(model, ids, drafter, k, MAX_NEW, cache=kv)
        assert out.tolist() == plain.tolist()
        assert kv.graph_error is None and any(step.graph is not None for step in kv._steps.values())
        kv = new_kv(model, kv)  # reused: emptied, its graphs kept


def test_dynamic_cache_crop_takes_negative_counts():
    """The installed transformers crops by a negative count (a positive length raises)."""
    cache = DynamicCache()
    cache.update(torch.zeros(1, 1, 5, 2), torch.zeros(1, 1, 5, 2), 0)
    cache.crop(-2)
    assert cache.get_seq_length() == 3
    with pytest.raises(ValueError):
        cache.crop(2)


class _CacheProbe(ModelDrafter):
    """Checks the draft model's cache invariant after every commit: cache + pending = committed tokens."""

    def begin(self, prompt_ids, features, next_token):
        super().begin(prompt_ids, features, next_token)
        self.committed = prompt_ids.shape[1] + 1

    def commit(self, accepted, features, next_token):
        super().commit(accepted, features, next_token)
        self.committed += len(accepted) + 1
        assert self.kv.length + len(self.pending) == self.committed


def test_model_drafter_cache_rollback(target, prompt, reference, cache):
    for draft_model in (target, layer_prefix_model(target, 1)):
        for k in (1, 3):
            _check_identical(target, prompt, reference, _CacheProbe(draft_model, cache=cache), k, cache=cache)


def test_layer_prefix_model_shares_weights_and_leaves_target_alone(target, prompt):
    short = layer_prefix_model(target, 2)
    assert target.config.num_hidden_layers == 4 and short.config.num_hidden_layers == 2
    assert short.lm_head.weight.data_ptr() == target.lm_head.weight.data_ptr()
    assert len(list(target.model.layers)) == 4
    with FeatureCapture(target, [2]) as cap:
        target(input_ids=prompt, use_cache=False)
    feats = cap.features()
    want = target.lm_head(target.model.norm(feats.aux))  # input of layer 2 = output of the first 2 layers
    torch.testing.assert_close(short(input_ids=prompt).logits, want, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="num_layers"):
        layer_prefix_model(target, 5)


def test_ngram_drafter_lookup():
    d = NgramDrafter(n_max=2, n_min=1)
    d.begin(torch.tensor([[1, 2, 3, 4, 1]]), None, 2)  # context [1 2 3 4 1 2]: (1 2) continues with 3 4 1
    assert d.draft(3, 0.0).tokens.tolist() == [3, 4, 1]
    d.commit([0], None, 9)  # context [... 1 2 3 9]
    assert d.draft(2, 0.0).tokens.tolist() == []  # (3 9) and (9) never occurred before
    d.commit([], None, 3)  # [... 3 9 3]: (9 3) unseen; (3) last continued with 9
    assert d.draft(2, 0.0).tokens.tolist() == [9, 3]
    with pytest.raises(ValueError):
        NgramDrafter(n_max=1, n_min=2)


# ----------------------------------------------------------------------------------------------- verification rule
def test_verify_tree_greedy_rules():
    rows = torch.nn.functional.one_hot(torch.tensor([5, 7, 2, 4]), 10).float()
    assert verify_tree(DraftTree.chain(torch.tensor([5, 7, 9])), rows, 0.0) == ([0, 1], 2)
    # root -> 3 | root -> 5 -> 7 ; rows: root says 5, node 1 (token 5) says 7, node 2 says 1
    tree = DraftTree(torch.tensor([3, 5, 7]), torch.tensor([-1, -1, 1]))
    rows = torch.nn.functional.one_hot(torch.tensor([5, 0, 7, 1]), 10).float()
    assert verify_tree(tree, rows, 0.0) == ([1, 2], 1)
    assert verify_tree(DraftTree.chain(torch.empty(0, dtype=torch.long)), rows[:1], 0.0) == ([], 5)


def test_verify_tree_sampling_edge_cases():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.0, 1.0, 0.0])
    # A token the target gives probability 0 is always rejected; the replacement follows p.
    for tree in (DraftTree.chain(torch.tensor([0])), DraftTree.chain(torch.tensor([0]), torch.tensor([[1.0, 0, 0]]))):
        assert verify_tree(tree, torch.stack([p, p]), 1.0, g) == ([], 1)
    # q = p: always accepted, then the bonus token from the node's row.
    q = torch.tensor([[0.5, 0.5, 0.0]])
    for _ in range(20):
        acc, nxt = verify_tree(DraftTree.chain(torch.tensor([1]), q), torch.stack([q[0], p]), 1.0, g)
        assert acc == [0] and nxt == 1
    with pytest.raises(ValueError, match="sampling"):
        verify_tree(DraftTree(torch.tensor([1]), torch.tensor([-1]), q, sampling="beam"), torch.stack([p, p]), 1.0, g)


def test_target_distribution_matches_transformers_warpers():
    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 3
    for t, k, p in [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.9, 10, 0.6), (1.0, 1, 1.0)]:
        x = TemperatureLogitsWarper(t)(None, logits.clone())
        if k:
            x = TopKLogitsWarper(k)(None, x)
        if p < 1:
            x = TopPLogitsWarper(p)(None, x)
        torch.testing.assert_close(target_distribution(logits, t, k, p), torch.softmax(x, -1))
    with pytest.raises(ValueError):
        target_distribution(logits, 0.0)


def test_top_p_boundary_keeps_what_transformers_keeps():
    """[.5, .25, .125, .125] at top_p 0.75: the first two tokens already reach 0.75, so transformers keeps 2
    (a "mass strictly above" rule keeps 3); plain, speculative and regeneration sampling all use this one."""
    from data.regenerate import RowSampler

    logits = torch.tensor([[0.5, 0.25, 0.125, 0.125]]).log()
    want = torch.isfinite(TopPLogitsWarper(0.75)(None, logits.clone()))
    got = target_distribution(logits, 1.0, top_p=0.75) > 0
    assert got.tolist() == want.tolist() == [[True, True, False, False]]
    torch.testing.assert_close(target_distribution(logits, 1.0, top_p=0.75), torch.tensor([[2 / 3, 1 / 3, 0, 0]]))
    picks = {int(RowSampler([s], 1.0, 0.75, torch.device("cpu"))([0], logits)[0]) for s in range(40)}
    assert picks == {0, 1}
    # min-p (transformers' MinPLogitsWarper): keep tokens with p >= min_p * max p
    assert (target_distribution(logits, 1.0, min_p=0.3) > 0).tolist() == [[True, True, False, False]]
    assert target_distribution(logits[0], 1.0).shape == (4,)  # any leading shape, as before


def test_sampling_draws_on_the_generators_device():
    """A generator on one device draws for tensors on another (uniform on the generator's own device)."""
    from data.sampling import sample_token

    p = torch.tensor([0.0, 0.0, 1.0])
    assert sample_token(p, torch.Generator().manual_seed(0)) == 2
    if torch.cuda.is_available():
        assert sample_token(p.cuda(), torch.Generator().manual_seed(0)) == 2
        assert sample_token(p, torch.Generator("cuda").manual_seed(0)) == 2
        tree = DraftTree.chain(torch.tensor([2], device="cuda"), p[None].cuda())
        assert verify_tree(tree, torch.stack([p, p]).cuda(), 1.0, torch.Generator().manual_seed(0)) == ([0], 2)


def test_bad_inputs_raise(target, prompt, reference):
    class BadParents(_Tracker):
        def draft(self, k, temperature):
            self.tree = DraftTree(torch.tensor([1, 2]), torch.tensor([1, -1]))
            return self.tree

    with pytest.raises(ValueError, match="parent"):
        speculative_generate(target, prompt, BadParents(reference), 2, 5)
    with pytest.raises(ValueError, match="batch 1"):
        speculative_generate(target, prompt.repeat(2, 1), NgramDrafter(), 2, 5)
    with pytest.raises(ValueError, match="k must be"):
        speculative_generate(target, prompt, NgramDrafter(), -1, 5)


# ----------------------------------------------------------------------------------------------- trees
def test_tree_layout_and_static_tree():
    anc, depths = tree_layout([-1, 0, -1])
    assert depths.tolist() == [1, 2, 1]
    assert anc.int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]]
    assert is_chain(torch.tensor([-1, 0, 1])) and not is_chain(torch.tensor([-1, -1]))
    assert tree_depth(torch.tensor([-1, -1, 1, 2])) == 3
    st = StaticTree([[1], [0], [0, 0], [1, 0]])  # order is normalised: [0], [1], [0, 0], [1, 0]
    assert st.parents.tolist() == [-1, -1, 0, 1] and st.depth == 2 and st.topk == 2
    cands = torch.tensor([[10, 11], [20, 21]])
    tree = st.build(cands, torch.eye(30)[:2])
    assert tree.tokens.tolist() == [10, 11, 20, 20] and tree.sampling == "topk"
    assert tree.probs.shape == (4, 30) and tree.probs[2, 1] == 1
    assert len(StaticTree(DEFAULT_CHOICES).truncate(2)) == 7
    for bad in ([], [[0, 1]], [[0], [0]], [[-1]]):
        with pytest.raises(ValueError, match="StaticTree"):
            StaticTree(bad)
    with pytest.raises(ValueError, match="candidates"):
        st.build(torch.tensor([[1, 2]]))


# ----------------------------------------------------------------------------------------------- costs
def test_cost_model_formulas():
    flat = VerifyCost({1: 1.0, 64: 1.0}, context_len=0)
    a = 0.6
    for k in (1, 3, 8):
        assert expected_tokens([a] * k, k) == pytest.approx((1 - a ** (k + 1)) / (1 - a))
    # docs/science.md: c = 0.2, alpha = 0.5, k = 8 is a loss (0.77x).
    assert predicted_speedup([0.5] * 8, 8, flat, DraftCost(0.0, 0.2)) == pytest.approx(0.768, abs=1e-3)
    k, s = choose_k([0.5] * 16, flat, DraftCost(0.0, 0.2), 16)
    assert 1 <= k <= 3 and s > 1
    assert choose_k([0.5] * 8, flat, DraftCost(0.0, 2.0), 8) == (0, 1.0)
    steep = VerifyCost({1: 1.0, 2: 2.0, 4: 4.0}, context_len=0)  # verify cost linear in tokens: never worth it
    assert choose_k([0.9] * 8, steep, DraftCost(0.0, 0.0), 8)[0] == 0
    assert steep(3) == 3.0 and steep(8) == 8.0 and flat(10) == 1.0
    assert DraftCost.fit([(1, 2.0), (3, 4.0)]) == DraftCost(1.0, 1.0)
    # An n-gram drafter that drafts in half the passes earns half the extra tokens.
    assert expected_tokens([1.0, 1.0], 2, draft_rate=0.5) == 2.0


def test_measured_costs_on_tiny_model(target, prompt, reference):
    vc = measure_verify_cost(target, context_len=32, ks=(1, 4), repeats=2)
    assert set(vc.seconds) == {1, 4} and all(v > 0 for v in vc.seconds.values())
    cal = calibrate(target, NgramDrafter(), [prompt], k=4, max_new_tokens=24)
    assert len(cal.acceptance) <= 4 and 0 < cal.draft_rate <= 1 and cal.draft_cost.fixed_s >= 0
    # the rates it prices are shrunk_rates of its counts, 0 past the deepest depth judged (a drafter right 30% of
    # the time per token: its raw rates differ from the shrunk ones)
    adv = calibrate(target, AdversarialDrafter(reference, seed=1), [prompt], k=4, max_new_tokens=MAX_NEW)
    rates = shrunk_rates(adv.stats.accepted_per_position, adv.stats.judged_per_position)
    assert adv.acceptance == rates + [0.0] * (len(adv.stats.judged_per_position) - len(rates))
    assert adv.acceptance != pytest.approx(adv.stats.acceptance_rates)
    _, st = speculative_generate(target, prompt, OracleDrafter(reference, right=True), 3, MAX_NEW)
    # Free drafting and a flat verify: the ideal speedup is tau itself.
    assert ideal_speedup(st, VerifyCost({1: 1.0}, 0), DraftCost(0.0, 0.0)) == pytest.approx(st.tau)


def test_verify_probe_interleaves_its_repeats(target, monkeypatch):
    """A slow spell of three consecutive passes (10x) lands on one repeat of three sizes, which their medians
    drop; timed back to back it would be three of T(1)'s five repeats, and T(1) would read 10x."""
    import eval.costs as costs

    calls = []

    def machine(kv, ids, sync=lambda: None):
        calls.append(ids.shape[1])
        return 0.01 * ids.shape[1] * (10.0 if 3 <= len(calls) - 1 <= 5 else 1.0)

    monkeypatch.setattr(costs, "timed_pass", machine)
    vc = measure_verify_cost(target, context_len=8, ks=(1, 2, 4), repeats=5)
    assert calls == [1, 2, 4] * 6  # a warm-up round, then five rounds of every size
    assert vc.seconds == pytest.approx({1: 0.01, 2: 0.02, 4: 0.04})


def test_stats_merge_and_dict(target, prompt, reference):
    _, a = speculative_generate(target, prompt, NgramDrafter(), 3, MAX_NEW)
    _, b = speculative_generate(target, prompt, StaticTreeDrafter(reference), 3, MAX_NEW)
    m = a.merge(b)
    assert m.new_tokens == a.new_tokens + b.new_tokens and m.generations == 2
    assert m.target_passes == len(m.nodes_per_pass) == a.target_passes + b.target_passes
    assert m.accepted_per_position[0] == a.accepted_per_position[0] + b.accepted_per_position[0]
    d = m.to_dict()
    assert d["tau"] == pytest.approx(m.tau) and "nodes_per_pass" not in d


@pytest.fixture(scope="module")
def sharp_model():
    """A second in-process config (2 layers, hidden 32, vocab 97) with a large init, so attention (and with it
    every cache slot) really changes the prediction: the fixture model is almost a bigram model."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, initializer_range=0.5)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("seed", [0, 1])
def test_context_sensitive_model_trees_and_chains(sharp_model, seed, cache):
    ids = torch.randint(97, (1, 12), generator=torch.Generator().manual_seed(seed))
    ref = sharp_model.generate(ids, do_sample=False, max_new_tokens=30, pad_token_id=0)[0, 12:]
    for drafter in (RandomTreeDrafter(ref, seed, vocab=97), StaticTreeDrafter(ref, seed, vocab=97),
                    ModelDrafter(layer_prefix_model(sharp_model, 1), cache=cache), NgramDrafter()):
        out, _ = speculative_generate(sharp_model, ids, drafter, 3, 30, cache=cache)
        assert out.tolist() == ref.tolist()
