"""DFlash block drafter: alignment worked examples, shapes, the loss against a direct computation (an
independent re-implementation of the engines' forward equations, `reference_block_logits`), one-batch
overfitting, training blocks equal to drafting blocks, greedy decoding identical to the target's (alone,
adaptive, hybrid with n-gram), and the export to vLLM's speculators DFlash layout (spec-checked, round trip to
identical tensors and decoding, the reference forward on the exported tensors matching our drafter).

DSpark's options (`sample_from_anchor`, `markov_rank`; VARIANTS) go through the same tests, plus the Markov
chain's reported q against each slot's law given the tokens drawn before it, the DSpark export and layout choice.

Planted bugs each fail here (scripts/check_mutants.py, `dflash_*`): a causal mask inside the block
(`block_attention`'s own-block scores), a block seeing the context at its own anchor (`<` -> `<=` in
`context_mask`), labels shifted by one, the anchor's slot never drafting under sample_from_anchor, the Markov
bias reading the predicted token instead of the one before it, the drafter's chain biased by a stale token,
a block drafted together seeing another request's padded context, held commits projected at another request's
positions, an export writing the target's LM head rows in place of the trained ones, head.train_lm_head ignored.

    .venv/bin/python -m pytest -q tests/test_dflash.py
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from data.features import forward_features, greedy_ids
from heads import dflash
from heads.base import load_head, save_head

LAYERS = [1, 2, 3]


def _head(io, seed: int = 0, lively: bool = True, **kw):
    torch.manual_seed(seed)
    cfg = dflash.DFlashConfig(layer_ids=LAYERS, draft_vocab_size=kw.pop("draft_vocab_size", 200), block_size=4,
                              num_layers=2, anchors=3, **kw)
    head = dflash.build(cfg, io)
    ids = torch.arange(0, 2 * head.d2t.numel(), 2) % io.vocab_size  # a non-trivial draft vocab
    ids = ids.unique()[: head.d2t.numel()]
    with torch.no_grad():
        head.d2t.copy_(ids - torch.arange(ids.numel()))
        head.t2d.zero_()
        head.t2d[ids] = True
        head.lm_head.weight.copy_(io.lm_head.weight[ids])
        # Weights well away from init (and a sharp final norm), so that a wrong mask or label moves the
        # logits and the loss by far more than the tests' tolerances.
        for p in head.parameters() if lively else ():
            if p.requires_grad:
                p.add_(0.1 * torch.randn_like(p))
        head.norm.weight.mul_(20.0 if lively else 1.0)
    return cfg, head


def _batch(model, ids, loss_mask=None):
    feats, _ = forward_features(model, ids, None, LAYERS)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "loss_mask": torch.ones_like(ids) if loss_mask is None else loss_mask,
            "last": feats.last, "aux": feats.aux, "target_argmax": greedy_ids(model, feats.last).long()}


# ----------------------------------------------------------------------------------------------- reference
def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):
    d = x.shape[-1]
    ang = pos.double()[:, None] / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    cos, sin = torch.cat([ang.cos()] * 2, -1).float(), torch.cat([ang.sin()] * 2, -1).float()
    return x * cos[:, None] + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * sin[:, None]


def reference_block_logits(sd: dict, layer: dict, aux: torch.Tensor, embed: torch.Tensor, anchor: int,
                           mask_id: int, block: int, prev: list[int] | None = None,
                           rows: list[int] | None = None, plain: int | None = None) -> torch.Tensor:
    """The engines' DFlash forward written out from the equations (no project code): logits [block, DV] of
    the block [anchor, mask x (block-1)] at positions n..n+block-1 over the context aux [n, k*H]; with prev
    (a target id per slot: the token before the one it drafts), plus DSpark's Markov bias markov_w2 @
    markov_w1[row] of each slot (row: rows[i], a compact table's, else prev[i]); with an anchor_proj
    (head.anchor_feature), every slot's input anchor_proj @ [its embedding, c[n-1]], c[n-1] the context's last
    feature; with a prev_mlp (head.prev_mlp, Hydra's refinement), each final state h_i first
    h_i + down @ silu(up @ [rms(h_i), rms(embed[prev[i]])]); slot `plain` (head.plain_first_slot's first drafting
    slot) gets neither the refinement nor the bias."""
    eps, nh, nkv = layer["rms_norm_eps"], layer["num_attention_heads"], layer["num_key_value_heads"]
    d, theta = layer["head_dim"], layer["rope_theta"]
    n = aux.shape[0]
    c = _rms(aux @ sd["fc.weight"].T, sd["hidden_norm.weight"], eps)
    h = embed[torch.tensor([anchor] + [mask_id] * (block - 1))]
    if "anchor_proj.weight" in sd:
        h = torch.cat([h, c[-1].expand(block, -1)], -1) @ sd["anchor_proj.weight"].T
    pc, pb = torch.arange(n), torch.arange(n, n + block)
    for i in range(layer["num_hidden_layers"]):
        w = {k.split(f"layers.{i}.", 1)[1]: v for k, v in sd.items() if k.startswith(f"layers.{i}.")}
        x = _rms(h, w["input_layernorm.weight"], eps)
        q = _rope(_rms((x @ w["self_attn.q_proj.weight"].T).view(block, nh, d), w["self_attn.q_norm.weight"], eps), pb, theta)

        def kv(src, pos, w=w):
            k = _rms((src @ w["self_attn.k_proj.weight"].T).view(len(pos), nkv, d), w["self_attn.k_norm.weight"], eps)
            return _rope(k, pos, theta), (src @ w["self_attn.v_proj.weight"].T).view(len(pos), nkv, d)

        (kc, vc), (kb, vb) = kv(c, pc), kv(x, pb)
        k = torch.cat([kc, kb]).repeat_interleave(nh // nkv, 1)
        v = torch.cat([vc, vb]).repeat_interleave(nh // nkv, 1)
        att = torch.einsum("qhd,khd->hqk", q, k).div(math.sqrt(d)).softmax(-1)
        h = h + torch.einsum("hqk,khd->qhd", att, v).reshape(block, nh * d) @ w["self_attn.o_proj.weight"].T
        x2 = _rms(h, w["post_attention_layernorm.weight"], eps)
        h = h + (F.silu(x2 @ w["mlp.gate_proj.weight"].T) * (x2 @ w["mlp.up_proj.weight"].T)) @ w["mlp.down_proj.weight"].T
    if "prev_mlp.up.weight" in sd:
        x = torch.cat([_rms(h, sd["prev_mlp.norm.weight"], eps),
                       _rms(embed[torch.tensor(prev)], sd["prev_mlp.emb_norm.weight"], eps)], -1)
        refined = h + F.silu(x @ sd["prev_mlp.up.weight"].T) @ sd["prev_mlp.down.weight"].T
        h = torch.stack([h[i] if i == plain else refined[i] for i in range(block)])
    out = _rms(h, sd["norm.weight"], eps) @ sd["lm_head.weight"].T
    if "markov_head.markov_w1.weight" in sd:
        row = torch.tensor(prev if rows is None else rows)
        bias = sd["markov_head.markov_w1.weight"][row] @ sd["markov_head.markov_w2.weight"].T
        out = out + bias * (torch.arange(block) != (-1 if plain is None else plain))[:, None]
    return out


# The layouts under test: DFlash's fill-in block; DSpark's (the anchor's slot drafts too); with its Markov
# head; that with a compact Markov table and the anchor's context feature in the slot inputs
# (head.markov_rows draft, head.anchor_feature: no engine layout); and the anchor feature with Hydra's
# refinement by the previous token (head.prev_mlp: no engine layout) in place of the Markov head; and the shipped
# recipe's options together, its first drafting slot without either (head.plain_first_slot). dspark_lm, hydra and
# shipped train the draft-vocab LM head (head.train_lm_head), so `_head` moves it off the target's rows too.
VARIANTS = {"dflash": {}, "from_anchor": {"sample_from_anchor": True},
            "dspark": {"sample_from_anchor": True, "markov_rank": 8},
            "dspark_lm": {"sample_from_anchor": True, "markov_rank": 8, "train_lm_head": True},
            "anchor": {"sample_from_anchor": True, "markov_rank": 8, "markov_rows": "draft", "anchor_feature": True},
            "hydra": {"sample_from_anchor": True, "anchor_feature": True, "prev_mlp": 16, "train_lm_head": True},
            "shipped": {"sample_from_anchor": True, "markov_rank": 8, "markov_rows": "draft", "anchor_feature": True,
                        "prev_mlp": 16, "train_lm_head": True, "plain_first_slot": True}}


def _layer(io, head) -> dict:
    tc = io.config
    nh = int(tc.num_attention_heads)
    return {"rms_norm_eps": float(tc.rms_norm_eps), "num_attention_heads": nh,
            "num_key_value_heads": int(tc.num_key_value_heads), "head_dim": int(tc.hidden_size) // nh,
            "rope_theta": float(getattr(tc, "rope_theta", None) or tc.rope_parameters["rope_theta"]),
            "num_hidden_layers": len(head.layers)}


# ----------------------------------------------------------------------------------------------- alignment
def test_worked_examples():
    assert [round(w, 4) for w in dflash.loss_weights(dflash.DFlashConfig(block_size=4))] == [0.0, 1.0, 0.7788, 0.6065]
    assert [round(w, 4) for w in dflash.loss_weights(dflash.DFlashConfig(block_size=4, sample_from_anchor=True))] \
        == [1.0, 0.7788, 0.6065, 0.4724]
    slots, labels = dflash.block_alignment(torch.tensor([[5]]), 4)
    assert slots.tolist() == [[[5, 6, 7, 8]]] and labels[..., 1:].tolist() == [[[5, 6, 7]]]
    slots, labels = dflash.block_alignment(torch.tensor([[5]]), 4, first=0)
    assert slots.tolist() == [[[5, 6, 7, 8]]] and labels.tolist() == [[[5, 6, 7, 8]]]
    anchors, valid = dflash.sample_anchors(torch.tensor([[0, 0, 1, 1, 0], [0, 1, 1, 1, 1]]), 3,
                                           torch.Generator().manual_seed(0))
    assert anchors.tolist() == [[1, 2, 1], [1, 2, 3]] and valid.tolist() == [[True, True, False], [True] * 3]
    anchors, valid = dflash.sample_anchors(torch.tensor([[0, 0, 1, 1, 0]]), 512)  # more than there are: all
    assert anchors.tolist() == [[1, 2]] and valid.all()
    m = dflash.context_mask(torch.tensor([[2, 4]]), 2, 5)[0, 0]
    assert m.int().tolist() == [[1, 1, 0, 0, 0]] * 2 + [[1, 1, 1, 1, 0]] * 2  # context < anchor


def test_block_attention_equals_sdpa_over_the_dense_block_mask():
    """The split attention (context scores + each block's own square) against SDPA over [context, all
    blocks] with the dense mask "context < anchor, or the same block (both ways)", grouped KV heads."""
    torch.manual_seed(0)
    b, heads, kv, d, t, bs = 2, 6, 2, 8, 9, 3
    anchors = torch.tensor([[1, 4, 7], [2, 3, 8]])
    n_q = anchors.shape[1] * bs
    q = torch.randn(b, heads, n_q, d)
    ctx = (torch.randn(b, kv, t, d), torch.randn(b, kv, t, d))
    kb, vb = torch.randn(b, kv, n_q, d), torch.randn(b, kv, n_q, d)
    cmask = dflash.context_mask(anchors, bs, t)
    got = dflash.block_attention(q, ctx, kb, vb, cmask, bs)
    blk = torch.arange(n_q) // bs
    dense = torch.cat([cmask, (blk[:, None] == blk[None, :]).expand(b, 1, -1, -1)], dim=-1)
    want = F.scaled_dot_product_attention(q, torch.cat([ctx[0], kb], 2), torch.cat([ctx[1], vb], 2),
                                          attn_mask=dense, enable_gqa=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_shapes_and_drafts(tiny_target, variant):
    model, _, io = tiny_target
    _, head = _head(io, **VARIANTS[variant])
    n = 4 - head.first_slot  # drafted tokens per block
    batch = _batch(model, torch.randint(0, io.vocab_size, (2, 12)))
    logits = dflash.block_logits(head, batch, io, torch.tensor([[1, 4, 7], [2, 3, 9]]))
    assert logits.shape == (2, 3, 4, head.d2t.numel())
    loss, metrics = dflash.loss(head, batch, io)
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert set(metrics) == {f"{m}/{j}" for m in ("top1", "n", "chain") for j in range(n)} | {"n/chain"}
    d = dflash.drafter(head, io)
    prompt = batch["input_ids"][:1, :8]
    d.begin(prompt, forward_features(model, prompt, None, LAYERS)[0], 5)
    assert len(d.draft(2, 0.0)) == 2 and len(d.draft(9, 0.0)) == n  # at most the drafting slots
    assert d.max_depth == n  # which the policy prices no deeper than (heads.types.Drafter)
    tree = d.draft(n, 1.0)
    assert tree.probs.shape == (n, io.vocab_size) and bool(head.t2d[tree.tokens].all())


@pytest.mark.parametrize("variant", VARIANTS)
def test_loss_matches_a_direct_computation(tiny_target, variant):
    """block_loss against the blocks computed one anchor at a time by the reference forward, with soft labels
    from the target's own logits (model(ids)), not from the stored `last` features: slot k (k >= f, the first
    drafting slot) predicts x_{a+k+1-f} from the target's distribution at a+k-f, biased (Markov head) by the
    sequence's token there, weight exp(-(k-f)/gamma)."""
    model, _, io = tiny_target
    cfg, head = _head(io, **VARIANTS[variant])
    f = head.first_slot
    ids = torch.randint(0, io.vocab_size, (2, 12))
    lmask = torch.ones_like(ids)
    lmask[:, :3] = 0
    lmask[1, 10:] = 0
    batch = _batch(model, ids, lmask)
    anchors, valid = torch.tensor([[2, 5, 9], [1, 6, 8]]), torch.tensor([[True, True, True], [True, True, False]])
    got, _ = dflash.block_loss(head, batch, io, anchors, valid, dflash.loss_weights(cfg))
    sd = {k: v.detach() for k, v in head.state_dict().items()}
    draft_ids = head.draft_ids()
    with torch.no_grad():
        tl = model(ids).logits.float()
    num, den = 0.0, 0.0
    for b in range(2):
        for a, ok in zip(anchors[b].tolist(), valid[b].tolist()):
            prev = [int(ids[b, min(a + k - f, 11)]) for k in range(4)] if head.sequential else None
            # the table's rows (a compact table's map: its own test)
            rows = head.markov_row(torch.tensor(prev)).tolist() if head.markov_head is not None else None
            ref = reference_block_logits(sd, _layer(io, head), batch["aux"][b, :a], io.embed.weight.detach(),
                                         int(ids[b, a]), head.mask_token_id, 4, prev, rows,
                                         f if head.plain_first_slot else None)
            for k in range(f, 4):
                at = a + k + 1 - f  # the predicted position
                if not ok or at >= 12 or not lmask[b, at] or not head.t2d[tl[b, at - 1].argmax()]:
                    continue
                p = tl[b, at - 1, draft_ids].softmax(-1)
                num += math.exp(-(k - f) / cfg.decay_gamma) * float(-(p * ref[k].log_softmax(-1)).sum())
                den += 1
    assert den >= 8
    assert abs(float(got.detach()) - num / den) < 1e-4 * max(1.0, num / den)


@pytest.mark.parametrize("variant", VARIANTS)
def test_training_blocks_equal_drafting_blocks(tiny_target, variant):
    """A block trained at anchor a is exactly what the drafter proposes after the prefix x_{<a} (with a Markov
    head: given the sequence's own tokens as the chain drafted before each slot); and the drafter's greedy
    chain, drawn left to right, is the argmax of those logits wherever it follows the sequence."""
    model, _, io = tiny_target
    _, head = _head(io, **VARIANTS[variant])
    f = head.first_slot
    ids = torch.randint(0, io.vocab_size, (1, 14))
    batch = _batch(model, ids)
    anchors = torch.tensor([[3, 6, 9]])
    train = dflash.block_logits(head, batch, io, anchors)
    for j, a in enumerate(anchors[0].tolist()):
        d = dflash.drafter(head, io)
        d.begin(ids[:, :a], forward_features(model, ids[:, :a], None, LAYERS)[0], int(ids[0, a]))
        prev = ids[0, a : a + 4 - f] if head.sequential else None
        # float32 rounding: training's attention is block_attention, drafting's SDPA (logits up to about 60 here)
        torch.testing.assert_close(d.block_logits(prev), train[0, j, f:], rtol=1e-4, atol=1e-4)
        chain = d.draft(4, 0.0).tokens  # each slot fed the token drawn before it (the anchor for the first)
        fed = torch.cat([ids[0, a : a + 1], chain[:-1]]) if head.sequential else None
        assert head.to_target_ids(d.block_logits(fed).argmax(-1)).tolist() == chain.tolist()
        assert int(chain[0]) == int(head.to_target_ids(train[0, j, f].argmax()))


@pytest.mark.parametrize("variant", ["dspark", "hydra", "shipped"])
def test_a_sequential_chain_reports_each_slots_law_given_the_tokens_drawn_before_it(tiny_target, variant):
    """With a Markov head (or head.prev_mlp) the drafter draws left to right: slot i's q (what the verifier's
    min(1, p/q) needs) is softmax(logits_i(token drawn at i-1) / T), the anchor before the first. Reporting the
    q of another token, or conditioning on a stale one, breaks exactness; here it fails a direct comparison."""
    model, _, io = tiny_target
    # the target's LM head rows: a lively trained one makes the first slot so sharp that every seed draws alike
    _, head = _head(io, **{**VARIANTS[variant], "train_lm_head": False})
    ids = torch.randint(0, io.vocab_size, (1, 9))
    d = dflash.drafter(head, io)
    d.begin(ids[:, :8], forward_features(model, ids[:, :8], None, LAYERS)[0], int(ids[0, 8]))
    firsts = set()
    for seed in range(16):
        d.generator = torch.Generator().manual_seed(seed)
        tree = d.draft(4, 0.8)
        fed = torch.cat([ids[0, 8:9], tree.tokens[:-1]])
        want = head.to_target_probs(torch.softmax(d.block_logits(fed) / 0.8, -1), io.vocab_size)
        torch.testing.assert_close(tree.probs, want)
        firsts.add(int(tree.tokens[0]))
    assert len(firsts) > 1  # the draws differ, so later slots were biased by different tokens


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("variant", ["dflash", "dspark", "anchor", "hydra", "shipped"])
def test_drafting_together_equals_each_requests_own_draft(tiny_target, variant, temperature):
    """DFlashDrafter.draft_together (the batched decoder's rows, one block pass for all): requests with
    contexts of different lengths and different draft lengths get the chain their own draft makes, sampled ones
    from their own generator with the same q (with a Markov head, each slot biased by its own chain's token);
    a request of another head drafts with its own head; a chain made together is for the length it was made
    for. A block seeing another request's padded context keys fails it (mutant together_sees_padded_keys)."""
    model, _, io = tiny_target
    _, head = _head(io, seed=2, **VARIANTS[variant])
    torch.manual_seed(1)
    ids = torch.randint(0, io.vocab_size, (1, 16))
    feats, _ = forward_features(model, ids, None, LAYERS)

    def begun(n: int, seed: int, h=head):
        d = dflash.drafter(h, io, generator=torch.Generator().manual_seed(seed))
        d.begin(ids[:, :n], feats.slice(0, n), int(ids[0, n]))
        return d

    lengths, ks = [5, 11, 8, 3], [3, 1, 4, 0]
    alone = [begun(n, 10 + i) for i, n in enumerate(lengths)]
    together = [begun(n, 10 + i) for i, n in enumerate(lengths)]
    dflash.DFlashDrafter.draft_together(together, ks, temperature)
    assert together[3].ready is None  # drafts nothing: left alone
    for a, t, k in zip(alone, together, ks):
        want, got = a.draft(k, temperature), t.draft(k, temperature)
        m = min(k, head.block_size - head.first_slot)
        assert got.tokens.tolist() == want.tokens.tolist() and len(got) == m
        assert (got.probs is None) == (want.probs is None)
        if want.probs is not None:
            torch.testing.assert_close(got.probs, want.probs, rtol=1e-4, atol=1e-6)
        assert t.n == a.n and t.ready is None
    # requests of two heads in one call: each drafted with its own head
    _, other = _head(io, seed=3, **VARIANTS[variant])
    mixed, solo = [begun(5, 1), begun(9, 2, other)], begun(9, 2, other)
    dflash.DFlashDrafter.draft_together([*mixed, begun(7, 3)], [3, 3, 3], temperature)
    assert mixed[1].ready is None  # the only request of its head: left to its own draft
    assert mixed[1].draft(3, temperature).tokens.tolist() == solo.draft(3, temperature).tokens.tolist()
    dflash.DFlashDrafter.draft_together(together, [2, 2, 2, 2], temperature)
    assert len(together[0].draft(1, temperature)) == 1 and together[0].ready is None


TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [2, 0], [0, 0, 0], [1, 0, 0]]


def _tree_case(tiny_target, variant: str):
    """The trees' tests' head (seed 4, a Markov bias made about as large as the base logits: sd 0.03 logits
    against their 3) and begun(n, **drafter_kw): a drafter of it begun on the first n of 16 random tokens."""
    model, _, io = tiny_target
    _, head = _head(io, seed=4, **VARIANTS[variant])
    if head.markov_head is not None:
        with torch.no_grad():
            head.markov_head.markov_w2.weight.mul_(100.0)
    torch.manual_seed(1)
    ids = torch.randint(0, io.vocab_size, (1, 16))
    feats, _ = forward_features(model, ids, None, LAYERS)

    def begun(n: int, **kw):
        d = dflash.drafter(head, io, **kw)
        d.begin(ids[:, :n], feats.slice(0, n), int(ids[0, n]))
        return d

    return io, head, begun


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("variant", ["dflash", "dspark", "shipped"])
def test_a_tree_ranks_each_parents_slot_logits(tiny_target, variant, temperature):
    """A tree (eval.tree static) over one block: node (r1..rd) is the rd-th ranked candidate of slot d's logits
    given its parent's token (the anchor at depth 1), computed here directly from the block's states; its q is
    that distribution. Siblings are distinct; a sequential head's children of different parents differ, a plain
    head's do not (it reads no previous token). Truncating to k keeps the paths of depth <= k; drafting together
    gives each request its own tree. Planted: every depth's parent taken as the anchor, or slot d's logits read
    at slot d + 1, fail it."""
    io, head, begin = _tree_case(tiny_target, variant)

    def begun(n: int):
        return begin(n, tree=TREE)

    d = begun(12)
    tree = d.draft(3, temperature)
    assert tree.sampling == "topk" and len(tree) == len(TREE) == d.nodes(3)
    h = d.block_states()
    paths = sorted(map(tuple, TREE), key=lambda p: (len(p), p))
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    for i, p in enumerate(paths):
        prev = d.anchor if parents[i] < 0 else tokens[parents[i]]
        slot = head.first_slot + len(p) - 1
        logits = head.slot_logits(h[len(p) - 1][None, None], torch.tensor([[prev]]), io, [slot])[0, 0].float()
        assert tokens[i] == int(head.to_target_ids(logits.topk(p[-1] + 1).indices[p[-1]])), (variant, p)
        if temperature > 0:
            want = head.to_target_probs(torch.softmax(logits / temperature, -1), io.vocab_size)
            torch.testing.assert_close(tree.probs[i], want)
        else:
            assert tree.probs is None
    by_parent: dict[int, list[int]] = {}
    for i, par in enumerate(parents):
        by_parent.setdefault(par, []).append(tokens[i])
    assert all(len(set(kids)) == len(kids) for kids in by_parent.values())
    firsts = [tokens[i] for i, p in enumerate(paths) if len(p) == 2 and p[-1] == 0]  # rank 0 under each parent
    assert (len(set(firsts)) > 1) == head.sequential, firsts
    short = begun(12).draft(2, temperature)
    assert short.tokens.tolist() == [t for t, p in zip(tokens, paths) if len(p) <= 2] and d.nodes(2) == len(short)
    alone, together = [begun(n) for n in (5, 11, 8)], [begun(n) for n in (5, 11, 8)]
    dflash.DFlashDrafter.draft_together(together, [3, 2, 3], temperature)
    for a, t, k in zip(alone, together, [3, 2, 3]):
        assert t.draft(k, temperature).tokens.tolist() == a.draft(k, temperature).tokens.tolist()


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("variant", ["dflash", "dspark", "shipped"])
def test_a_dynamic_tree_is_eagle2s_over_the_slots(tiny_target, variant, temperature):
    """eval.tree dynamic over one block, against a direct computation from the block's states: at depth 1 the
    top_k candidates of the first slot given the anchor; at each depth after, the top_k nodes of the depth
    before by path log-prob, each with the top_k candidates of the next slot given its own token; the
    total_tokens best paths of all of them are the tree, each node's q its parent's distribution. nodes(k)
    counts what draft(k) returns; drafting together gives each request its own tree. Planted: every depth's
    parent taken as the anchor, or the children's logits read at their parent's slot, fail it (a head that is
    not sequential reads no parent, so only the second fails it there)."""
    io, head, begin = _tree_case(tiny_target, variant)
    top_k, total = 2, 6

    def begun(n: int):
        return begin(n, tree="dynamic", top_k=top_k, total_tokens=total)

    d = begun(12)
    tree = d.draft(3, temperature)
    h = d.block_states()

    @torch.no_grad()
    def slot(path: tuple[int, ...]) -> torch.Tensor:  # the logits of the slot after `path` (target ids)
        prev = path[-1] if path else d.anchor
        s = head.first_slot + len(path)
        return head.slot_logits(h[len(path)][None, None], torch.tensor([[prev]]), io, [s])[0, 0].float()

    level, paths = [((), 0.0)], {}
    for depth in range(1, 4):
        grown = level if depth == 1 else sorted(level, key=lambda n: -n[1])[:top_k]
        level = []
        for path, score in grown:
            logp = slot(path).log_softmax(-1)
            for j in logp.topk(top_k).indices.tolist():
                level.append((path + (int(head.to_target_ids(torch.tensor(j))),), score + float(logp[j])))
        paths.update(level)
    want = sorted(paths, key=lambda p: -paths[p])[:total]
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    got = []
    for i in range(len(tokens)):
        got.append((got[parents[i]] if parents[i] >= 0 else ()) + (tokens[i],))
    assert tree.sampling == "topk" and sorted(got) == sorted(want) and len(got) == d.nodes(3) == total, variant
    for i, path in enumerate(got):
        if temperature > 0:
            q = head.to_target_probs(torch.softmax(slot(path[:-1]) / temperature, -1), io.vocab_size)
            torch.testing.assert_close(tree.probs[i], q)
        else:
            assert tree.probs is None
    for k in (1, 2):
        assert len(begun(12).draft(k, temperature)) == d.nodes(k) == min(total, top_k + top_k**2 * (k - 1))
    alone, together = [begun(n) for n in (5, 11, 8)], [begun(n) for n in (5, 11, 8)]
    dflash.DFlashDrafter.draft_together(together, [3, 2, 3], temperature)
    for a, t, k in zip(alone, together, [3, 2, 3]):
        assert t.draft(k, temperature).tokens.tolist() == a.draft(k, temperature).tokens.tolist()


def test_the_static_tree_is_the_default_shape_cut_to_the_drafting_slots(tiny_target):
    from heads.base import HeadError
    from heads.tree import DEFAULT_CHOICES

    _, _, io = tiny_target
    _, head = _head(io, seed=0)  # block 4: three drafting slots
    d = dflash.drafter_factory(head, io, tree="static")()
    assert d.tree.paths == sorted((tuple(p) for p in DEFAULT_CHOICES if len(p) <= 3), key=lambda p: (len(p), p))
    assert dflash.drafter_factory(head, io, tree="chain")().chains
    assert dflash.drafter_factory(head, io, tree="dynamic", topk=3, tokens=5)().sizes == (3, 5)
    with pytest.raises(HeadError, match="medusa"):
        dflash.drafter_factory(head, io, tree="medusa")
    with pytest.raises(ValueError, match="3 drafting slots"):
        dflash.drafter(head, io, tree=[[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]])
    with pytest.raises(ValueError, match="'wide' is not chain, dynamic or a list of choices"):
        dflash.drafter(head, io, tree="wide")
    with pytest.raises(ValueError, match="must be >= 1"):
        dflash.drafter(head, io, tree="dynamic", top_k=0)


@pytest.mark.parametrize("variant", ["dflash", "anchor"])
def test_settling_together_equals_each_requests_own_commits(tiny_target, variant):
    """DFlashDrafter.settle_together (the batched decoder's held commits): requests with contexts of different
    lengths, each holding two commits of different lengths, end with the context keys their own commits make,
    in one projection for the batch (and, with head.anchor_feature, the newest position's feature, which
    their drafts read); a held commit is projected by the request's own next draft. Keys at other positions
    than a request's own (mutant dflash_settle_at_the_first_requests_positions) fail it."""
    model, _, io = tiny_target
    _, head = _head(io, seed=2, **VARIANTS[variant])
    torch.manual_seed(1)
    ids = torch.randint(0, io.vocab_size, (1, 24))
    feats, _ = forward_features(model, ids, None, LAYERS)

    def begun(n: int, hold: bool):
        d = dflash.drafter(head, io)
        d.hold = hold
        d.begin(ids[:, :n], feats.slice(0, n), int(ids[0, n]))
        return d

    starts, paths = [5, 11, 8, 3], [(3, 2), (1, 4), (4, 1), (2, 3)]
    alone, together = [begun(n, False) for n in starts], [begun(n, True) for n in starts]
    for drafters in (alone, together):
        for d, n, (m1, m2) in zip(drafters, starts, paths):  # two paths: features at n .. n+m1+m2-1
            d.commit_tokens(ids[0, n + 1:n + m1].tolist(), feats.slice(n, n + m1), int(ids[0, n + m1]))
            o = n + m1
            d.commit_tokens(ids[0, o + 1:o + m2].tolist(), feats.slice(o, o + m2), int(ids[0, o + m2]))
    assert all(len(t.held) == 2 and t.n == n for t, n in zip(together, starts))
    calls = []
    real = type(head).context_kv
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(head), "context_kv", lambda self, c, *a: calls.append(c.shape[1]) or real(self, c, *a))
        dflash.DFlashDrafter.settle_together(together)
    assert calls == [sum(m1 + m2 for m1, m2 in paths)]  # every request's held positions in one projection
    for a, t in zip(alone, together):
        assert not t.held and t.n == a.n and t.anchor == a.anchor
        if head.anchor_proj is not None:
            torch.testing.assert_close(t.last, a.last, rtol=1e-4, atol=1e-5)
        for (ka, va), (kt, vt) in zip(a.ctx, t.ctx):
            torch.testing.assert_close(kt, ka, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(vt, va, rtol=1e-4, atol=1e-5)
        assert t.draft(3, 0.0).tokens.tolist() == a.draft(3, 0.0).tokens.tolist()
    d, ref = begun(6, True), begun(6, False)
    for x in (d, ref):
        x.commit_tokens([int(ids[0, 7])], feats.slice(6, 8), int(ids[0, 8]))
    assert d.n == 6 and len(d.held) == 1
    assert d.draft(3, 0.0).tokens.tolist() == ref.draft(3, 0.0).tokens.tolist() and d.n == ref.n == 8


@pytest.mark.parametrize("variant", ["dflash", "dspark_lm"])
def test_one_batch_overfit(tiny_target, variant):
    """Fixed anchors (every eligible position), Adam: the loss falls toward its floor and the draft's argmax
    learns the target's at every slot. The random target's LM head is sharpened (x 30, same argmax) so that
    its soft labels are far from uniform and the cross-entropy has room to fall. The draft's LM head trains
    only with head.train_lm_head (the dspark_lm variant)."""
    import copy
    import dataclasses

    model, _, io = tiny_target
    lm = copy.deepcopy(io.lm_head)
    with torch.no_grad():
        lm.weight.mul_(30.0)
    io = dataclasses.replace(io, lm_head=lm)
    cfg, head = _head(io, lively=False, draft_vocab_size=io.vocab_size, **VARIANTS[variant])
    batch = _batch(model, torch.randint(0, io.vocab_size, (2, 16)))
    anchors, valid = torch.arange(1, 15).expand(2, 14), torch.ones(2, 14, dtype=torch.bool)
    weights = dflash.loss_weights(cfg)
    opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(150):
        loss, metrics = dflash.block_loss(head, batch, io, anchors, valid, weights)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.3 * losses[0], losses[::10]
    assert min(metrics[f"top1/{k}"] for k in range(4 - head.first_slot)) > 0.75, metrics  # chance: 1/259
    # the chain of hits (heads.losses.chain_metrics) starts at the first slot's share and shrinks slot by slot
    chain = [metrics[f"chain/{k}"] for k in range(4 - head.first_slot)]
    assert chain[0] == metrics["top1/0"] and metrics["n/chain"] == metrics["n/0"]
    assert chain == sorted(chain, reverse=True) and chain[-1] > 0.3, metrics  # the last blocks run off the end
    lm_rows = io.lm_head.weight[head.draft_ids()]  # the (sharpened) target rows `_head` copied
    if cfg.train_lm_head:
        assert head.lm_head.weight.grad is not None and not torch.allclose(head.lm_head.weight, lm_rows)
    else:  # the target's rows stay as copied
        assert head.lm_head.weight.grad is None and torch.allclose(head.lm_head.weight, lm_rows)


@pytest.mark.parametrize("mode,variant", [("alone", "dflash"), ("adaptive", "dflash"), ("hybrid", "dflash"),
                                          ("alone", "dspark"), ("hybrid", "dspark"), ("hybrid", "anchor"),
                                          ("tree", "dflash"), ("tree", "shipped"), ("tree_hybrid", "dspark"),
                                          ("dynamic", "shipped"), ("dynamic_hybrid", "dspark")])
def test_greedy_speculative_output_equals_plain_decoding(tiny_target, mode, variant):
    from drafters_common import hf_greedy

    from eval.costs import DraftCost, VerifyCost
    from eval.decoder import speculative_generate
    from eval.drafters import HybridDrafter
    from eval.policy import AdaptivePolicy

    model, _, io = tiny_target
    _, head = _head(io, seed=1, **VARIANTS[variant])
    prompt = torch.randint(0, io.vocab_size, (1, 10))
    ref, eos = hf_greedy(model, prompt, 24)
    d = (dflash.drafter(head, io, tree="dynamic", top_k=3, total_tokens=4) if mode.startswith("dynamic")
         else dflash.drafter(head, io, tree=TREE if mode.startswith("tree") else None))
    policy = None
    if mode.endswith("hybrid"):
        d = HybridDrafter(d)
    if mode not in ("alone", "tree"):
        verify = VerifyCost({n: 1e-3 * (1 + 0.1 * n) for n in range(1, 20)}, 16)
        names = ("head", "ngram") if mode.endswith("hybrid") else ("draft",)
        policy = AdaptivePolicy(verify, {s: DraftCost(1e-4, 0.0) for s in names}, {s: [0.6, 0.5, 0.4] for s in names})
    out, stats = speculative_generate(model, prompt, d, k=3, max_new_tokens=24, eos_token_id=eos, policy=policy)
    assert out.tolist() == ref.tolist()
    assert stats.tau >= 1.0


def test_prepare_takes_the_draft_vocab_lm_head_rows_and_final_norm_from_the_target(tiny_target):
    import dataclasses

    import datasets

    model, _, io = tiny_target
    ds = datasets.Dataset.from_dict({"input_ids": [[5, 7, 7, 9, 9, 9]], "loss_mask": [[0, 1, 1, 1, 1, 1]]})
    cfg = dflash.DFlashConfig(layer_ids=LAYERS, draft_vocab_size=2)
    init = dflash.prepare(cfg, ds, io)
    assert (torch.arange(2) + init["d2t"]).tolist() == [7, 9] and init["t2d"].nonzero().reshape(-1).tolist() == [7, 9]
    assert torch.equal(init["lm_head.weight"], io.lm_head.weight.detach()[[7, 9]])
    torch.testing.assert_close(init["norm.weight"], model.model.norm.weight.detach())
    head = dflash.build(cfg, io)
    head.load_state_dict(init, strict=False)
    assert not head.lm_head.weight.requires_grad and head.norm.weight.requires_grad
    assert dflash.build(dataclasses.replace(cfg, train_lm_head=True), io).lm_head.weight.requires_grad


def test_head_folder_round_trip(tiny_target, tmp_path):
    model, _, io = tiny_target
    cfg, head = _head(io)
    save_head(tmp_path / "h", head, cfg, io)
    back, cfg2, meta = load_head(tmp_path / "h", io)
    assert cfg2 == cfg and meta["layer_ids"] == LAYERS
    for k, v in head.state_dict().items():
        assert torch.equal(v, back.state_dict()[k]), k


# ----------------------------------------------------------------------------------------------- export
# Each engine layout and the head it is for: DFlash's, and DSpark's (sample_from_anchor with a Markov head).
# the DSpark head's LM head trained (lively, away from the target's rows), so the export must carry its own rows
LAYOUTS = {"speculators_dflash": "dflash", "speculators_dspark": "dspark_lm"}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def exported(request, tiny_target, tmp_path_factory):
    """(native head, its folder, the export folder in the layout `request.param`)."""
    from convert import export_head

    _, _, io = tiny_target
    cfg, head = _head(io, seed=3, **VARIANTS[LAYOUTS[request.param]])
    root = tmp_path_factory.mktemp(request.param)
    native = save_head(root / "native", head, cfg, io)
    return head.eval(), native, export_head(native, request.param, root / "vllm", io)


def test_each_layout_refuses_the_other_kind_of_head(tiny_target, tmp_path):
    """A head goes to the one layout that serves it (what publishing stages: `layouts_of` with its config);
    the other refuses it in one line."""
    import dataclasses

    from convert import export_head, layouts_of
    from convert.spec import ExportError

    _, _, io = tiny_target
    for variant, fmt, msg, own in (("dspark", "speculators_dflash", "speculators_dspark", ("speculators_dspark",)),
                                   ("from_anchor", "speculators_dflash", "no engine layout", ()),
                                   ("anchor", "speculators_dspark", "anchor_feature", ()),
                                   ("anchor", "speculators_dflash", "anchor_feature", ()),
                                   ("prev_mlp", "speculators_dspark", "prev_mlp", ()),
                                   ("prev_mlp", "speculators_dflash", "prev_mlp", ()),
                                   ("plain_first", "speculators_dspark", "plain_first_slot", ()),
                                   ("dflash", "speculators_dspark", "Markov head", ("speculators_dflash",))):
        kw = {"prev_mlp": {"sample_from_anchor": True, "markov_rank": 8, "prev_mlp": 16},
              "plain_first": {"sample_from_anchor": True, "markov_rank": 8, "plain_first_slot": True}}.get(
                  variant, VARIANTS.get(variant))
        cfg, head = _head(io, **kw)
        assert layouts_of("dflash", dataclasses.asdict(cfg)) == own
        native = save_head(tmp_path / variant, head, cfg, io)
        with pytest.raises(ExportError, match=msg):
            export_head(native, fmt, tmp_path / f"{variant}-{fmt}", io)


def test_the_model_card_serves_each_head_with_its_own_method(tiny_target):
    """The card's vLLM command names the method of the layout the upload's root holds: dspark for a head with
    a Markov head (staged as speculators_dspark), dflash for a plain one."""
    import dataclasses

    from convert import serving_note

    _, _, io = tiny_target
    for variant, method, other in (("dspark", "dspark", "dflash"), ("dflash", "dflash", "dspark")):
        cfg, _ = _head(io, **VARIANTS[variant])
        card = serving_note("dflash", "me/head", "org/target", 3, dataclasses.asdict(cfg))
        assert f'"method": "{method}"' in card and f'"method": "{other}"' not in card, variant


def test_export_has_the_vllm_names_and_keys(tiny_target, exported):
    import json

    from safetensors.torch import load_file

    _, _, io = tiny_target
    head, _, out = exported
    config = json.loads((out / "config.json").read_text())
    dspark = head.markov_head is not None
    assert config["speculators_model_type"] == ("dspark" if dspark else "dflash")
    assert config["aux_hidden_state_layer_ids"] == LAYERS
    assert config["block_size"] == 4 and config["mask_token_id"] == head.mask_token_id
    # every drafting slot: block_size - 1 after DFlash's anchor, block_size when the anchor drafts too
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == (4 if dspark else 3)
    assert config["sample_from_anchor"] is dspark
    if dspark:  # vLLM update_dspark: no causal override, Qwen3DSparkModel's Markov head of this rank
        assert config["markov_rank"] == 8 and config["markov_head_type"] == "vanilla"
        assert "sliding_window_non_causal" not in config
    else:
        assert config["sliding_window_non_causal"] is True  # vLLM: dflash_config.causal = not this, every layer
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "qwen3" and layer["num_hidden_layers"] == 2 and layer["use_sliding_window"] is False
    weights = load_file(str(out / "model.safetensors"))
    assert sorted(weights) == sorted(head.state_dict())
    assert {"fc.weight", "hidden_norm.weight", "layers.1.self_attn.k_norm.weight", "d2t", "t2d"} <= set(weights)
    assert weights["fc.weight"].shape == (64, 3 * 64)
    if dspark:
        assert weights["markov_head.markov_w1.weight"].shape == (io.vocab_size, 8)
        assert weights["markov_head.markov_w2.weight"].shape == (head.d2t.numel(), 8)


def test_spec_refuses_a_missing_d2t_and_a_wrong_fc(tiny_target, exported):
    import json

    from safetensors.torch import load_file

    from convert.spec import ExportError, validate

    _, _, io = tiny_target
    _, _, out = exported
    config = json.loads((out / "config.json").read_text())
    weights = load_file(str(out / "model.safetensors"))
    fmt = f"speculators_{config['speculators_model_type']}"
    with pytest.raises(ExportError, match="d2t"):
        validate(fmt, config, {k: v for k, v in weights.items() if k != "d2t"}, io)
    with pytest.raises(ExportError, match="fc.weight"):
        validate(fmt, {**config, "aux_hidden_state_layer_ids": [1, 2]}, weights, io)


def test_a_compact_markov_table_exports_as_each_ids_own_row(tiny_target, tmp_path):
    """head.markov_rows draft: a draft-vocab id has its own row (its draft id), every other id the shared
    last one; the DSpark export writes the full table with each target id's row, so the imported head (a full
    table) drafts exactly what the compact one does. An export of the compact table as is, or an off-by-one
    map, fails it."""
    import json

    from convert import export_head, import_folder

    model, _, io = tiny_target
    cfg, head = _head(io, sample_from_anchor=True, markov_rank=8, markov_rows="draft")
    dv = head.d2t.numel()
    assert head.markov_head.markov_w1.weight.shape == (dv + 1, 8)
    ids = torch.arange(io.vocab_size)
    rows = head.markov_row(ids)
    assert torch.equal(head.to_target_ids(rows[head.t2d]), ids[head.t2d])  # its own draft id
    assert bool((rows[~head.t2d] == dv).all())
    out = export_head(save_head(tmp_path / "native", head, cfg, io), "speculators_dspark", tmp_path / "vllm", io)
    back, back_cfg, _ = import_folder(out, "speculators_dspark", io)
    assert back_cfg.markov_rows == "target" and back.markov_head.markov_w1.weight.shape == (io.vocab_size, 8)
    assert json.loads((out / "config.json").read_text())["markov_rank"] == 8
    seq = torch.randint(0, io.vocab_size, (1, 12))
    feats = forward_features(model, seq[:, :10], None, LAYERS)[0]
    prev = torch.cat([seq[0, 10:11], ids[~head.t2d][:1], ids[head.t2d][5:7]])  # in and out of the draft vocab
    logits = []
    for h in (head, back):
        d = dflash.drafter(h, io)
        d.begin(seq[:, :10], feats, int(seq[0, 10]))
        logits.append(d.block_logits(prev))
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)


def test_export_import_round_trip_is_identical(tiny_target, exported):
    import json

    from drafters_common import hf_greedy

    from convert import import_folder
    from eval.decoder import speculative_generate

    model, _, io = tiny_target
    head, native, out = exported
    back, cfg, _ = import_folder(out, f"speculators_{json.loads((out / 'config.json').read_text())['speculators_model_type']}", io)
    want = load_head(native, io)[1]
    for key in ("block_size", "num_layers", "layer_ids", "intermediate_size", "sample_from_anchor", "markov_rank"):
        assert getattr(cfg, key) == getattr(want, key), key
    for k, v in head.state_dict().items():
        assert torch.equal(v, back.state_dict()[k]), k
    prompt = torch.randint(0, io.vocab_size, (1, 9))
    ref, eos = hf_greedy(model, prompt, 16)
    runs = [speculative_generate(model, prompt, dflash.drafter(h, io), k=3, max_new_tokens=16, eos_token_id=eos)
            for h in (head, back)]
    assert runs[0][0].tolist() == runs[1][0].tolist() == ref.tolist()
    assert runs[0][1].accepted_per_position == runs[1][1].accepted_per_position  # the same drafts accepted


def test_reference_forward_on_the_exported_tensors_matches_the_drafter(tiny_target, exported):
    """The engines' equations (reference_block_logits) on the EXPORTED config and tensors give our drafter's
    logits, mapped to target ids through the exported d2t; for DSpark, its speculator's greedy chain (slot by
    slot, each biased by the Markov head of the target id drawn before it, the anchor first)."""
    import json

    from safetensors.torch import load_file

    model, _, io = tiny_target
    head, _, out = exported
    config = json.loads((out / "config.json").read_text())
    sd = load_file(str(out / "model.safetensors"))
    ids = torch.randint(0, io.vocab_size, (1, 11))
    aux = forward_features(model, ids[:, :10], None, config["aux_hidden_state_layer_ids"])[0].aux
    first = 0 if config["sample_from_anchor"] else 1
    slots = config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    dspark = config["speculators_model_type"] == "dspark"
    anchor = int(ids[0, 10])
    draft_to_target = torch.arange(sd["d2t"].numel()) + sd["d2t"]
    rows, prev = [], [anchor]
    for i in range(slots):  # vLLM's DSpark speculator draws left to right (DFlash's slots need no order)
        rows.append(reference_block_logits(sd, config["transformer_layer_config"], aux[0], io.embed.weight.detach(),
                                           anchor, config["mask_token_id"], config["block_size"],
                                           [prev[-1]] * config["block_size"] if dspark else None)[first + i])
        prev.append(int(draft_to_target[rows[-1].argmax()]))
    d = dflash.drafter(head, io)
    d.begin(ids[:, :10], forward_features(model, ids[:, :10], None, LAYERS)[0], anchor)
    torch.testing.assert_close(d.block_logits(torch.tensor(prev[:-1]) if dspark else None), torch.stack(rows),
                               rtol=1e-4, atol=1e-4)
    assert d.draft(slots, 0.0).tokens.tolist() == prev[1:]
