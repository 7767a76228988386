"""EAGLE token losses (head.loss): forward_kl, tv, kl_tv pinned against direct computations, masks, gradients,
and the config's refusals.

    .venv/bin/python -m pytest -q tests/test_losses.py
"""

from __future__ import annotations

import pytest
import torch
from test_eagle import _batch

from data.config import ConfigError, load_config
from heads import eagle
from heads.losses import hard_token_loss, token_loss

# Two positions over a 3-token draft vocab: p is the target's (renormalised) distribution, logits the head's.
P = torch.tensor([[[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]]])
LOGITS = torch.tensor([[[1.0, 0.0, -1.0], [0.5, 0.5, 0.0]]])
MASK = torch.tensor([[1.0, 1.0]])


def _q(logits: torch.Tensor) -> torch.Tensor:
    e = logits.exp()
    return e / e.sum(-1, keepdim=True)


def _direct_tv(p: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """1 - sum_v min(p_v, q_v) per position: the acceptance-rate form, independent of 0.5 * sum |p - q|."""
    return 1 - torch.minimum(p, _q(logits)).sum(-1)


def _direct_ce(p: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    return -(p * _q(logits).log()).sum(-1)


@pytest.mark.parametrize("kind", ["forward_kl", "tv", "kl_tv"])
def test_each_loss_equals_the_direct_computation(kind):
    w = 0.3
    want = {"forward_kl": _direct_ce(P, LOGITS), "tv": _direct_tv(P, LOGITS),
            "kl_tv": 0.7 * _direct_ce(P, LOGITS) + 0.3 * _direct_tv(P, LOGITS)}[kind].sum() / 4
    got = eagle.token_loss(LOGITS, P, MASK, 4, kind, w)
    assert float(got) == pytest.approx(float(want), rel=1e-6)


def test_tv_hand_values():
    # position 0: q = softmax(1, 0, -1) = (0.665, 0.245, 0.090); sum min(p, q) = 0.665 + 0.2 + 0.090
    q0 = _q(LOGITS[0, 0])
    assert float(1 - (q0[0] + 0.2 + q0[2])) == pytest.approx(float(_direct_tv(P, LOGITS)[0, 0]))
    # identical distributions: TV 0; disjoint ones: TV 1
    same = eagle.token_loss(P.log(), P, MASK, 1, "tv")
    assert float(same) == pytest.approx(0.0, abs=1e-6)
    disjoint = eagle.token_loss(torch.tensor([[[30.0, -30.0]]]), torch.tensor([[[0.0, 1.0]]]), torch.ones(1, 1), 1, "tv")
    assert float(disjoint) == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("kind", ["forward_kl", "tv", "kl_tv"])
def test_masked_positions_are_ignored(kind):
    mask = torch.tensor([[1.0, 0.0]])
    garbage = LOGITS.clone()
    garbage[0, 1] = torch.tensor([50.0, -50.0, 9.0])  # any value at the masked position
    a = eagle.token_loss(LOGITS, P, mask, 2, kind)
    b = eagle.token_loss(garbage, P, mask, 2, kind)
    assert float(a) == float(b)
    only0 = eagle.token_loss(LOGITS[:, :1], P[:, :1], torch.ones(1, 1), 2, kind)
    assert float(a) == pytest.approx(float(only0))


@pytest.mark.parametrize("kind", ["tv", "kl_tv"])
def test_a_gradient_step_moves_q_toward_p_and_lowers_tv(kind):
    logits = LOGITS.clone().requires_grad_(True)
    eagle.token_loss(logits, P, MASK, 2, kind).backward()
    with torch.no_grad():
        stepped = logits - 0.5 * logits.grad
    assert float(_direct_tv(P, stepped).sum()) < float(_direct_tv(P, LOGITS).sum())
    # the most under-predicted token's logit rises (position 1: p = 0.8 on token 2, q gives it the least)
    assert float(logits.grad[0, 1, 2]) < 0


def test_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="head.loss 'hinge'"):
        eagle.token_loss(LOGITS, P, MASK, 2, "hinge")


def test_config_refuses_a_bad_loss_by_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("head:\n  family: eagle3\n  loss: hinge\n")
    with pytest.raises(ConfigError, match=r"head\.loss"):
        load_config(path)
    path.write_text("head:\n  family: eagle3\n  loss: kl_tv\n  loss_tv_weight: 0.25\n")
    cfg = load_config(path)
    assert (cfg.head.loss, cfg.head.loss_tv_weight) == ("kl_tv", 0.25)


def test_tv_weight_out_of_range_is_refused(tiny_target):
    _, _, io = tiny_target
    with pytest.raises(ValueError, match="head.loss_tv_weight 1.5"):
        eagle.build(eagle.Eagle3Config(layer_ids=[1, 2, 3], loss="kl_tv", loss_tv_weight=1.5), io)
    with pytest.raises(ValueError, match="head.loss_tv_weight -0.1"):
        eagle.build(eagle.Eagle1Config(loss="kl_tv", loss_tv_weight=-0.1), io)


def _head_losses(io, model, family: str, settings) -> list[float]:
    """The head's training loss (EAGLE-3: TTT over 2 steps; EAGLE-1: feature + token) per (loss, weight)."""
    ids = torch.randint(0, io.vocab_size, (2, 10), generator=torch.Generator().manual_seed(3))
    got = []
    for name, w in settings:
        torch.manual_seed(0)
        if family == "eagle3":
            cfg = eagle.Eagle3Config(layer_ids=[1, 2, 3], draft_vocab_size=io.vocab_size, ttt_length=2,
                                     loss=name, loss_tv_weight=w)
        else:  # the feature term off, so the loss is the token term alone
            cfg = eagle.Eagle1Config(feature_loss_weight=0.0, token_loss_weight=1.0, loss=name, loss_tv_weight=w)
        head = eagle.build(cfg, io).eval()
        with torch.no_grad():
            got.append(float(eagle.loss(head, _batch(model, head, ids), io)[0]))
    return got


@pytest.mark.parametrize("family", ["eagle3", "eagle1"])
def test_head_loss_uses_the_configured_kind(tiny_target, family):
    """A head's loss is token_loss of its kind: at kl_tv weight 0 it is forward_kl, at 1 it is tv."""
    model, _, io = tiny_target
    kl, tv, mix0, mix1 = _head_losses(io, model, family, [("forward_kl", 0.5), ("tv", 0.5), ("kl_tv", 0.0),
                                                          ("kl_tv", 1.0)])
    assert mix0 == pytest.approx(kl, rel=1e-6) and mix1 == pytest.approx(tv, rel=1e-6)
    assert tv != pytest.approx(kl) and 0 < tv < 2  # EAGLE-3: sum_s 0.8**s * mean TV; each TV in [0, 1]


# ------------------------------------------------------------------------------ token labels (Medusa, MTP)
GOLD = torch.tensor([0, 2])


@pytest.mark.parametrize("kind", ["forward_kl", "tv", "kl_tv"])
def test_hard_token_loss_is_token_loss_of_a_one_hot_and_the_direct_formula(kind):
    logits = LOGITS[0]
    onehot = torch.nn.functional.one_hot(GOLD, 3).float()
    got = hard_token_loss(logits, GOLD, kind, 0.3)
    assert got == pytest.approx(float(token_loss(logits, onehot, torch.ones(2), 2, kind, 0.3)), rel=1e-6)
    q_gold = _q(logits)[torch.arange(2), GOLD]
    direct = {"forward_kl": -q_gold.log(), "tv": 1 - q_gold, "kl_tv": 0.7 * -q_gold.log() + 0.3 * (1 - q_gold)}
    assert got == pytest.approx(float(direct[kind].mean()), rel=1e-6)  # unnormalised q (exp(logits)): fails
    with pytest.raises(ValueError, match="head.loss 'hinge'"):
        hard_token_loss(logits, GOLD, "hinge")


def _family_losses(tiny_target, module, cfg_cls, settings, **cfg) -> list[float]:
    from drafters_common import make_batch

    model, _, io = tiny_target
    g = torch.Generator().manual_seed(3)
    batch = make_batch(model, [torch.randint(3, 250, (20,), generator=g).tolist(),
                               torch.randint(3, 250, (14,), generator=g).tolist()])
    got = []
    for name, w in settings:
        torch.manual_seed(0)
        head = module.build(cfg_cls(loss=name, loss_tv_weight=w, **cfg), io).eval()
        with torch.no_grad():
            got.append(float(module.loss(head, batch, io)[0]))
    return got


@pytest.mark.parametrize("family, cfg", [("medusa", {"num_heads": 2}), ("medusa", {"num_heads": 2, "distill": True}),
                                         ("mtp", {"num_modules": 2})])
def test_medusa_and_mtp_take_the_loss_choice(tiny_target, family, cfg):
    """kl_tv at weight 0 is forward_kl (the operations the default always ran), at 1 it is tv; tv is a sum of
    per-head / per-step means of a value in [0, 1]."""
    from heads import medusa, mtp

    module, cfg_cls = {"medusa": (medusa, medusa.MedusaConfig), "mtp": (mtp, mtp.MTPConfig)}[family]
    kl, tv, mix0, mix1, default = _family_losses(tiny_target, module, cfg_cls, [
        ("forward_kl", 0.5), ("tv", 0.5), ("kl_tv", 0.0), ("kl_tv", 1.0), ("forward_kl", 0.5)], **cfg)
    assert mix0 == pytest.approx(kl, rel=1e-6) and mix1 == pytest.approx(tv, rel=1e-6)
    assert tv != pytest.approx(kl) and 0 < tv < 2 and default == kl
    with pytest.raises(ValueError, match="head.loss_tv_weight 1.5"):
        module.build(cfg_cls(loss="kl_tv", loss_tv_weight=1.5, **cfg), tiny_target[2])


@pytest.mark.parametrize("loss", ["tv", "forward_kl"])
def test_training_flushes_subnormals(tmp_path, loss):
    """Softmax gradients underflow into subnormals (an x86 slow path: TV's steps 5x slower, the quickstart's
    forward-KL EAGLE-3 steps 1.8x slower after step 35): every run flushes them."""
    from train.loop import train

    cfg = load_config("configs/tiny-eagle.yaml", ["--train.max_steps=1", "--train.batch_size=2",
                                                  f"--head.loss={loss}", "--train.eval_every=100",
                                                  f"--data.cache_dir={tmp_path / 'tok-cache'}"])
    cfg.out = str(tmp_path / "run")
    try:
        train(cfg)
        assert (torch.tensor([1e-40]) * 1.0).item() == 0.0  # a subnormal would survive unflushed
    finally:
        torch.set_flush_denormal(False)
