"""What every head family shares, for every family of heads.registry: what a Family declares (config, tiny
config, trees, entry script), drafter_factory's eval.tree mapping, greedy decoding identical to the target's
with each mapped tree and with the head drafting in bfloat16 (eval.draft_dtype); the drafters' KV cache helpers (heads.cache), and the names heads.base keeps
re-exporting.

    .venv/bin/python -m pytest -q tests/test_heads.py
"""

from __future__ import annotations

import copy
import typing
from pathlib import Path

import pytest
import torch
from drafters_common import hf_greedy
from transformers import DynamicCache

from data.config import EvalConfig, load_config
from eval.costs import place_head
from eval.decoder import speculative_generate
from heads import eagle, medusa, mtp, registry
from heads.base import HeadError
from heads.cache import cache_length, crop_to
from heads.tree import DEFAULT_CHOICES, StaticTree

ROOT = Path(__file__).resolve().parents[1]
EVAL_TREES = typing.get_args(typing.get_type_hints(EvalConfig)["tree"])  # ('auto', 'chain', 'static', 'dynamic')
FAMILIES = registry.names()


@pytest.fixture(scope="module")
def heads(tiny_target):
    """family -> a fresh head of every registered family, configured as in its tiny config, on the tiny target."""
    _, _, io = tiny_target
    torch.manual_seed(0)
    return {name: registry.get(name).build(load_config(ROOT / registry.get(name).tiny).head, io) for name in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_declares_what_the_pipeline_needs(family):
    fam = registry.get(family)
    assert fam.config().family == family and fam.tiny and (ROOT / fam.tiny).is_file()
    assert load_config(ROOT / fam.tiny).head.family == family
    assert set(fam.trees) <= set(EVAL_TREES) - {"auto"}, "trees are eval.tree values (auto always maps)"
    assert not fam.script or family in registry.trained_by(fam.script)


@pytest.mark.parametrize(("family", "tree"), [(f, t) for f in FAMILIES for t in EVAL_TREES])
def test_drafter_factory_maps_or_refuses_each_eval_tree(tiny_target, heads, family, tree):
    """`auto` and the family's `trees` give fresh drafters of this head; any other eval.tree is refused."""
    _, _, io = tiny_target
    fam = registry.get(family)
    if tree == "auto" or tree in fam.trees:
        make = fam.drafter_factory(heads[family], io, tree, 2)  # k = 2: within any tiny head's depth
        first, second = make(), make()
        assert first is not second  # a fresh drafter per call: each generation starts from a clean state
        assert first.head is heads[family] and first.target is io
    else:
        with pytest.raises(HeadError, match=rf"^eval.tree '{tree}' is not available for a {family} head$"):
            fam.drafter_factory(heads[family], io, tree, 4)


@pytest.mark.parametrize(("family", "tree"), [(f, t) for f in FAMILIES for t in ("auto", *registry.get(f).trees)])
def test_greedy_decoding_with_every_family_and_tree_is_the_targets(tiny_target, heads, family, tree):
    """An untrained head's drafts are mostly rejected, yet the output is model.generate's greedy text."""
    model, _, io = tiny_target
    ids = torch.tensor([[1, 72, 101, 108, 108, 111]])
    ref, eos = hf_greedy(model, ids, 12)
    make = registry.get(family).drafter_factory(heads[family], io, tree, 2)
    out, _ = speculative_generate(model, ids, make(), k=2, max_new_tokens=12, eos_token_id=eos)
    assert out.tolist() == ref.tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_decoding_with_every_family_drafting_in_bfloat16_is_the_targets(tiny_target, heads, family):
    """eval.draft_dtype bfloat16 on the float32 target: each family's drafter casts the target's features and
    embeddings to its head's dtype, drafts, and the output is still model.generate's greedy text."""
    model, _, io = tiny_target
    head = copy.deepcopy(heads[family])
    assert place_head(head, torch.device("cpu"), torch.float32, "bfloat16") == torch.bfloat16
    assert {p.dtype for p in head.parameters()} == {torch.bfloat16}
    ids = torch.tensor([[1, 72, 101, 108, 108, 111]])
    ref, eos = hf_greedy(model, ids, 12)
    make = registry.get(family).drafter_factory(head, io, "auto", 2)
    out, stats = speculative_generate(model, ids, make(), k=2, max_new_tokens=12, eos_token_id=eos)
    assert out.tolist() == ref.tolist() and stats.drafted_tokens > 0


def _options(d) -> tuple:
    """The drafter's tree option as something comparable: EAGLE's tree kind, Medusa's choice paths."""
    if isinstance(d, eagle.EagleDrafter):
        return ("eagle", d.tree)
    if isinstance(d, medusa.MedusaDrafter):
        return ("medusa", d.tree.paths)
    assert isinstance(d, mtp.MTPDrafter)
    return ("mtp",)


MEDUSA_DEFAULT = StaticTree(DEFAULT_CHOICES).truncate(3).paths  # the configured tree (none) cut to 3 heads
# (family, eval.tree, k) -> the drafter options eval/run.py's _head_drafter_factory has always produced for
# the four families the project started with (a new family's mapping is its own test's business)
MAPPING = {
    ("eagle1", "auto", 4): ("eagle", "chain"), ("eagle1", "chain", 4): ("eagle", "chain"),
    ("eagle1", "dynamic", 4): ("eagle", "dynamic"),
    ("eagle3", "auto", 4): ("eagle", "chain"), ("eagle3", "chain", 2): ("eagle", "chain"),
    ("eagle3", "dynamic", 4): ("eagle", "dynamic"),
    ("medusa", "auto", 4): ("medusa", MEDUSA_DEFAULT), ("medusa", "static", 2): ("medusa", MEDUSA_DEFAULT),
    ("medusa", "chain", 3): ("medusa", [(0,), (0, 0), (0, 0, 0)]), ("medusa", "chain", 1): ("medusa", [(0,)]),
    ("mtp", "auto", 4): ("mtp",), ("mtp", "chain", 4): ("mtp",),
}


@pytest.mark.parametrize(("family", "tree", "k"), list(MAPPING))
def test_drafter_factory_maps_eval_tree_onto_the_family_options(tiny_target, heads, family, tree, k):
    _, _, io = tiny_target
    assert _options(registry.get(family).drafter_factory(heads[family], io, tree, k)()) == MAPPING[family, tree, k]


# ----------------------------------------------------------------------------------------------- heads.cache
def _rows(n: int, start: float = 0.0) -> torch.Tensor:
    """[1, 1, n, 2] keys whose row i holds start + i (so a crop's survivors can be read off)."""
    return (torch.arange(n, dtype=torch.float32) + start).reshape(1, 1, n, 1).expand(1, 1, n, 2).contiguous()


def test_crop_to_keeps_the_first_rows_of_the_filled_layer_only():
    cache = DynamicCache()
    cache.update(_rows(5), _rows(5, 10.0), 3)  # a copied target block writes at its own layer index
    assert cache_length(cache) == 5 and cache.get_seq_length(0) == 0
    crop_to(cache, 7)  # longer than held: nothing to do (5.24 refuses a positive crop, 5.17 read it as a length)
    assert cache_length(cache) == 5
    crop_to(cache, 3)
    assert cache.layers[3].keys[0, 0, :, 0].tolist() == [0.0, 1.0, 2.0]
    assert cache.layers[3].values[0, 0, :, 0].tolist() == [10.0, 11.0, 12.0]
    keys, _ = cache.update(_rows(1, 7.0), _rows(1, 17.0), 3)  # appends after the survivors
    assert keys[0, 0, :, 0].tolist() == [0.0, 1.0, 2.0, 7.0]
    crop_to(cache, 0)
    assert cache_length(cache) == 0
    assert cache_length(DynamicCache()) == 0


def test_base_keeps_re_exporting_the_moved_names():
    from heads import align, base, cache, types

    for name in ("Features", "TargetIO", "DraftTree", "Drafter", "target_record", "target_fingerprint"):
        assert getattr(base, name) is getattr(types, name)
    assert base.cache_kwarg is cache.cache_kwarg and base.shift_targets is align.shift_targets
