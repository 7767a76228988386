"""Extraction on the tiny target: plan, online == offline, mismatch refusals, kill and resume, ranks, disk check.

    .venv/bin/python -m pytest -q tests/test_extract.py          # add -m distributed for accelerate launch
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import datasets
import pytest
import torch
from procs import kill_when
from procs import run as run_proc

from data.config import RunConfig, load_config
from data.extract import extract_split, main, make_header, plan_shards, run, target_info
from data.featureset import open_featureset
from data.store import MANIFEST, StoreError, StoreMismatchError, merge, part_name, read_json, shard_name
from data.tokenize import tokenize_records

ROOT = Path(__file__).resolve().parents[1]
LAYERS = [1, 3]


def write_conversations(path: Path, n: int) -> Path:
    """n short ShareGPT conversations of varied length (byte tokens: roughly 60 to 200 per sample)."""
    lines = []
    for i in range(n):
        q = f"What is {i} times {i % 7}?" + " Please explain." * (i % 5)
        a = f"{i} times {i % 7} is {i * (i % 7)}." + " That is all." * (i % 4)
        lines.append(json.dumps({"id": f"c{i}", "conversations": [{"from": "human", "value": q},
                                                                   {"from": "gpt", "value": a}]}))
    path.write_text("\n".join(lines) + "\n")
    return path


def write_config(path: Path, data: Path, holdout: float = 0.0) -> Path:
    """A tiny-target run config (float32 features, small shards and batches, Medusa: `last` only)."""
    path.write_text(f"target: {{name_or_path: tiny-random-llama, device: cpu}}\n"
                    f"data: {{path: {data}, holdout_fraction: {holdout}}}\nhead: {{family: medusa}}\n"
                    f"features: {{dtype: float32, shard_tokens: 600, batch_tokens: 300}}\n")
    return path


def make_cfg(out: Path, data: Path, holdout: float = 0.0) -> RunConfig:
    out.mkdir(parents=True, exist_ok=True)
    cfg = load_config(write_config(out / "config.yaml", data, holdout))
    cfg.out = str(out)
    return cfg


@pytest.fixture(scope="module")
def store(tiny_target, tmp_path_factory) -> tuple[RunConfig, datasets.Dataset]:
    """A float32 store of 30 conversations with aux layers [1, 3], several shards."""
    model, tok, _ = tiny_target
    tmp = tmp_path_factory.mktemp("store")
    cfg = make_cfg(tmp, tmp / "unused.jsonl")  # the dataset is built here, not read from cfg.data
    ds = tokenize_records([{"id": f"c{i}", "messages": [{"role": "user", "content": "x" * (5 + 7 * i)},
                                                        {"role": "assistant", "content": "y" * (3 + 5 * (i % 6))}]}
                           for i in range(30)], tok, 256)
    header = make_header(target_info(model, "tiny-random-llama", None), LAYERS, "float32", "train", ds, 1,
                         cfg.features.batch_tokens, cfg.features.shard_tokens)
    part = extract_split(model, ds, tmp / "features" / "train", header, pad_id=tok.pad_token_id, show_progress=False)
    assert part["complete"] and len(part["shards"]) > 2
    merge(tmp / "features" / "train")
    return cfg, ds


# ----------------------------------------------------------------------------------------------- plan
def test_plan_worked_example() -> None:
    lengths = [5, 9, 2, 7, 3]
    assert plan_shards(lengths, 0, 2, 16, 10) == [[[1], [0, 2]]]
    assert plan_shards(lengths, 1, 2, 16, 10) == [[[3, 4]]]


def test_plan_covers_every_sample_once_within_budgets() -> None:
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(1, 200, (101,), generator=g).tolist()
    seen = []
    for rank in range(3):
        shards = plan_shards(lengths, rank, 3, 256, 500)
        for s in shards:
            for b in s:
                assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 256
            seen += [i for b in s for i in b]
        # every shard but the last reaches shard_tokens
        assert all(sum(lengths[i] for b in s for i in b) >= 500 for s in shards[:-1])
    assert sorted(seen) == list(range(101))


# ----------------------------------------------------------------------------------------------- featureset
def test_online_equals_offline(tiny_target, store) -> None:
    """Bit-identical on the batches the extraction ran; other batch shapes differ only by float rounding
    (different padded lengths change the kernels' blocking, ~1e-6 on the tiny model)."""
    model, tok, _ = tiny_target
    cfg, ds = store
    cfg.features.mode = "offline"
    off = open_featureset(cfg, ds, model, LAYERS, "train", pad_id=tok.pad_token_id)
    cfg.features.mode = "online"
    on = open_featureset(cfg, ds, model, LAYERS, "train", pad_id=tok.pad_token_id)
    assert len(off) == len(on) == 30 and off.lengths == on.lengths == list(ds["length"])
    planned = [b for s in plan_shards(off.lengths, 0, 1, cfg.features.batch_tokens, cfg.features.shard_tokens)
               for b in s]
    assert any(len(b) > 1 and len({off.lengths[i] for i in b}) > 1 for b in planned)  # padding is exercised
    for idx in planned:
        a, b = off.batch(idx), on.batch(idx)
        assert set(a) == set(b) == {"input_ids", "attention_mask", "loss_mask", "last", "aux", "target_argmax"}
        assert a["last"].dtype == torch.float32 and a["aux"].shape[-1] == 2 * 64
        for k in a:
            assert torch.equal(a[k], b[k]), k
    for idx in ([0, 29, 13], [5], list(range(7, 17))):
        a, b = off.batch(idx), on.batch(idx)
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        assert torch.allclose(a["last"], b["last"], atol=1e-5) and torch.allclose(a["aux"], b["aux"], atol=1e-5)
        pad = a["attention_mask"] == 0
        assert pad.any() == (len(idx) > 1)
        assert a["last"][pad].abs().sum() == 0 and b["aux"][pad].abs().sum() == 0
        # the stored argmax is the inference path's greedy token: the target's own logits, padding zero
        with torch.no_grad():
            greedy = model(input_ids=a["input_ids"], attention_mask=a["attention_mask"]).logits.argmax(-1)
        assert torch.equal(a["target_argmax"][~pad], greedy[~pad]) and a["target_argmax"][pad].abs().sum() == 0


def test_argmax_only_for_heads_that_read_it(tiny_target, store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Online, the argmax costs a full-vocab lm_head pass per batch: a head whose loss does not read it
    (Medusa, MTP, EAGLE-1) gets batches without it, in both modes alike, and online never computes it."""
    from heads import registry
    from heads.registry import TARGET_ARGMAX

    readers = [n for n in registry.names() if TARGET_ARGMAX in registry.get(n).reads(registry.get(n).config())]
    assert "eagle3" in readers and not {"eagle1", "medusa", "mtp"} & set(readers)
    model, tok, _ = tiny_target
    cfg, ds = store
    monkeypatch.setattr("data.featureset.greedy_ids", lambda *a: pytest.fail("argmax computed unasked"))
    for mode in ("offline", "online"):
        cfg.features.mode = mode
        fs = open_featureset(cfg, ds, model, LAYERS, "train", pad_id=tok.pad_token_id, with_argmax=False)
        assert "target_argmax" not in fs.batch([0, 29, 13])


def test_store_for_other_layer_ids_refused(tiny_target, store) -> None:
    cfg, ds = store
    cfg.features.mode = "offline"
    with pytest.raises(StoreMismatchError, match=r"store has layer ids \[1, 3\] but the head needs \[2\]"):
        open_featureset(cfg, ds, tiny_target[0], [2], "train")


def test_store_for_other_target_refused(store) -> None:
    from data.config import TargetConfig
    from data.target import load_model

    cfg, ds = store
    cfg.features.mode = "offline"
    other = load_model(TargetConfig(name_or_path="tiny-random-qwen2", device="cpu"))
    with pytest.raises(StoreMismatchError, match=r"made for target 'tiny-random-llama' \(fingerprint"):
        open_featureset(cfg, ds, other, LAYERS, "train")
    cfg.target.name_or_path = "tiny-random-qwen2"  # no model at hand: name and shape are compared
    try:
        with pytest.raises(StoreMismatchError, match="name_or_path 'tiny-random-llama'"):
            open_featureset(cfg, ds, None, LAYERS, "train")
    finally:
        cfg.target.name_or_path = "tiny-random-llama"
    open_featureset(cfg, ds, None, LAYERS, "train")


def test_store_for_other_data_refused(tiny_target, store) -> None:
    cfg, ds = store
    cfg.features.mode = "offline"
    with pytest.raises(StoreMismatchError, match="holds 30 samples, the tokenized split has 29"):
        open_featureset(cfg, ds.select(range(29)), tiny_target[0], LAYERS, "train")
    changed = ds.map(lambda r: {"input_ids": [r["input_ids"][0] ^ 1] + r["input_ids"][1:]})
    with pytest.raises(StoreMismatchError, match="other tokenized data"):
        open_featureset(cfg, changed, tiny_target[0], LAYERS, "train")


def test_extraction_into_foreign_folder_refused(tiny_target, store, tmp_path: Path) -> None:
    cfg, ds = store
    folder = tmp_path / "train"
    shutil.copytree(Path(cfg.out) / "features" / "train", folder)
    header = make_header(target_info(tiny_target[0], "tiny-random-llama", None), [2], "float32", "train", ds, 1,
                         cfg.features.batch_tokens, cfg.features.shard_tokens)
    with pytest.raises(StoreError, match=r"another extraction \('layer_ids' is \[1, 3\], this run has \[2\]\)"):
        extract_split(tiny_target[0], ds, folder, header, show_progress=False)


def test_verify_cli_names_bad_shard(store, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cfg, _ = store
    copy = tmp_path / "features"
    shutil.copytree(Path(cfg.out) / "features", copy)
    with pytest.raises(SystemExit) as e:
        main(["verify", str(copy)])
    assert e.value.code == 0 and "OK" in capsys.readouterr().out
    bad = copy / "train" / shard_name(0, 1, 1)
    data = bytearray(bad.read_bytes())
    data[-4] ^= 0x55
    bad.write_bytes(bytes(data))
    with pytest.raises(SystemExit) as e:
        main(["verify", str(copy)])
    out = capsys.readouterr().out
    assert e.value.code == 1 and f"BAD {bad}: corrupted" in out


# ----------------------------------------------------------------------------------------------- runs
def _shards(root: Path) -> list[tuple[str, str]]:
    return [(s["file"], s["sha256"]) for s in read_json(root / "features" / "train" / MANIFEST)["shards"]]


def test_killed_extraction_resumes_to_the_same_store(tmp_path: Path) -> None:
    data = write_conversations(tmp_path / "c.jsonl", 60)
    cfg_file = write_config(tmp_path / "c.yaml", data)
    killed, oneshot = tmp_path / "killed", tmp_path / "oneshot"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    part = killed / "features" / "train" / part_name(0, 1)
    kill_when([sys.executable, "-m", "data.extract", "--config", str(cfg_file), "--out", str(killed), "--split",
               "train"], lambda: part.is_file() and bool(read_json(part)["shards"]), 240, cwd=ROOT, env=env)
    state = read_json(part)
    assert 1 <= len(state["shards"]) < state["planned_shards"], "the kill did not land half-way"
    assert not (killed / "features" / "train" / MANIFEST).exists()
    first = killed / "features" / "train" / shard_name(0, 1, 0)
    stamp = first.stat().st_mtime_ns

    cfg = load_config(cfg_file)
    cfg.out = str(killed)
    run(cfg, ("train",))
    cfg.out = str(oneshot)
    run(cfg, ("train",))
    assert first.stat().st_mtime_ns == stamp  # the finished shard was kept, not rewritten
    assert _shards(killed) == _shards(oneshot) and len(_shards(killed)) > 3
    assert not list((killed / "features" / "train").glob("*.tmp"))


def test_job_array_ranks_and_merge(tiny_target, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cfg = make_cfg(tmp_path / "run", write_conversations(tmp_path / "c.jsonl", 20), holdout=0.1)
    root = tmp_path / "run" / "features"
    run(cfg, ("train", "holdout"), 0, 2)
    assert not (root / "train" / MANIFEST).exists()
    with pytest.raises(SystemExit) as e:
        main(["merge", str(root)])
    assert e.value.code == 1 and "ranks [1] of 2 are missing" in capsys.readouterr().err
    run(cfg, ("train", "holdout"), 1, 2)  # the last job to finish merges
    m = read_json(root / "train" / MANIFEST)
    assert {s["file"][:17] for s in m["shards"]} == {"shard-r0000of0002", "shard-r0001of0002"}
    with pytest.raises(SystemExit) as e:
        main(["verify", str(root)])
    assert e.value.code == 0
    from data.target import load_tokenizer
    from data.tokenize import build_datasets

    train, _ = build_datasets(cfg, load_tokenizer(cfg.target))
    cfg.features.mode = "offline"
    off = open_featureset(cfg, train, tiny_target[0], [], "train")
    cfg.features.mode = "online"
    on = open_featureset(cfg, train, tiny_target[0], [], "train")
    a, b = off.batch(list(range(len(train)))), on.batch(list(range(len(train))))
    assert "aux" not in a and torch.allclose(a["last"], b["last"], atol=1e-5)


def test_disk_space_projection_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture) -> None:
    cfg = make_cfg(tmp_path / "run", write_conversations(tmp_path / "c.jsonl", 10))
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=1000))
    with pytest.raises(StoreError, match="the store needs .* but only 1.00 kB are free"):
        run(cfg, ("train",))
    assert "260 bytes per token" in capsys.readouterr().err  # hidden 64 x float32 + int32 argmax, printed before refusing
    assert not list((tmp_path / "run").glob("features/**/*.safetensors"))


@pytest.mark.distributed
def test_accelerate_launch_two_ranks(tmp_path: Path) -> None:
    data = write_conversations(tmp_path / "c.jsonl", 16)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "ACCELERATE_USE_CPU": "1"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "configs" / "accelerate" / "ddp.yaml"), "--num_processes", "2", "-m", "data.extract",
           "--config", str(write_config(tmp_path / "c.yaml", data)), "--out", str(tmp_path / "run"),
           "--split", "train"]
    res = run_proc(cmd, cwd=ROOT, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    m = read_json(tmp_path / "run" / "features" / "train" / MANIFEST)
    assert {s["file"][:17] for s in m["shards"]} == {"shard-r0000of0002", "shard-r0001of0002"}
    assert m["num_samples"] == 16


# ----------------------------------------------------------------------------------------------- device map
def test_device_map_target_gives_the_same_features(tiny_target) -> None:
    """target.device_map loads through accelerate's dispatch (on this CPU machine every layer lands on the
    CPU, so this checks the plumbing, not a split over GPUs): same features as the plain load."""
    from data.config import TargetConfig
    from data.features import forward_features
    from data.target import load_model

    plain = tiny_target[0]
    mapped = load_model(TargetConfig(name_or_path="tiny-random-llama", device="cpu", device_map="auto"))
    ids = torch.randint(3, 200, (2, 9), generator=torch.Generator().manual_seed(1))
    a, _ = forward_features(plain, ids, None, [1, 2])
    b, _ = forward_features(mapped, ids, None, [1, 2])
    assert torch.equal(a.last, b.last) and torch.equal(a.aux, b.aux)


def test_device_map_with_several_processes_is_refused(tmp_path: Path, monkeypatch) -> None:
    cfg = make_cfg(tmp_path / "run", write_conversations(tmp_path / "c.jsonl", 4))
    cfg.target.device_map = "auto"
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"target.device_map 'auto' .* one process per node .* not 2"):
        run(cfg)
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").rglob("*.safetensors"))
