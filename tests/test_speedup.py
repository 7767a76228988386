"""The report's speedup model (eval/speedup.py over eval.costs): closed form anchors, rate extension, best k
under a growing verify cost, predicted vs measured, trees.

    .venv/bin/python -m pytest -q tests/test_speedup.py
"""

from __future__ import annotations

import json

import pytest

from eval.costs import DraftCost, VerifyCost
from eval.speedup import extend_rates, flat_speedup, speedup_model


def test_science_md_anchor_k8_is_a_loss():
    """docs/science.md: with c = 0.2 and alpha = 0.5, k = 8 is a loss (0.77x)."""
    assert flat_speedup(0.5, 8, 0.2) == pytest.approx(0.768, abs=1e-3)
    assert flat_speedup(0.5, 1, 0.2) == pytest.approx(1.25)
    assert flat_speedup(1.0, 3, 0.0) == 4.0


def test_model_with_flat_costs_matches_the_closed_form():
    verify = VerifyCost({1: 0.1, 9: 0.1}, context_len=0)
    draft = DraftCost(fixed_s=0.0, per_token_s=0.02)  # c = 0.2
    sm = speedup_model([0.5], 1.0, verify, draft)
    for k in range(1, 9):
        assert sm["predicted"][str(k)] == pytest.approx(flat_speedup(0.5, k, 0.2))
    assert sm["best_k"] in (1, 2) and sm["c"] == pytest.approx(0.2)


def test_extend_rates_repeats_the_deepest():
    assert extend_rates([0.8, 0.6], 4) == [0.8, 0.6, 0.6, 0.6]
    assert extend_rates([0.8, 0.6, 0.4], 2) == [0.8, 0.6]
    assert extend_rates([], 3) == [0.0, 0.0, 0.0]


def test_growing_verify_cost_moves_best_k_down():
    """On CPUs the verify cost grows with k (docs/science.md's 2-core figures): long chains stop paying."""
    free = DraftCost(0.0, 0.0)
    flat = speedup_model([0.6], 1.0, VerifyCost({1: 0.057, 64: 0.057}, 0), free)
    cpu = speedup_model([0.6], 1.0, VerifyCost({1: 0.057, 6: 0.125}, 0), free)  # +13.6 ms per token
    assert flat["best_k"] == 8  # free drafts and a flat verify: always longer
    assert cpu["best_k"] == 2
    assert cpu["predicted"]["2"] == max(cpu["predicted"].values())


def test_measured_row_and_json():
    verify = VerifyCost({1: 0.05, 4: 0.06, 9: 0.08}, 0)
    sm = speedup_model([0.7, 0.6, 0.5], 1.0, verify, DraftCost(0.001, 0.004),
                       measured={"k": 3, "tau": 2.1, "speedup": 1.4})
    json.dumps(sm)
    assert set(sm["predicted"]) == {str(k) for k in range(1, 9)}
    m = sm["measured"]
    assert m["predicted_tau"] == pytest.approx(1 + 0.7 + 0.42 + 0.21)
    assert m["predicted_speedup"] == pytest.approx(sm["predicted"]["3"])
    assert m["speedup"] == 1.4
    # Passes that draft nothing (n-gram without a match) lower E and cost T(1).
    half = speedup_model([1.0], 0.5, verify, DraftCost(0.0, 0.0), measured={"k": 2, "tau": 2.0, "speedup": 1.0})
    assert half["measured"]["predicted_tau"] == pytest.approx(2.0)
    assert half["predicted"]["2"] == pytest.approx(2.0 * 0.05 / (0.5 * verify(3) + 0.5 * 0.05))


def test_tree_prediction_prices_the_measured_tau():
    verify = VerifyCost({1: 0.05, 16: 0.10}, 0)
    draft = DraftCost(0.0, 0.01)
    sm = speedup_model([0.5], 1.0, verify, draft, measured={"k": 4, "tau": 3.0, "speedup": 1.0}, tree_nodes=15)
    assert sm["tree"]["predicted_speedup"] == pytest.approx(3.0 * 0.05 / (15 * 0.01 + 0.10))  # D per node
