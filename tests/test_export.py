"""Exporters and importers (convert/, scripts/export.py) against the written specs in convert/formats/.

Tiny EAGLE-3, Medusa and MTP heads on the tiny random Llama, perturbed so no tensor is at its init value:
every format's key list and shapes match its spec, native -> format -> native gives identical tensors and
identical greedy speculative decoding, and incomplete or misconfigured checkpoints are refused.

    .venv/bin/python -m pytest -q tests/test_export.py
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import convert.eagle3 as eagle3_converter
from convert import (
    ExportError,
    eval_expr,
    expected_weights,
    export_head,
    import_folder,
    layouts_of,
    load_spec,
    resolve_symbols,
    served_by_vllm,
    serving_note,
    validate,
    validate_folder,
    write_folder,
)
from convert.registry import FAMILY_EXPORTS
from eval.decoder import speculative_generate
from heads import eagle, medusa, mtp, registry
from heads.base import HeadMismatchError, save_head

ROOT = Path(__file__).resolve().parents[1]
FAMILY_OF = {"speculators": "eagle3", "sglang": "eagle3", "medusa": "medusa", "mtp": "mtp"}


def _build(family: str, io):
    if family == "eagle3":
        cfg = eagle.Eagle3Config(layer_ids=[1, 2, 3], draft_vocab_size=97)
        head = eagle.build(cfg, io)
        # a non-trivial draft vocab: every other target id from 5 on (d2t not all zeros)
        ids = torch.arange(5, 5 + 2 * 97, 2)
        head.d2t.copy_(ids - torch.arange(97))
        head.t2d.zero_()
        head.t2d[ids] = True
    elif family == "medusa":
        cfg = medusa.MedusaConfig(num_heads=3, num_layers=2)
        head = medusa.build(cfg, io)
    else:
        cfg = mtp.MTPConfig(num_modules=2)
        head = mtp.build(cfg, io)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen))
    return head.eval(), cfg


@pytest.fixture(scope="module")
def heads_dir(tiny_target, tmp_path_factory):
    """{family: (native folder, head)} for eagle3, medusa, mtp."""
    _, _, io = tiny_target
    root = tmp_path_factory.mktemp("heads")
    out = {}
    for family in ("eagle3", "medusa", "mtp"):
        head, cfg = _build(family, io)
        out[family] = (save_head(root / family, head, cfg, io), head)
    return out


@pytest.fixture(scope="module")
def exported(tiny_target, heads_dir, tmp_path_factory):
    """{format: exported folder} for every engine format."""
    _, _, io = tiny_target
    root = tmp_path_factory.mktemp("exports")
    return {fmt: export_head(heads_dir[fam][0], fmt, root / fmt, io) for fmt, fam in FAMILY_OF.items()}


def _read(folder: Path, fmt: str) -> tuple[dict, dict[str, torch.Tensor]]:
    spec = load_spec(fmt)
    return json.loads((folder / spec["files"]["config"]).read_text()), load_file(str(folder / spec["files"]["weights"]))


def _rewrite(src: Path, dst: Path, fmt: str, config: dict, state: dict[str, torch.Tensor]) -> Path:
    """A copy of an export with an edited config / weights (bypassing the exporter's checks)."""
    spec = load_spec(fmt)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / spec["files"]["config"]).write_text(json.dumps(config))
    save_file(state, str(dst / spec["files"]["weights"]))
    return dst


# ----------------------------------------------------------------------------------------------- the spec
def test_spec_expressions_are_integer_arithmetic_only():
    assert eval_expr("NH * D", {"NH": 4, "D": 16}) == 64
    assert eval_expr("3 * TH", {"TH": 64}) == 192
    assert eval_expr("H // NH", {"H": 64, "NH": 4}) == 16
    with pytest.raises(ExportError, match="not integer arithmetic"):
        eval_expr("__import__('os').getcwd()", {})
    with pytest.raises(ExportError, match="unknown symbol 'Q'"):
        eval_expr("Q + 1", {})


def test_every_family_declares_its_exports():
    """Every declaration (a convert module with EXPORTS, found without a list) is for a registered family,
    says which layouts it exports (each spec names it) and whether vLLM serves it, and from which of its
    layouts; else why not (eval/vllm_engine.py prints that reason). A family with no declaration is
    native only, and says so."""
    assert set(FAMILY_EXPORTS) <= set(registry.names())
    assert set(FAMILY_EXPORTS) >= {"eagle1", "eagle3", "medusa", "mtp"}  # found by scanning convert/
    for family in registry.names():
        serving, why_not = served_by_vllm(family)
        assert (serving is None) == bool(why_not), family
    for family, exports in FAMILY_EXPORTS.items():
        assert [load_spec(fmt)["family"] for fmt in layouts_of(family)] == [family] * len(exports.layouts)
        serving, why_not = served_by_vllm(family)
        assert (serving is None) == bool(why_not), family
        assert serving is None or serving.format in layouts_of(family)
    assert served_by_vllm("eagle3")[0] == ("speculators", "eagle3")
    assert layouts_of("eagle3") == ("speculators", "sglang") and layouts_of("eagle1") == ()


@pytest.mark.parametrize("fmt", list(FAMILY_OF))
def test_key_list_and_shapes_match_spec(fmt, exported, tiny_target):
    _, _, io = tiny_target
    config, state = _read(exported[fmt], fmt)
    spec = load_spec(fmt)
    env = resolve_symbols(spec, config, io.config)
    block = spec["block_weights"]["llama"] if fmt == "mtp" else None
    want = {k: r for k, r in expected_weights(spec, env, block).items() if not r["optional"]}
    assert sorted(state) == sorted(want)
    for k, rule in want.items():
        assert tuple(state[k].shape) == rule["shape"], k
    validate_folder(exported[fmt], fmt, io)


def test_eagle3_shapes_are_the_documented_ones(exported):
    H, V, DV = 64, 259, 97
    _, state = _read(exported["sglang"], "sglang")
    assert state["fc.weight"].shape == (H, 3 * H)
    assert state["midlayer.self_attn.q_proj.weight"].shape == (4 * 16, 2 * H)
    assert state["midlayer.self_attn.k_proj.weight"].shape == (2 * 16, 2 * H)
    assert state["lm_head.weight"].shape == (DV, H)
    assert state["d2t"].dtype == torch.int64 and state["d2t"].shape == (DV,)
    assert state["t2d"].dtype == torch.bool and state["t2d"].shape == (V,)
    assert int(state["t2d"].sum()) == DV


def test_medusa_and_mtp_key_names(exported):
    _, med = _read(exported["medusa"], "medusa")
    assert {"0.0.linear.weight", "0.1.linear.bias", "2.2.weight"} <= set(med)
    assert med["2.2.weight"].shape == (259, 64)
    config, st = _read(exported["mtp"], "mtp")
    assert config["num_nextn_predict_layers"] == 2 and config["num_hidden_layers"] == 4
    assert {"model.layers.4.eh_proj.weight", "model.layers.5.enorm.weight", "model.layers.5.shared_head.norm.weight",
            "model.layers.4.self_attn.q_proj.weight", "model.layers.5.shared_head.head.weight"} <= set(st)
    assert st["model.layers.4.eh_proj.weight"].shape == (64, 128)


# ----------------------------------------------------------------------------------------------- round trip
@pytest.mark.parametrize("fmt", list(FAMILY_OF))
def test_round_trip_identical_tensors(fmt, exported, heads_dir, tiny_target):
    _, _, io = tiny_target
    _, original = heads_dir[FAMILY_OF[fmt]]
    back, cfg, provenance = import_folder(exported[fmt], fmt, io)
    a, b = original.state_dict(), back.state_dict()
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    assert provenance["imported_from"]["format"] == fmt
    assert cfg.family == FAMILY_OF[fmt]


def _greedy(model, io, family, head, prompt):
    mod = {"eagle3": eagle, "medusa": medusa, "mtp": mtp}[family]
    d = mod.drafter(head, io)
    ids, stats = speculative_generate(model, prompt, d, k=3, max_new_tokens=8)
    return ids.tolist(), stats.accepted_per_position, stats.target_passes


# speculators and sglang hold the same EAGLE-3 tensors (checked above): one decoding run covers both.
@pytest.mark.parametrize("fmt", ["sglang", "medusa", "mtp"])
def test_round_trip_identical_greedy_decoding(fmt, exported, heads_dir, tiny_target):
    model, tok, io = tiny_target
    family = FAMILY_OF[fmt]
    _, original = heads_dir[family]
    back, _, _ = import_folder(exported[fmt], fmt, io)
    prompt = torch.tensor([tok.encode("Hello there, how are")])
    assert _greedy(model, io, family, back, prompt) == _greedy(model, io, family, original, prompt)


def test_norm_before_residual_round_trips_through_speculators_and_sglang_refuses_it(tiny_target, tmp_path):
    model, tok, io = tiny_target
    head, cfg = _build("eagle3", io)
    cfg.norm_before_residual = head.norm_before_residual = True
    native = save_head(tmp_path / "head", head, cfg, io)
    out = export_head(native, "speculators", tmp_path / "spec", io)
    assert _read(out, "speculators")[0]["norm_before_residual"] is True
    back, back_cfg, _ = import_folder(out, "speculators", io)
    assert back_cfg.norm_before_residual is True and back.norm_before_residual is True
    prompt = torch.tensor([tok.encode("Hello there, how are")])
    assert _greedy(model, io, "eagle3", back, prompt) == _greedy(model, io, "eagle3", head, prompt)
    with pytest.raises(ExportError, match="head.norm_before_residual is true: the sglang layout has no such key"):
        export_head(native, "sglang", tmp_path / "sgl", io)
    assert not (tmp_path / "sgl").exists()
    # what publishing stages and its model card follow the same rule: no sglang/ folder, no SGLang command
    config = dataclasses.asdict(cfg)
    assert layouts_of("eagle3", config) == ("speculators",)
    card = serving_note("eagle3", "me/head", "org/target", 3, config)
    assert '"method": "eagle3"' in card and "sglang.launch_server" not in card and "SGLang: not served" in card
    assert "sglang.launch_server" in serving_note("eagle3", "me/head", "org/target", 3, {"norm_before_residual": False})


def test_a_pointer_head_is_refused_by_every_engine_layout(tiny_target, tmp_path):
    """head.pointer drafts the request's own tokens by pointing at its positions; no engine layout has that, so both refuse
    it with the key named, nothing is written, and publishing stages the native folder with no serving command."""
    _, _, io = tiny_target
    _, cfg = _build("eagle3", io)
    cfg.pointer = True
    native = save_head(tmp_path / "head", eagle.build(cfg, io), cfg, io)
    for fmt in ("speculators", "sglang"):
        with pytest.raises(ExportError, match="head.pointer is true: no engine layout has the pointer"):
            export_head(native, fmt, tmp_path / fmt, io)
        assert not (tmp_path / fmt).exists()
    config = dataclasses.asdict(cfg)
    assert layouts_of("eagle3", config) == ()
    card = serving_note("eagle3", "me/head", "org/target", 3, config)
    assert "No serving engine runs this head" in card and "vllm serve" not in card


def test_native_export_reloads(heads_dir, tiny_target, tmp_path):
    _, _, io = tiny_target
    out = export_head(heads_dir["eagle3"][0], "native", tmp_path / "n", io)
    validate_folder(out, "native", io)
    a = load_file(str(heads_dir["eagle3"][0] / "model.safetensors"))
    b = load_file(str(out / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a) and sorted(a) == sorted(b)


# ----------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("fmt", ["speculators", "sglang"])
def test_missing_d2t_refused(fmt, exported, tiny_target, tmp_path):
    _, _, io = tiny_target
    config, state = _read(exported[fmt], fmt)
    state.pop("d2t")
    bad = _rewrite(exported[fmt], tmp_path / "bad", fmt, config, state)
    with pytest.raises(ExportError, match="'d2t' is missing"):
        validate_folder(bad, fmt, io)
    with pytest.raises(ExportError, match="'d2t' is missing"):
        import_folder(bad, fmt, io)
    # and the writer refuses to write it at all
    with pytest.raises(ExportError, match="'d2t' is missing"):
        write_folder(tmp_path / "never", fmt, config, state, target=io)
    assert not (tmp_path / "never").exists() and not (tmp_path / "never.tmp-export").exists()


def test_exporter_refuses_head_without_d2t(heads_dir, tiny_target, tmp_path, monkeypatch):
    """A head whose state lacks d2t (an older head class, say) gets no export, not an identity-map one."""
    _, _, io = tiny_target
    real = eagle3_converter.head_state
    monkeypatch.setattr(eagle3_converter, "head_state", lambda head: {k: v for k, v in real(head).items() if k != "d2t"})
    with pytest.raises(ExportError, match="'d2t' is missing"):
        export_head(heads_dir["eagle3"][0], "speculators", tmp_path / "out", io)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c.pop("speculators_model_type"), "'speculators_model_type' is required"),
        (lambda c: c.pop("norm_before_residual"), "'norm_before_residual' is required"),
        (lambda c: c.update(norm_before_residual=1), "'norm_before_residual' must be bool"),
        (lambda c: c.update(transformer_layer_config="llama"), "'transformer_layer_config' must be dict"),
        (lambda c: c["transformer_layer_config"].update(num_hidden_layers=32), "must be 1"),
        (lambda c: c["transformer_layer_config"].pop("model_type"), "'transformer_layer_config.model_type' is required"),
        (lambda c: c["speculators_config"]["proposal_methods"][0].pop("speculative_tokens"), "lacks 'speculative_tokens'"),
        (lambda c: c["speculators_config"]["verifier"].pop("name_or_path"), "verifier.name_or_path' is required"),
        (lambda c: c["speculators_config"].update(default_proposal_method="tree"), "must name one of"),
        (lambda c: c.update(norm_output=True), "'norm_output' changes the engine's forward"),
        (lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 2]), "must have 3 entries"),
    ],
)
def test_speculators_config_refusals(edit, message, exported, tiny_target, tmp_path):
    _, _, io = tiny_target
    config, state = _read(exported["speculators"], "speculators")
    edit(config)
    bad = _rewrite(exported["speculators"], tmp_path / "bad", "speculators", config, state)
    with pytest.raises(ExportError, match=message):
        import_folder(bad, "speculators", io)


def test_vllm_required_fields_present(exported):
    config, _ = _read(exported["speculators"], "speculators")
    layer = config["transformer_layer_config"]
    assert isinstance(layer, dict) and layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1
    assert config["speculators_model_type"] == "eagle3" and config["norm_before_residual"] is False
    sc = config["speculators_config"]
    assert sc["proposal_methods"][0]["speculative_tokens"] == 5
    assert sc["verifier"]["name_or_path"] == "tiny-random-llama"
    assert sc["verifier"]["architectures"] == ["LlamaForCausalLM"]
    assert sc["default_proposal_method"] in [m["proposal_type"] for m in sc["proposal_methods"]]
    assert layer["rope_theta"] == 10000.0 and layer["rms_norm_eps"] == 1e-6
    for key in ("norm_output", "norm_before_fc", "fc_norm"):
        assert key not in config and key not in layer


def test_sglang_has_no_embed_tokens_and_refuses_one(exported, tiny_target, tmp_path):
    _, _, io = tiny_target
    config, state = _read(exported["sglang"], "sglang")
    assert "embed_tokens.weight" not in state
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    state["embed_tokens.weight"] = io.embed.weight.detach().clone()
    bad = _rewrite(exported["sglang"], tmp_path / "emb", "sglang", config, state)
    with pytest.raises(ExportError, match="'embed_tokens.weight' must not be"):
        validate_folder(bad, "sglang", io)
    # a public checkpoint carrying one still imports: the engine overwrites it with the target's anyway
    _, _, prov = import_folder(bad, "sglang", io)
    assert prov["imported_from"]["dropped"] == ["embed_tokens.weight"]


def test_unexpected_or_misshaped_weight_refused(exported, tiny_target, tmp_path):
    _, _, io = tiny_target
    config, state = _read(exported["sglang"], "sglang")
    renamed = dict(state)
    renamed["layers.0.mlp.up_proj.weight"] = renamed.pop("midlayer.mlp.up_proj.weight")
    with pytest.raises(ExportError, match="'midlayer.mlp.up_proj.weight' is missing"):
        validate("sglang", config, renamed, io)
    state["norm.weight"] = torch.ones(63)
    with pytest.raises(ExportError, match=r"'norm.weight' has shape \(63,\)"):
        validate("sglang", config, state, io)


def test_layer_id_conventions(exported, tiny_target):
    _, _, io = tiny_target
    spec_cfg, _ = _read(exported["speculators"], "speculators")
    sgl_cfg, _ = _read(exported["sglang"], "sglang")
    assert spec_cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # vLLM: input of layer i
    assert sgl_cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]  # SGLang: output of layer i
    for fmt in ("speculators", "sglang"):
        _, cfg, _ = import_folder(exported[fmt], fmt, io)
        assert cfg.layer_ids == [1, 2, 3]


def test_unservable_layer_id_refused(tiny_target, tmp_path):
    _, _, io = tiny_target
    cfg = eagle.Eagle3Config(layer_ids=[0, 1, 2], draft_vocab_size=50)
    folder = save_head(tmp_path / "h", eagle.build(cfg, io), cfg, io)
    with pytest.raises(ExportError, match="layer id 0 cannot be served"):
        export_head(folder, "sglang", tmp_path / "out", io)


def test_wrong_family_and_nonempty_out_refused(heads_dir, exported, tiny_target):
    _, _, io = tiny_target
    with pytest.raises(ExportError, match="medusa head cannot be exported to sglang"):
        export_head(heads_dir["medusa"][0], "sglang", exported["sglang"].parent / "x", io)
    with pytest.raises(ExportError, match="not empty"):
        export_head(heads_dir["eagle3"][0], "sglang", exported["sglang"], io)


def test_medusa_public_config_without_sizes_imports(exported, tiny_target, tmp_path):
    _, _, io = tiny_target
    config, state = _read(exported["medusa"], "medusa")
    public = {k: config[k] for k in ("medusa_num_heads", "medusa_num_layers", "base_model_name_or_path")}
    folder = _rewrite(exported["medusa"], tmp_path / "pub", "medusa", public, state)
    head, cfg, _ = import_folder(folder, "medusa", io)
    assert cfg.num_heads == 3 and cfg.num_layers == 2
    state.pop("1.0.linear.bias")
    bad = _rewrite(exported["medusa"], tmp_path / "bad", "medusa", public, state)
    with pytest.raises(ExportError, match="'1.0.linear.bias' is missing"):
        import_folder(bad, "medusa", io)


def test_mtp_import_refuses_foreign_head(exported, tiny_target, tmp_path):
    _, _, io = tiny_target
    config, state = _read(exported["mtp"], "mtp")
    state["model.layers.5.shared_head.head.weight"] = state["model.layers.5.shared_head.head.weight"] + 1.0
    bad = _rewrite(exported["mtp"], tmp_path / "bad", "mtp", config, state)
    with pytest.raises(HeadMismatchError, match="shared_head.head.weight differs"):
        import_folder(bad, "mtp", io)


def test_pickled_weights_refused(tmp_path, tiny_target):
    _, _, io = tiny_target
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ExportError, match="pickled weights are not loaded"):
        import_folder(tmp_path, "sglang", io)


def test_bfloat16_export_keeps_index_buffers(heads_dir, tiny_target, tmp_path):
    _, _, io = tiny_target
    out = export_head(heads_dir["eagle3"][0], "sglang", tmp_path / "bf16", io, dtype="bfloat16")
    config, state = _read(out, "sglang")
    assert state["fc.weight"].dtype == torch.bfloat16 and config["torch_dtype"] == "bfloat16"
    assert state["d2t"].dtype == torch.int64 and state["t2d"].dtype == torch.bool


# ----------------------------------------------------------------------------------------------- CLI
def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cli_export_and_import(heads_dir, tmp_path, capsys):
    cli = _script("export")
    head = heads_dir["eagle3"][0]
    assert cli.main(["--head", str(head), "--to", "sglang", "--out", str(tmp_path / "sgl")]) == 0
    assert cli.main(["--import", "sglang", "--from", str(tmp_path / "sgl"), "--target", "tiny-random-llama",
                     "--out", str(tmp_path / "back")]) == 0
    a, b = load_file(str(head / "model.safetensors")), load_file(str(tmp_path / "back" / "model.safetensors"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    # refusals exit 2 with a message naming the problem, not a traceback
    with pytest.raises(SystemExit) as e:
        cli.main(["--head", str(head), "--to", "medusa", "--out", str(tmp_path / "m")])
    assert e.value.code == 2
    assert "cannot be exported to medusa" in capsys.readouterr().err
