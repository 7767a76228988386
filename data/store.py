"""The offline feature store: sharded safetensors files, a manifest, a memory-mapped reader, and verify.

Written by `python -m data.extract` (see there), read by `data.featureset` during training, checked by
`python -m data.extract verify STORE`.

Layout of a store (one folder per tokenized split):

    STORE/                              cfg.features.store, relative to cfg.out unless absolute
      store.json                        the splits this store holds (verify fails on a missing one)
      train/
        manifest.json                   the whole split: written last, by merging the part files
        part-r0000of0002.json           one per extraction rank: its header, its finished shards
        part-r0001of0002.json
        shard-r0000of0002-00000.safetensors
        shard-r0000of0002-00001.safetensors
        shard-r0001of0002-00000.safetensors
        ...
      holdout/
        ...

Each shard is one safetensors file holding whole samples, tokens packed back to back (no padding):

    offsets     int64 [n+1]      row of sample j's first token is offsets[j], its last is offsets[j+1]-1
    sample_ids  int64 [n]        the dataset row index of each sample in the shard
    features    dtype [N, W]     one row per token; W = H * (1 + len(layer_ids)):
                                 columns [0, H) are `last` (final post-norm hidden state), columns
                                 [H, W) are `aux` (hidden_states[i] for the layer ids, ascending)
    target_argmax int32 [N]      the target's greedy next token at each position (argmax of its logits):
                                 EAGLE-3 masks and scores with it, so training never runs the full-vocab
                                 lm_head (format_version 2; a version-1 store is refused: re-extract)

`last` and `aux` share one tensor so that a shard is written strictly front to back, batch after batch,
hashing as it goes, with only one batch of features in memory (the header is written first: every size
is known from the extraction plan); the argmax ids, 4 bytes a token, are kept and written last. The file
is written under `NAME.tmp`, fsynced, then renamed, so a final name always means a complete file; a
killed run leaves at most a `.tmp` that the next run deletes.

manifest.json (and each part file) records: format and version, split, the target (name, fingerprint
from heads.base.target_fingerprint, revision/commit where known, hidden size, layers, vocab), layer ids,
dtype, hidden size, row width, bytes per token, the tokenized data's fingerprint, sample and token
counts, the extraction plan's settings (ranks, batch and shard tokens), and the shard list, each with
its sample and token counts, byte size and sha256.

    reader = StoreReader("runs/x/features/train")    # checks sizes; hashes each shard on first read
    last, aux = reader.sample(17)                    # [n, H], [n, k*H] in the stored dtype
    ids = reader.target_argmax(17)                   # [n] int32
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open

from data.cli import UserError, write_atomic
from heads.base import HeadMismatchError, sha256_file  # noqa: F401  (sha256_file: re-exported)

if TYPE_CHECKING:
    from data.config import RunConfig

FORMAT = "draftheads-features"
FORMAT_VERSION = 2  # 2: shards hold target_argmax
MANIFEST = "manifest.json"
STORE_INDEX = "store.json"  # STORE/store.json: {"format", "splits": [...]}, the splits verify must find

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ST_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64"}
ARGMAX_BYTES = 4  # int32 target_argmax per token

# Keys that must agree between the part files of one split (everything except rank and shard list).
HEADER_KEYS = (
    "format", "format_version", "split", "target", "layer_ids", "dtype", "hidden_size", "width",
    "bytes_per_token", "data_fingerprint", "num_samples", "num_tokens", "world", "batch_tokens",
    "shard_tokens",
)


class StoreError(UserError, ValueError):
    """The store is missing, incomplete, truncated or corrupted; the message names the file."""


class StoreMismatchError(HeadMismatchError):
    """The store was made for another target, other layer ids, or other tokenized data."""


def store_root(cfg: RunConfig) -> Path:
    """cfg.features.store, relative to cfg.out unless absolute."""
    p = Path(cfg.features.store)
    return p if p.is_absolute() else Path(cfg.out) / p


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"features.dtype '{name}' is not one of {', '.join(DTYPES)}")
    return DTYPES[name]


def bytes_per_token(hidden_size: int, num_aux_layers: int, dtype: str) -> int:
    """Stored bytes per token: (1 + k) feature vectors of H values and the argmax id (the offsets index is
    negligible)."""
    return hidden_size * (1 + num_aux_layers) * torch_dtype(dtype).itemsize + ARGMAX_BYTES


def shard_name(rank: int, world: int, index: int) -> str:
    return f"shard-r{rank:04d}of{world:04d}-{index:05d}.safetensors"


def part_name(rank: int, world: int) -> str:
    return f"part-r{rank:04d}of{world:04d}.json"


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write JSON under a unique temp name, fsync, then rename (concurrent writers of the same content are safe)."""
    write_atomic(path, json.dumps(obj, indent=1))


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except OSError as e:
        raise StoreError(f"{path}: cannot read ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise StoreError(f"{path}: invalid JSON ({e})") from None


def free_bytes(folder: Path) -> int:
    """Free space on the disk holding `folder` (or its nearest existing parent)."""
    p = folder.resolve()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def human_bytes(n: float) -> str:
    """1234567 -> '1.23 MB' (never '0.00 GB' for a small but nonzero size)."""
    if abs(n) < 1000:
        return f"{n:.0f} B"
    for unit in ("kB", "MB", "GB"):
        n /= 1000
        if abs(n) < 1000:
            return f"{n:.2f} {unit}"
    return f"{n / 1000:.2f} TB"


def check_disk_space(folder: Path, needed: int) -> None:
    """Refuse (StoreError) when the disk holding `folder` has less than `needed` bytes free."""
    free = free_bytes(folder)
    if free < needed:
        raise StoreError(
            f"{folder}: the store needs {human_bytes(needed)} but only {human_bytes(free)} are free on that disk "
            f"(free space, use features.dtype=bfloat16, fewer samples (data.max_samples), or features.mode=online)"
        )


# ----------------------------------------------------------------------------------------------- writing
class ShardWriter:
    """Write one shard front to back: header and index first (sizes come from the plan), then feature rows,
    then the argmax ids (collected as the rows arrive).

    The bytes are hashed as they are written; `close()` checks every planned row arrived, fsyncs, renames
    `NAME.tmp` to `NAME` and returns the shard's manifest entry.
    """

    def __init__(self, path: Path, sample_ids: list[int], lengths: list[int], width: int, dtype: torch.dtype,
                 metadata: dict[str, str]):
        if not sample_ids or min(lengths) < 1:
            raise ValueError(f"{path.name}: a shard needs at least one sample and no empty sample")
        self.path, self.tmp = path, path.with_name(path.name + ".tmp")
        self.num_tokens, self.width, self.dtype = int(sum(lengths)), width, dtype
        offsets = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0)
        ids = torch.tensor(sample_ids, dtype=torch.int64)
        n = self.num_samples = len(sample_ids)
        spans = [8 * (n + 1), 8 * n, self.num_tokens * width * dtype.itemsize, self.num_tokens * ARGMAX_BYTES]
        ends = [sum(spans[: i + 1]) for i in range(4)]
        header = {
            "__metadata__": metadata,
            "offsets": {"dtype": "I64", "shape": [n + 1], "data_offsets": [0, ends[0]]},
            "sample_ids": {"dtype": "I64", "shape": [n], "data_offsets": [ends[0], ends[1]]},
            "features": {"dtype": _ST_DTYPE[dtype], "shape": [self.num_tokens, width],
                         "data_offsets": [ends[1], ends[2]]},
            "target_argmax": {"dtype": "I32", "shape": [self.num_tokens], "data_offsets": [ends[2], ends[3]]},
        }
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # safetensors pads the header to 8-byte alignment
        self.size = 8 + len(raw) + ends[3]
        self.rows = 0
        self.argmax: list[torch.Tensor] = []
        self.sha = hashlib.sha256()
        self.file = open(self.tmp, "wb")
        self._put(struct.pack("<Q", len(raw)) + raw)
        self._put(offsets.numpy().tobytes())
        self._put(ids.numpy().tobytes())

    def _put(self, data: Any) -> None:
        self.sha.update(data)
        self.file.write(data)

    def write(self, rows: torch.Tensor, argmax: torch.Tensor) -> None:
        """Append feature rows [n, W] (tokens in the planned order), converted to the store dtype, and the
        target's argmax id [n] of each."""
        if rows.shape[-1] != self.width or self.rows + rows.shape[0] > self.num_tokens \
                or tuple(argmax.shape) != (rows.shape[0],):
            raise ValueError(f"{self.path.name}: unexpected rows {tuple(rows.shape)} / argmax "
                             f"{tuple(argmax.shape)} after {self.rows} rows")
        data = rows.detach().to("cpu", self.dtype).contiguous().view(torch.uint8).reshape(-1).numpy()
        self._put(memoryview(data))
        self.argmax.append(argmax.detach().to("cpu", torch.int32))
        self.rows += rows.shape[0]

    def close(self) -> dict:
        if self.rows != self.num_tokens:
            raise ValueError(f"{self.path.name}: {self.rows} of {self.num_tokens} rows written")
        self._put(memoryview(torch.cat(self.argmax).contiguous().view(torch.uint8).numpy()))
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        self.tmp.replace(self.path)
        return {"file": self.path.name, "num_samples": self.num_samples, "num_tokens": self.num_tokens, "bytes": self.size,
                "sha256": self.sha.hexdigest()}

    def abort(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)


def shard_index(path: Path) -> dict[str, torch.Tensor]:
    """The offsets and sample ids of one shard file (read through the safetensors header)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return {"offsets": f.get_tensor("offsets"), "sample_ids": f.get_tensor("sample_ids")}
    except Exception as e:  # safetensors raises its own error types for truncated or damaged files
        raise StoreError(f"{path}: unreadable shard ({e})") from None


# ----------------------------------------------------------------------------------------------- merging
def part_files(split_dir: Path) -> list[Path]:
    return sorted(split_dir.glob("part-r*of*.json"))


def merge(split_dir: str | Path) -> dict:
    """Merge the part files of one split into manifest.json (all ranks must be complete and agree).

    Run by rank 0 after the last rank finishes, by each job of a job array when it sees all parts done,
    or by hand: `python -m data.extract merge STORE`. Raises StoreError naming the missing or odd part.
    """
    folder = Path(split_dir)
    parts = part_files(folder)
    if not parts:
        raise StoreError(f"{folder}: no part-r*.json files (nothing was extracted here)")
    metas = [read_json(p) for p in parts]
    first = metas[0]
    world = int(first["world"])
    for p, m in zip(parts, metas):
        for key in HEADER_KEYS:
            if m.get(key) != first.get(key):
                raise StoreError(f"{p}: '{key}' differs from {parts[0].name} (parts of different extractions)")
    ranks = sorted(int(m["rank"]) for m in metas)
    if ranks != list(range(world)):
        missing = sorted(set(range(world)) - set(ranks))
        raise StoreError(f"{folder}: part files of ranks {missing} of {world} are missing (those jobs did not run)")
    for p, m in zip(parts, metas):
        if not m.get("complete"):
            raise StoreError(f"{p}: rank {m['rank']} has {len(m['shards'])} of {m['planned_shards']} shards "
                             f"(run the extraction again to finish it)")
    shards = [s for m in sorted(metas, key=lambda m: m["rank"]) for s in m["shards"]]
    samples = sum(s["num_samples"] for s in shards)
    tokens = sum(s["num_tokens"] for s in shards)
    if samples != first["num_samples"] or tokens != first["num_tokens"]:
        raise StoreError(f"{folder}: shards hold {samples} samples / {tokens} tokens, "
                         f"expected {first['num_samples']} / {first['num_tokens']}")
    manifest = {k: first[k] for k in HEADER_KEYS}
    manifest["shards"] = shards
    write_json_atomic(folder / MANIFEST, manifest)
    return manifest


def shard_path(folder: Path, entry: dict, source: Path) -> Path:
    """The file of a shard entry, which must be a plain file name inside `folder` (no path, no `..`)."""
    name = entry.get("file") if isinstance(entry, dict) else None
    if not isinstance(name, str) or not name or Path(name).name != name or name in (".", ".."):
        raise StoreError(f"{source}: shard file {name!r} is not a plain file name inside {folder}")
    return folder / name


def read_manifest(split_dir: str | Path) -> dict:
    """The manifest of one split; a clear StoreError when the folder is not a finished store."""
    folder = Path(split_dir)
    path = folder / MANIFEST
    if not path.is_file():
        if part_files(folder):
            raise StoreError(f"{folder}: extraction not finished or not merged (no {MANIFEST}; "
                             f"run the extraction again, or `python -m data.extract merge {folder.parent}`)")
        raise StoreError(f"{folder}: no feature store here (no {MANIFEST}; run `python -m data.extract --config ...`)")
    manifest = read_json(path)
    if manifest.get("format") != FORMAT:
        raise StoreError(f"{path}: not a draftheads feature store manifest")
    version = int(manifest.get("format_version", -1))
    if version > FORMAT_VERSION:
        raise StoreError(f"{path}: format_version {version} is newer than this code ({FORMAT_VERSION})")
    if version < FORMAT_VERSION:
        raise StoreError(f"{path}: format_version {version} store has no target_argmax (added in version "
                         f"{FORMAT_VERSION}); delete {folder} and re-extract (python -m data.extract --config ...)")
    shards = manifest.get("shards")
    if not isinstance(shards, list):
        raise StoreError(f"{path}: no shard list")
    for s in shards:
        shard_path(folder, s, path)
        if not isinstance(s.get("sha256"), str) or not isinstance(s.get("bytes"), int):
            raise StoreError(f"{path}: shard {s.get('file')!r} has no sha256 or byte size")
    return manifest


def record_splits(root: Path, splits: Iterable[str]) -> None:
    """Add `splits` to STORE/store.json, the list of splits this store must hold (verify checks each)."""
    path = root / STORE_INDEX
    have = set(read_json(path).get("splits", [])) if path.is_file() else set()
    write_json_atomic(path, {"format": FORMAT, "splits": sorted(have | set(splits))})


def named_splits(root: Path) -> list[str]:
    """The splits STORE/store.json names (empty when there is no store.json: a split folder or an old store)."""
    path = Path(root) / STORE_INDEX
    if not path.is_file():
        return []
    splits = read_json(path).get("splits")
    if not isinstance(splits, list) or not all(isinstance(s, str) and s and Path(s).name == s for s in splits):
        raise StoreError(f"{path}: 'splits' must be a list of split folder names")
    return splits


def split_dirs(store: str | Path) -> list[Path]:
    """The split folders of a store: STORE itself when it is one, else its subfolders that hold parts."""
    root = Path(store)
    if (root / MANIFEST).is_file() or part_files(root):
        return [root]
    found = sorted(d for d in root.iterdir() if d.is_dir() and ((d / MANIFEST).is_file() or part_files(d))) \
        if root.is_dir() else []
    if not found:
        raise StoreError(f"{root}: no feature store here (no {MANIFEST} or part files in it or its subfolders)")
    return found


# ----------------------------------------------------------------------------------------------- checking
def verify(split_dir: str | Path, checksums: bool = True) -> list[str]:
    """Problems found in one split (empty list = sound): missing, truncated or corrupted shards, by name.

    Checks each listed shard's size, then (with `checksums`) its sha256, then that the shards' indexes
    cover every sample exactly once with the manifest's token count.
    """
    folder = Path(split_dir)
    manifest = read_manifest(folder)
    problems: list[str] = []
    seen: list[torch.Tensor] = []
    tokens = 0
    for s in manifest["shards"]:
        path = shard_path(folder, s, folder / MANIFEST)
        if not path.is_file():
            problems.append(f"{path}: missing")
            continue
        size = path.stat().st_size
        if size != s["bytes"]:
            problems.append(f"{path}: truncated or padded ({size} bytes, manifest says {s['bytes']})")
            continue
        if checksums and sha256_file(path) != s["sha256"]:
            problems.append(f"{path}: corrupted (sha256 differs from the manifest)")
            continue
        try:
            idx = shard_index(path)
        except StoreError as e:
            problems.append(str(e))
            continue
        seen.append(idx["sample_ids"])
        tokens += int(idx["offsets"][-1])
    if not problems:
        ids = torch.cat(seen) if seen else torch.zeros(0, dtype=torch.int64)
        if ids.numel() != manifest["num_samples"] or not torch.equal(ids.sort().values, torch.arange(ids.numel())):
            problems.append(f"{folder}: shards do not hold each of the {manifest['num_samples']} samples exactly once")
        if tokens != manifest["num_tokens"]:
            problems.append(f"{folder}: shards hold {tokens} tokens, manifest says {manifest['num_tokens']}")
    return problems


# ----------------------------------------------------------------------------------------------- reading
class StoreReader:
    """Random access by sample over one split, memory-mapped through safetensors' safe_open.

    Opening checks every shard's size against the manifest (a truncated shard is named at once) and reads
    the small offsets/sample_ids index of each. With `verify_checksums`, each shard is hashed the first
    time a sample is read from it, so a corrupted shard is named before any of its data is used (one
    sequential read per shard per process). The reader pickles without its open handles (DataLoader workers).
    """

    def __init__(self, split_dir: str | Path, verify_checksums: bool = True):
        self.folder = Path(split_dir)
        self.manifest = read_manifest(self.folder)
        self.verify_checksums = verify_checksums
        m = self.manifest
        self.hidden_size, self.width = int(m["hidden_size"]), int(m["width"])
        self.layer_ids = list(m["layer_ids"])
        self.dtype = torch_dtype(m["dtype"])
        n = int(m["num_samples"])
        self._shard = torch.full((n,), -1, dtype=torch.int64)
        self._start = torch.zeros(n, dtype=torch.int64)
        self._len = torch.zeros(n, dtype=torch.int64)
        for k, s in enumerate(m["shards"]):
            path = shard_path(self.folder, s, self.folder / MANIFEST)
            if not path.is_file():
                raise StoreError(f"{path}: shard listed in {MANIFEST} is missing")
            if path.stat().st_size != s["bytes"]:
                raise StoreError(f"{path}: truncated or damaged ({path.stat().st_size} bytes, "
                                 f"{MANIFEST} says {s['bytes']}); re-extract or check with `python -m data.extract verify`")
            idx = shard_index(path)
            ids, off = idx["sample_ids"], idx["offsets"]
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n):
                raise StoreError(f"{path}: sample ids outside 0..{n - 1}")
            self._shard[ids], self._start[ids], self._len[ids] = k, off[:-1], off[1:] - off[:-1]
        if bool((self._shard < 0).any()):
            raise StoreError(f"{self.folder}: sample {int((self._shard < 0).nonzero()[0])} is in no shard")
        self._handles: dict[int, tuple[Any, Any]] = {}
        self._verified: set[int] = set()

    def __len__(self) -> int:
        return int(self._shard.numel())

    @property
    def lengths(self) -> list[int]:
        return self._len.tolist()

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_handles"] = {}
        return state

    def _slices(self, k: int) -> tuple[Any, Any]:
        """Shard k's (features, target_argmax) slices, opened (and hashed) on first use."""
        if k not in self._handles:
            entry = self.manifest["shards"][k]
            path = shard_path(self.folder, entry, self.folder / MANIFEST)
            if self.verify_checksums and k not in self._verified:
                if sha256_file(path) != entry["sha256"]:
                    raise StoreError(f"{path}: corrupted (sha256 differs from {MANIFEST}); "
                                     f"re-extract it or check with `python -m data.extract verify`")
                self._verified.add(k)
            try:
                f = safe_open(str(path), framework="pt")
                self._handles[k] = (f.get_slice("features"), f.get_slice("target_argmax"))
            except Exception as e:  # safetensors' own error types
                raise StoreError(f"{path}: unreadable shard ({e})") from None
        return self._handles[k]

    def sample(self, i: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(last [n, H], aux [n, k*H] or None) of sample i, in the stored dtype."""
        k, a = int(self._shard[i]), int(self._start[i])
        rows = self._slices(k)[0][a: a + int(self._len[i])]
        h = self.hidden_size
        return rows[:, :h], (rows[:, h:] if self.width > h else None)

    def target_argmax(self, i: int) -> torch.Tensor:
        """The target's greedy next token [n] (int32) at each position of sample i."""
        k, a = int(self._shard[i]), int(self._start[i])
        return self._slices(k)[1][a: a + int(self._len[i])]
