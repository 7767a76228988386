"""Speculative sampling is exact for every drafter, through the real decoder loop, at temperatures 0.7 and 1.3
with top-k and top-p 0.9 applied to the target.

Target: an in-process 4-layer Llama with a 12-token vocabulary, initialised flat enough that the processed
sequence law of the first L new tokens spreads over many outcomes (exactly enumerable with `exact_law`).
Drafters (each made close to the target, so drafts are often accepted AND often rejected, which is what
gives a test power): EAGLE-3 chain and dynamic tree, Medusa (static top-k tree), MTP, a separate draft model
(a perturbed copy of the target), self-speculative (the target's first layers), n-gram (on a prompt with
repeats), the DFlash block drafter (trained briefly on the toy target, then sharpened), its DSpark variant
(every slot drafts, a strong Markov bias: later slots' q depend on the token drawn before) and the quickstart's
block drafter's options on it (hydra: the anchor feature and a strong head.prev_mlp), and the EAGLE-3
chain and DSpark heads again drafting in bfloat16 on the float32 target (eval.draft_dtype), an EAGLE-3 head with
a pointer over the request's positions (head.pointer: q over its draft vocab and the request's other tokens), and the DFlash and
DSpark heads drafting top-k trees over their blocks (eval.tree static; the DSpark tree's candidates depend on
their parent's token), and the DSpark head drafting EAGLE-2's dynamic tree over its block (eval.tree dynamic). Each (drafter, temperature) draws N sequences with fixed seeds and compares their counts with the
exact law by Pearson's chi-square (`drafters_common.chi_square`, cells with expected count < 5 pooled); the
test fails when p < ALPHA = 0.01, so its false-alarm rate is <= 0.01.

Power at false-alarm rate 0.01, against the two classic biased rejection rules (resample the replacement
from plain p; leave a rejected deterministic sibling's mass in the residual, which only exists for drafts
without an i.i.d. q), computed by `power_table()` (`python tests/test_sampling_drafters.py`, a few minutes):
each biased sampler is run at these seeds and N, its chi-square statistic gives the plug-in noncentrality
lambda = stat - df, and the power P(noncentral chi-square(df, lambda) > critical value) is simulated
(`drafters_common.chi_square_power`). Measured (N = 400 per row):

    drafter       T    df  stat | resample-from-p: stat, power | unzeroed sibling: stat, power
    eagle_chain   0.7  23  18.0 | 207.9  1.000                 | n/a
    eagle_chain   1.3  26  19.6 | 164.3  1.000                 | n/a
    eagle_tree    0.7  23  39.1 | 146.7  1.000                 | 146.7  1.000
    eagle_tree    1.3  26  32.5 | 147.6  1.000                 | 147.6  1.000
    eagle_pointer 0.7  23  20.9 |  87.8  0.999                 | n/a
    eagle_pointer 1.3  26   8.7 |  65.8  0.929                 | n/a
    medusa        0.7  23  26.7 | 119.5  1.000                 | 119.5  1.000
    medusa        1.3  26  23.2 | 115.1  1.000                 | 115.1  1.000
    mtp           0.7  23  25.9 | 180.2  1.000                 | n/a
    mtp           1.3  26  20.6 | 167.8  1.000                 | n/a
    draft_model   0.7  23  30.8 | 256.8  1.000                 | n/a
    draft_model   1.3  26  22.0 | 225.6  1.000                 | n/a
    self_spec     0.7  23  13.9 | 126.9  1.000                 | n/a
    self_spec     1.3  26  20.4 |  81.7  0.993                 | n/a
    ngram         0.7  23  28.4 |  92.7  1.000                 | 92.7  1.000
    ngram         1.3  26  32.2 |  97.8  1.000                 | 97.8  1.000
    dflash        0.7  23  28.1 | 132.3  1.000                 | n/a
    dflash        1.3  26  31.8 |  96.3  0.999                 | n/a
    dspark        0.7  23  24.1 | 129.0  1.000                 | n/a
    dspark        1.3  26  22.5 | 114.7  1.000                 | n/a
    hydra         0.7  23  30.0 | 166.6  1.000                 | n/a
    hydra         1.3  26  23.1 | 166.1  1.000                 | n/a
    eagle_chain_bf16 0.7 23 25.4 | 246.2  1.000                 | n/a
    eagle_chain_bf16 1.3 26 23.2 | 154.4  1.000                 | n/a
    dspark_bf16   0.7  23  26.1 | 128.2  1.000                 | n/a
    dspark_bf16   1.3  26  25.7 | 109.4  1.000                 | n/a
    dflash_tree   0.7  23  28.3 | 124.0  1.000                 | 124.0  1.000
    dflash_tree   1.3  26  22.3 | 122.4  1.000                 | 122.4  1.000
    dspark_tree   0.7  23  28.4 | 148.7  1.000                 | 148.7  1.000
    dspark_tree   1.3  26  28.0 | 178.2  1.000                 | 178.2  1.000
    dspark_dynamic 0.7 23  29.9 | 146.3  1.000                 | 146.3  1.000
    dspark_dynamic 1.3 26  28.8 | 168.0  1.000                 | 168.0  1.000

(With only deterministic drafts the two biased rules coincide.) A drafter reporting a q that is not the law
it sampled from (softmax(l) for a draw from softmax(l / T)) and verify rows built without top-p are planted by
scripts/check_mutants.py and fail here as well.

    .venv/bin/python -m pytest -q tests/test_sampling_drafters.py
"""

from __future__ import annotations

import copy

import pytest
import torch
from drafters_common import chi_square, chi_square_power, chi_square_pvalue, exact_and_empirical
from transformers import LlamaConfig, LlamaForCausalLM

import eval.decoder as decoder
from data.features import forward_features, greedy_ids
from data.target import target_io
from eval.costs import place_head
from eval.drafters import ModelDrafter, NgramDrafter, self_speculative_drafter
from heads import dflash, eagle, medusa, mtp

V, L, K, N = 12, 3, 2, 400
Q_DRAWS, SUPPORT_DRAWS = 500, 100
TOP_K, TOP_P = 3, 0.9
ALPHA = 0.01
# Drafts sharper than the target (logits scaled): the draft is usually the target's likely token but q != p, so
# passes both accept and reject often, and a wrong rejection rule shows (see the power table).
SHARP = 4.0
PROMPT = [1, 5, 3, 9, 1, 5, 3, 9, 1]
DRAFTERS = ["eagle_chain", "eagle_tree", "eagle_pointer", "medusa", "mtp", "draft_model", "self_spec", "ngram", "dflash", "dspark", "hydra",
            "eagle_chain_bf16", "dspark_bf16", "dflash_tree", "dspark_tree", "dspark_dynamic"]
BLOCK_TREE = [[0], [1], [0, 0], [1, 0], [0, 0, 0]]  # the block drafters' top-k trees (eval.tree static)
TEMPERATURES = [0.7, 1.3]


def _noisy(module: torch.nn.Module, std: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * std)


@pytest.fixture(scope="module")
def toy():
    return build_toy()


def build_toy():
    """(target, TargetIO, {name: make_drafter(seed)})."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=2, num_key_value_heads=1, initializer_range=0.15, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    with torch.no_grad():
        model.lm_head.weight.mul_(1.5)  # spread, but not so flat that a drafter sharing it can't be told apart
    io = target_io(model, "toy")
    h = cfg.hidden_size
    with torch.no_grad():
        # EAGLE-3 reading the input of layer 3 (fc picks that third of the aux features), a weak draft
        # layer, and the target's final norm and lm_head: q is close to the target's p, but not equal.
        e3 = eagle.build(eagle.Eagle3Config(layer_ids=[1, 2, 3], draft_vocab_size=V, ttt_length=2), io).eval()
        e3.fc.weight.zero_()
        e3.fc.weight[:, 2 * h:] = torch.eye(h)
        _noisy(e3.fc, 0.05, 1)
        e3.midlayer.self_attn.o_proj.weight.mul_(5.0)
        e3.norm.weight.copy_(model.model.norm.weight)
        e3.lm_head.weight.copy_(SHARP * model.lm_head.weight)
        # The same with head.pointer: ids 0-7 in its draft vocab, the request's tokens among 8-11 reached by the
        # pointer (the prompt holds 9; a sampled 8, 10 or 11 joins it), so q spans both sets and moves along the answer.
        e3p = eagle.build(eagle.Eagle3Config(layer_ids=[1, 2, 3], draft_vocab_size=8, ttt_length=2, pointer=True),
                          io).eval()
        e3p.load_state_dict({k: v for k, v in e3.state_dict().items() if not k.startswith(("lm_head", "d2t", "t2d"))},
                            strict=False)
        e3p.lm_head.weight.copy_(SHARP * model.lm_head.weight[:8])
        e3p.ptr_gate.bias.zero_()  # half the mass on the pointer (g = 0.5 where ptr_gate's weights give 0)
        # Medusa at init (identity blocks, the target's lm_head) with noise: q ~ p at the previous position.
        med = medusa.build(medusa.MedusaConfig(num_heads=2, tree=[[0], [1], [2], [0, 0], [1, 0]]), io).eval()
        _noisy(med, 0.05, 2)
        for lm in med.lm_heads:
            lm.weight.mul_(SHARP)
        # MTP from the target's last layer, eh_proj reading mostly the hidden state.
        mt = mtp.build(mtp.MTPConfig(num_modules=2), io).eval()
        for m in mt.mtp:
            m.eh_proj.weight.zero_()
            m.eh_proj.weight[:, h:] = torch.eye(h)
        _noisy(mt, 0.05, 3)
        for m in mt.mtp:
            m.norm.weight.mul_(SHARP)
        draft_model = copy.deepcopy(model)
        _noisy(draft_model, 0.05, 4)
        draft_model.lm_head.weight.mul_(SHARP)

    dfl = _trained_dflash(model, io)
    dsp = _trained_dflash(model, io, sample_from_anchor=True, markov_rank=4)
    # the quickstart block drafter's options: a compact Markov table, the anchor feature, Hydra's refinement
    hyd = _trained_dflash(model, io, sample_from_anchor=True, markov_rank=4, markov_rows="draft", anchor_feature=True,
                          prev_mlp=8)
    # The same heads drafting in bfloat16 on the float32 target (eval.draft_dtype): q is computed from
    # bfloat16 logits, and must still be the law each token was drawn from.
    e3_bf16, dsp_bf16 = copy.deepcopy(e3), copy.deepcopy(dsp)
    for h in (e3_bf16, dsp_bf16):
        place_head(h, torch.device("cpu"), torch.float32, "bfloat16")

    def gen(seed: int) -> torch.Generator:
        return torch.Generator().manual_seed(seed)

    makers = {
        "eagle_chain": lambda i: eagle.drafter(e3, io, generator=gen(10_000 + i)),
        "eagle_tree": lambda i: eagle.drafter(e3, io, tree="dynamic", top_k=3, total_tokens=6),
        "eagle_pointer": lambda i: eagle.drafter(e3p, io, generator=gen(10_000 + i)),
        "medusa": lambda i: medusa.drafter(med, io),
        "mtp": lambda i: mtp.drafter(mt, io, generator=gen(10_000 + i)),
        "draft_model": lambda i: ModelDrafter(draft_model, generator=gen(10_000 + i)),
        "self_spec": lambda i: self_speculative_drafter(model, 2, generator=gen(10_000 + i)),
        "ngram": lambda i: NgramDrafter(),
        "dflash": lambda i: dflash.drafter(dfl, io, generator=gen(10_000 + i)),
        "dspark": lambda i: dflash.drafter(dsp, io, generator=gen(10_000 + i)),
        "hydra": lambda i: dflash.drafter(hyd, io, generator=gen(10_000 + i)),
        "eagle_chain_bf16": lambda i: eagle.drafter(e3_bf16, io, generator=gen(10_000 + i)),
        "dspark_bf16": lambda i: dflash.drafter(dsp_bf16, io, generator=gen(10_000 + i)),
        "dflash_tree": lambda i: dflash.drafter(dfl, io, tree=BLOCK_TREE),
        "dspark_tree": lambda i: dflash.drafter(dsp, io, tree=BLOCK_TREE),
        "dspark_dynamic": lambda i: dflash.drafter(dsp, io, tree="dynamic", top_k=2, total_tokens=4),
    }
    return model, io, makers


def _trained_dflash(model, io, **kw):
    """A DFlash head (layers 1-3 captured, one layer, blocks of 4, the target's lm_head) trained briefly on the
    toy target's own distributions: a block drafter can only approximate p(x_{n+i} | prefix) by learning it,
    and a q near p (not equal) is what makes passes both accept and reject with overlapping q and p; its
    logits are then sharpened by SHARP like the other drafters' (a rejected q-heavy token leaves a residual
    far from p, which is what shows a wrong rejection rule). With DSpark's options (kw), its Markov bias (and
    with head.prev_mlp, the refinement's output) is then made strong (each later slot's q depends on the token
    drawn before it)."""
    torch.manual_seed(5)
    head = dflash.build(dflash.DFlashConfig(layer_ids=[1, 2, 3], draft_vocab_size=V, block_size=4, anchors=8, **kw),
                        io)
    with torch.no_grad():
        head.lm_head.weight.copy_(model.lm_head.weight)
    ids = torch.randint(0, V, (16, 16))
    feats, _ = forward_features(model, ids, None, [1, 2, 3])
    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids), "last": feats.last, "aux": feats.aux,
             "target_argmax": greedy_ids(model, feats.last).long()}
    opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(100):
        loss, _ = dflash.loss(head, batch, io)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():  # then sharper than the target, as the other drafters here (see SHARP)
        head.lm_head.weight.mul_(SHARP)
        g = torch.Generator().manual_seed(6)
        if head.markov_head is not None:  # bias sd ~0.5 a logit: q moves with the previous draw
            for w in (head.markov_head.markov_w1.weight, head.markov_head.markov_w2.weight):
                w.copy_(0.5 * torch.randn(w.shape, generator=g))
        if head.prev_mlp is not None:  # the state, too, moves with the previous draw
            head.prev_mlp.down.weight.copy_(0.5 * torch.randn(head.prev_mlp.down.weight.shape, generator=g))
    return head.eval()


def sample(toy, name: str, temperature: float, samples: int = N,
           cache: str = "dynamic") -> tuple[float, int, dict, dict]:
    """(chi-square statistic, df, exact law, counts) of `samples` speculative sequences."""
    model, _, makers = toy
    exact, counts = exact_and_empirical(model, PROMPT, makers[name], k=K, n_new=L, top_k=TOP_K, samples=samples,
                                        temperature=temperature, top_p=TOP_P, max_new_tokens=L + 1, cache=cache)
    stat, df = chi_square(exact, counts, samples)
    return stat, df, exact, counts


@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("name", DRAFTERS)
def test_speculative_sampling_is_exact(toy, name, temperature):
    stat, df, exact, counts = sample(toy, name, temperature)
    assert df >= 12  # the law really is spread: many cells with an expected count >= 5
    pv = chi_square_pvalue(exact, counts, N)
    assert pv > ALPHA, f"{name} at T={temperature}: chi-square {stat:.1f} on {df} df, p = {pv:.2e}"


# The static (preallocated) target cache: a tree drafter (gathered rollback) and a chain drafter.
@pytest.mark.parametrize("name", ["eagle_tree", "draft_model"])
def test_speculative_sampling_is_exact_on_the_static_cache(toy, name):
    stat, df, exact, counts = sample(toy, name, 0.7, cache="static")
    pv = chi_square_pvalue(exact, counts, N)
    assert pv > ALPHA, f"{name} (static cache): chi-square {stat:.1f} on {df} df, p = {pv:.2e}"


@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("name", ["eagle_chain", "eagle_pointer", "mtp", "draft_model", "self_spec", "dflash", "dspark",
                                  "hydra", "eagle_chain_bf16", "dspark_bf16"])
def test_drafted_tokens_follow_the_reported_q(toy, name, temperature):
    """A chain drafter's first token is drawn from exactly the q it hands the verifier (min(1, p/q) needs it).

    From one fixed state (begin), Q_DRAWS first tokens are drawn and compared with the reported q by
    chi-square at level ALPHA. Reporting softmax(l) for a draw from softmax(l / T) fails it at both
    temperatures for all four drafters (scripts/check_mutants.py); through the whole loop the same bias is
    diluted by the target's own randomness and would need thousands of sequences.
    """
    model, _, makers = toy
    prompt = torch.tensor([PROMPT])
    d = makers[name](0)
    feats = None
    if d.capture_layers is not None:
        feats, _ = forward_features(model, prompt, None, d.capture_layers)
    counts: dict[int, int] = {}
    q = None
    for _ in range(Q_DRAWS):
        d.begin(prompt, feats, 1)
        tree = d.draft(1, temperature)
        q = tree.probs[0] if q is None else q
        torch.testing.assert_close(tree.probs[0], q)  # the same state reports the same q every time
        tok = int(tree.tokens[0])
        counts[tok] = counts.get(tok, 0) + 1
    law = {t: float(q[t]) for t in range(V) if q[t] > 0}
    pv = chi_square_pvalue(law, counts, Q_DRAWS)
    assert pv > ALPHA, f"{name} at T={temperature}: drafted tokens do not follow the reported q (p = {pv:.2e})"


@pytest.mark.parametrize("name", ["ngram", "eagle_chain"])
def test_verified_tokens_stay_inside_top_p(toy, name):
    """Top-p alone (no top-k) at T 1.3 leaves the lowest ~10% of mass out: no speculative sequence may contain
    a token plain sampling can never produce (the verify rows are processed like plain sampling's)."""
    model, _, makers = toy
    exact, counts = exact_and_empirical(model, PROMPT, makers[name], k=K, n_new=L, top_k=0, samples=SUPPORT_DRAWS,
                                        temperature=1.3, top_p=TOP_P, max_new_tokens=L + 1)
    assert len(exact) < V**L  # top-p really removed outcomes
    outside = [c for c in counts if c not in exact]
    assert not outside, f"{name}: sequences outside the top-p support: {outside}"


def _resample_from_p(p, q, token):
    """Biased: after a rejection, sample the replacement from the unchanged target p."""
    return p


def _unzeroed_sibling(p, q, token):
    """Biased (deterministic drafts: top-k tree siblings, n-gram): the rejected token keeps its mass."""
    return p / p.sum() if q is None else _RESIDUAL(p, q, token)


_RESIDUAL = decoder.residual_distribution
BIASED = {"resample_from_p": _resample_from_p, "unzeroed_sibling": _unzeroed_sibling}
DETERMINISTIC = {"eagle_tree", "medusa", "ngram", "dflash_tree", "dspark_tree", "dspark_dynamic"}  # drafts without i.i.d. q: the sibling rule applies


def power_table() -> None:
    """Print each test's statistic and the power of the same test against each biased sampler (minutes)."""
    toy = build_toy()
    print(f"{'drafter':12s} {'T':>4s} {'df':>3s} {'stat':>6s} " + " ".join(f"{b:>24s}" for b in BIASED))
    for name in DRAFTERS:
        for t in TEMPERATURES:
            stat, df, _, _ = sample(toy, name, t)
            cols = []
            for b, fn in BIASED.items():
                if b == "unzeroed_sibling" and name not in DETERMINISTIC:
                    cols.append(f"{'n/a':>24s}")
                    continue
                decoder.residual_distribution = fn
                try:
                    bstat, _, _, _ = sample(toy, name, t)
                finally:
                    decoder.residual_distribution = _RESIDUAL
                cols.append(f"{bstat:8.1f} power {chi_square_power(bstat, df, ALPHA):.3f}")
            print(f"{name:12s} {t:4.1f} {df:3d} {stat:6.1f} " + " ".join(cols), flush=True)


if __name__ == "__main__":
    power_table()
