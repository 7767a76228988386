"""The feature store on its own (no model): shard round trip, merge, verify and the reader naming bad shards.

    .venv/bin/python -m pytest -q tests/test_store.py
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from data.store import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    ShardWriter,
    StoreError,
    StoreReader,
    check_disk_space,
    merge,
    part_name,
    shard_name,
    torch_dtype,
    verify,
    write_json_atomic,
)

H, K = 8, 2  # hidden size, aux layers: rows are 8 * (1 + 2) = 24 wide


def _header(num_samples: int, num_tokens: int, world: int, dtype: str) -> dict:
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "split": "train",
        "target": {"name_or_path": "fake", "fingerprint": "f" * 16, "hidden_size": H, "num_hidden_layers": 4,
                   "vocab_size": 10},
        "layer_ids": [1, 3], "dtype": dtype, "hidden_size": H, "width": H * (1 + K),
        "bytes_per_token": H * (1 + K) * torch_dtype(dtype).itemsize, "data_fingerprint": "d" * 16,
        "num_samples": num_samples, "num_tokens": num_tokens, "world": world, "batch_tokens": 64,
        "shard_tokens": 10,
    }


def argmax_of(sample: torch.Tensor) -> torch.Tensor:
    """A stand-in for the target's argmax ids of a sample's rows (what the store keeps beside them)."""
    return sample[:, 0].mul(1000).round().to(torch.int32)


def make_store(folder: Path, samples: list[torch.Tensor], world: int = 2, per_shard: int = 3,
               dtype: str = "float32", finish: bool = True) -> None:
    """Rank r takes samples r, r+world, ...; shards of `per_shard` samples; part files; then merge."""
    folder.mkdir(parents=True, exist_ok=True)
    header = _header(len(samples), sum(s.shape[0] for s in samples), world, dtype)
    for rank in range(world):
        ids = list(range(rank, len(samples), world))
        chunks = [ids[i: i + per_shard] for i in range(0, len(ids), per_shard)]
        entries = []
        for k, chunk in enumerate(chunks):
            w = ShardWriter(folder / shard_name(rank, world, k), chunk, [samples[i].shape[0] for i in chunk],
                            H * (1 + K), torch_dtype(dtype), {"format": FORMAT})
            for i in chunk:  # two writes per sample: rows may arrive in any batch split
                w.write(samples[i][:1], argmax_of(samples[i])[:1])
                w.write(samples[i][1:], argmax_of(samples[i])[1:])
            entries.append(w.close())
        write_json_atomic(folder / part_name(rank, world), {**header, "rank": rank, "planned_shards": len(chunks),
                                                            "shards": entries, "complete": True})
    if finish:
        merge(folder)


@pytest.fixture
def samples() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(int(n), H * (1 + K), generator=g) for n in torch.randint(1, 9, (11,), generator=g)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_round_trip_random_access(tmp_path: Path, samples: list[torch.Tensor], dtype: str) -> None:
    make_store(tmp_path, samples, dtype=dtype)
    reader = StoreReader(tmp_path)
    assert len(reader) == 11 and reader.lengths == [s.shape[0] for s in samples]
    assert verify(tmp_path) == []
    for i in [7, 0, 10, 3, 3]:
        last, aux = reader.sample(i)
        want = samples[i].to(torch_dtype(dtype))
        assert last.dtype == torch_dtype(dtype)
        assert torch.equal(last, want[:, :H]) and torch.equal(aux, want[:, H:])
        assert torch.equal(reader.target_argmax(i), argmax_of(samples[i]))


def test_shard_is_plain_safetensors(tmp_path: Path, samples: list[torch.Tensor]) -> None:
    """Tokens packed back to back with an offsets index and the dataset row of each sample."""
    make_store(tmp_path, samples, world=1, per_shard=4)
    with safe_open(str(tmp_path / shard_name(0, 1, 1)), framework="pt") as f:
        offsets, ids, feats = f.get_tensor("offsets"), f.get_tensor("sample_ids"), f.get_tensor("features")
        argmax = f.get_tensor("target_argmax")
    assert ids.tolist() == [4, 5, 6, 7]
    assert offsets.tolist() == [0, *torch.tensor([samples[i].shape[0] for i in ids]).cumsum(0).tolist()]
    assert torch.equal(feats, torch.cat([samples[i] for i in ids]))
    assert argmax.dtype == torch.int32 and torch.equal(argmax, torch.cat([argmax_of(samples[i]) for i in ids]))


def test_writer_refuses_missing_rows_and_leaves_no_final_file(tmp_path: Path) -> None:
    w = ShardWriter(tmp_path / "s.safetensors", [0, 1], [3, 2], 4, torch.float32, {})
    w.write(torch.zeros(3, 4), torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="unexpected rows"):
        w.write(torch.zeros(2, 4), torch.zeros(1, dtype=torch.int32))  # an argmax id for every row
    with pytest.raises(ValueError, match="3 of 5 rows"):
        w.close()
    w.abort()
    assert list(tmp_path.iterdir()) == []


def test_truncated_shard_named_by_verify_and_reader(tmp_path: Path, samples: list[torch.Tensor]) -> None:
    make_store(tmp_path, samples)
    bad = tmp_path / shard_name(1, 2, 0)
    data = bad.read_bytes()
    bad.write_bytes(data[: len(data) - 50])
    problems = verify(tmp_path)
    assert len(problems) == 1 and bad.name in problems[0] and "truncated" in problems[0]
    with pytest.raises(StoreError, match=f"{bad.name}.*truncated"):
        StoreReader(tmp_path)


def test_corrupted_shard_named_by_verify_and_reader(tmp_path: Path, samples: list[torch.Tensor]) -> None:
    make_store(tmp_path, samples)
    bad = tmp_path / shard_name(0, 2, 1)
    data = bytearray(bad.read_bytes())
    data[-10] ^= 0xFF  # inside the argmax ids (the last tensor): same size, the header still parses
    bad.write_bytes(bytes(data))
    problems = verify(tmp_path)
    assert len(problems) == 1 and bad.name in problems[0] and "corrupted" in problems[0]
    assert verify(tmp_path, checksums=False) == []  # size-only checks cannot see it, checksums do
    reader = StoreReader(tmp_path)
    reader.sample(1)  # rank 1's shards are intact
    with pytest.raises(StoreError, match=f"{bad.name}.*corrupted"):
        reader.sample(6)  # rank 0's second shard holds samples 6, 8, 10
    assert torch.equal(StoreReader(tmp_path, verify_checksums=False).sample(1)[0], samples[1][:, :H])


def test_version_1_store_refused_with_the_fix(tmp_path: Path, samples: list[torch.Tensor]) -> None:
    """A store from before target_argmax is named and the fix given, not read with ids missing."""
    make_store(tmp_path, samples)
    manifest = tmp_path / MANIFEST
    write_json_atomic(manifest, {**json.loads(manifest.read_text()), "format_version": 1})
    with pytest.raises(StoreError, match=f"{MANIFEST}: format_version 1 .*target_argmax.*re-extract"):
        StoreReader(tmp_path)


def test_missing_shard_named(tmp_path: Path, samples: list[torch.Tensor]) -> None:
    make_store(tmp_path, samples)
    (tmp_path / shard_name(0, 2, 0)).unlink()
    assert "missing" in verify(tmp_path)[0]
    with pytest.raises(StoreError, match=shard_name(0, 2, 0)):
        StoreReader(tmp_path)


def test_merge_refuses_missing_or_unfinished_ranks(tmp_path: Path, samples: list[torch.Tensor]) -> None:
    make_store(tmp_path, samples, finish=False)
    with pytest.raises(StoreError, match="not finished or not merged"):
        StoreReader(tmp_path)
    other = tmp_path / "other"
    shutil.copytree(tmp_path, other, ignore=shutil.ignore_patterns("other"))
    (other / part_name(1, 2)).unlink()
    with pytest.raises(StoreError, match=r"ranks \[1\] of 2 are missing"):
        merge(other)
    part = tmp_path / part_name(0, 2)
    text = part.read_text().replace('"complete": true', '"complete": false')
    part.write_text(text)
    with pytest.raises(StoreError, match=f"{part.name}: rank 0 has"):
        merge(tmp_path)


def test_merge_lists_every_rank(tmp_path: Path, samples: list[torch.Tensor]) -> None:
    make_store(tmp_path, samples)
    from data.store import read_json

    m = read_json(tmp_path / MANIFEST)
    assert {s["file"].split("-")[1] for s in m["shards"]} == {"r0000of0002", "r0001of0002"}
    assert sum(s["num_samples"] for s in m["shards"]) == 11


def test_disk_space_refusal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=10**6))
    check_disk_space(tmp_path / "not" / "yet", 10**5)
    with pytest.raises(StoreError, match=r"needs 10.00 MB but only 1.00 MB are free"):
        check_disk_space(tmp_path / "not" / "yet", 10**7)


def test_no_store_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="no feature store here"):
        StoreReader(tmp_path)
