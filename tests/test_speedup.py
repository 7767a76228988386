"""The speedup model (eval/speedup.py): closed forms, interpolation of the verify cost, best k, measured rows.

    .venv/bin/python -m pytest -q tests/test_speedup.py
"""

from __future__ import annotations

import json

import pytest

from eval.speedup import (
    effective_acceptance,
    expected_tokens,
    flat_speedup,
    predicted_speedup,
    speedup_model,
    verify_cost,
)


def test_science_md_anchor_k8_is_a_loss():
    """SCIENCE.md: with c = 0.2 and alpha = 0.5, k = 8 is a loss (0.77x)."""
    assert flat_speedup(0.5, 8, 0.2) == pytest.approx(0.768, abs=1e-3)
    assert flat_speedup(0.5, 1, 0.2) == pytest.approx(1.25)


def test_expected_tokens_geometric_and_bounded():
    a = 0.7
    for k in range(1, 9):
        assert expected_tokens([a], k) == pytest.approx((1 - a ** (k + 1)) / (1 - a))
    assert expected_tokens([a], 200) < 1 / (1 - a)
    assert expected_tokens([1.0], 4) == 5.0
    assert expected_tokens([0.0], 4) == 1.0


def test_expected_tokens_uses_each_rate_then_repeats_the_deepest():
    # 1 + 0.8 + 0.8*0.5 + 0.8*0.5*0.5
    assert expected_tokens([0.8, 0.5], 3) == pytest.approx(1 + 0.8 + 0.4 + 0.2)
    assert expected_tokens([0.8, 0.5, None], 3) == pytest.approx(1 + 0.8 + 0.4 + 0.2)
    assert expected_tokens([], 3) == 1.0


def test_effective_acceptance_reproduces_tau():
    rates = effective_acceptance([6, 3], 10)
    assert rates == [0.6, 0.5]
    assert expected_tokens(rates, 2) == pytest.approx((10 + 6 + 3) / 10)
    assert effective_acceptance([0, 0], 4) == [0.0, None]
    with pytest.raises(ValueError, match="position 2"):
        effective_acceptance([3, 5], 10)


def test_verify_cost_interpolates_and_extrapolates():
    curve = {1: 0.05, 5: 0.09}
    assert verify_cost(curve, 3) == pytest.approx(0.07)
    assert verify_cost(curve, 9) == pytest.approx(0.13)
    assert verify_cost(curve, 5) == 0.09
    assert verify_cost({1: 0.04}, 7) == 0.04
    with pytest.raises(ValueError):
        verify_cost({}, 1)


def test_flat_curve_reduces_to_closed_form():
    curve = {1: 0.1, 9: 0.1}
    for k in range(1, 9):
        assert predicted_speedup([0.6], k, 0.02, curve) == pytest.approx(flat_speedup(0.6, k, 0.2))


def test_growing_verify_cost_moves_best_k_down():
    """On CPUs the verify cost grows with k (SCIENCE.md's 2-core figures): a long chain stops paying."""
    flat = speedup_model([0.6], 0.0, {1: 0.057, 64: 0.057})
    cpu = speedup_model([0.6], 0.0, {1: 0.057, 6: 0.125})  # +13.6 ms per verified token
    assert flat["best_k"] == 8  # free drafts and a flat verify: always longer
    assert cpu["best_k"] == 2
    assert cpu["predicted"][str(cpu["best_k"])] == max(cpu["predicted"].values())


def test_speedup_model_report_section_is_json_and_has_measured():
    sm = speedup_model([0.7, 0.6, 0.5], 0.004, {1: 0.05, 4: 0.06, 9: 0.08},
                       measured={"k": 3, "tau": 2.1, "speedup": 1.4})
    json.dumps(sm)
    assert set(sm["predicted"]) == {str(k) for k in range(1, 9)}
    m = sm["measured"]
    assert m["predicted_tau"] == pytest.approx(1 + 0.7 + 0.42 + 0.21)
    assert m["predicted_speedup"] == pytest.approx(sm["predicted"]["3"])
    assert sm["c"] == pytest.approx(0.08)


def test_tree_prediction_uses_its_tau_and_node_count():
    sm = speedup_model([0.5], 0.01, {1: 0.05, 16: 0.10}, trees=[{"nodes": 15, "depth": 4, "tau": 3.0}],
                       measured={"k": 4, "tau": 3.0, "speedup": 1.0, "nodes": 15, "depth": 4})
    expect = 3.0 * 0.05 / (4 * 0.01 + 0.10)
    assert sm["trees"][0]["predicted"] == pytest.approx(expect)
    assert sm["measured"]["predicted_speedup"] == pytest.approx(expect)
