"""Extract the frozen target's features into the offline store (layout: see data/store.py).

    python -m data.extract --config configs/tiny-eagle.yaml --out runs/tiny      # both splits
    python -m data.extract --config C --split train                               # one split
    accelerate launch --num_processes 4 -m data.extract --config C                # one shard set per rank
    python -m data.extract --config C --shard-index I --num-shards N              # job I of an array of N
    python -m data.extract merge STORE      # write manifest.json from the part files of all jobs
    python -m data.extract verify STORE     # every split store.json names; sizes, checksums, coverage; names each bad shard
    python -m data.extract --config C --features.engine=vllm    # the same store, captured by vLLM (`vllm` extra)

The layers captured are the head's (`feature_layers(cfg.head, target_config)` of its family); the final
post-norm hidden state and the target's argmax next token are always stored, logits never (trainers
recompute what they need from `last` with the target's lm_head).

Plan (deterministic, so a killed run resumes exactly where it stopped and gives the same bytes as a
single run): samples are ordered longest first (ties by index; long batches first expose out-of-memory at
once), rank g of G takes every G-th of them, its samples are cut into padded batches of at most
features.batch_tokens tokens, and consecutive batches into shards of at least features.shard_tokens real
tokens. A rerun skips the shards its part file lists (and adopts finished shards it does not list yet),
deletes leftover `.tmp` files, and redoes only the shard that was in flight.
Engines (features.engine): transformers runs one padded forward with capture hooks per batch
(transformers_source); vllm hands each batch's rows to vLLM's extract_hidden_states (data/vllm_capture.py)
after a numerics check against transformers. Both feed the same plan, shard writer, part files and resume;
STORE/extraction_report.{json,md} records the engine, the time per split and (vllm) the numerics table.
Under `accelerate launch` G is the number of processes; with --num-shards N (a job array) G is N times that.
Before any work, the bytes per token and the projected store size are printed, and the run is refused
when the disk has less free space than what is left to write.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import datasets
import torch
from torch import nn
from tqdm import tqdm

from data.cli import cli_main, write_atomic
from data.config import ConfigError, RunConfig, check_layer_ids, parse_args
from data.features import forward_features, greedy_ids
from data.files import FolderLock
from data.store import (
    FORMAT,
    FORMAT_VERSION,
    HEADER_KEYS,
    MANIFEST,
    STORE_INDEX,
    ShardWriter,
    StoreError,
    StoreMismatchError,
    bytes_per_token,
    check_disk_space,
    free_bytes,
    merge,
    named_splits,
    part_files,
    part_name,
    read_json,
    record_splits,
    sha256_file,
    shard_index,
    shard_name,
    split_dirs,
    store_root,
    torch_dtype,
    verify,
    write_json_atomic,
)
from data.target import load_config_only, load_target, resolve_device, text_config
from data.tokenize import build_datasets, collate, dataset_fingerprint
from heads import registry
from heads.base import check_target, target_record

SPLITS = ("train", "holdout")


def head_layer_ids(cfg: RunConfig, target_config: Any) -> list[int]:
    """The hidden_states indices the configured head family asks for (may be empty: `last` only)."""
    family = registry.get(cfg.head.family)
    return [int(i) for i in family.feature_layers(cfg.head, target_config)]


def plan_shards(lengths: list[int], rank: int, world: int, batch_tokens: int, shard_tokens: int) -> list[list[list[int]]]:
    """This rank's work: shards -> batches -> sample indices (see the module docstring).

    A batch holds samples while (count x its longest length) <= batch_tokens (a longer sample goes alone);
    a shard closes after the batch that brings its real tokens to >= shard_tokens.
    Example: lengths [5, 9, 2, 7, 3], world 2, batch_tokens 16, shard_tokens 10. Longest first:
    [1, 3, 0, 4, 2] (lengths 9 7 5 3 2). Rank 0 takes [1, 0, 2], rank 1 takes [3, 4].
    Rank 0: batches [1] (9 x 1; adding sample 0 would pad to 18 > 16), [0, 2] (5 x 2 = 10);
    shards [[[1], [0, 2]]] (9 < 10 tokens after the first batch, 16 after the second).
    """
    if batch_tokens < 1 or shard_tokens < 1:
        raise ValueError("features.batch_tokens and features.shard_tokens must be positive")
    if lengths and min(lengths) < 1:
        raise ValueError(f"sample {lengths.index(min(lengths))} has no tokens")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))[rank::world]
    batches: list[list[int]] = []
    for i in order:
        # Lengths only decrease along `order`, so the batch's first sample is its longest.
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    shards: list[list[list[int]]] = []
    tokens = shard_tokens
    for b in batches:
        if tokens >= shard_tokens:
            shards.append([])
            tokens = 0
        shards[-1].append(b)
        tokens += sum(lengths[i] for i in b)
    return shards


def target_info(model: nn.Module, name: str, revision: str | None) -> dict:
    """What the manifest records about the target (what the reader checks against)."""
    tc = text_config(model.config)
    return {**target_record(tc, model.get_input_embeddings().weight, name), "revision": revision,
            "commit_hash": getattr(model.config, "_commit_hash", None)}


def make_header(target: dict, layer_ids: list[int], dtype: str, split: str, dataset: datasets.Dataset,
                world: int, batch_tokens: int, shard_tokens: int) -> dict:
    """The store-wide fields every part file and the manifest of one split carry (store.HEADER_KEYS)."""
    h = target["hidden_size"]
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "split": split,
        "target": target,
        "layer_ids": list(layer_ids),
        "dtype": dtype,
        "hidden_size": h,
        "width": h * (1 + len(layer_ids)),
        "bytes_per_token": bytes_per_token(h, len(layer_ids), dtype),
        "data_fingerprint": dataset_fingerprint(dataset),
        "num_samples": len(dataset),
        "num_tokens": int(sum(dataset["length"])) if len(dataset) else 0,
        "world": world,
        "batch_tokens": batch_tokens,
        "shard_tokens": shard_tokens,
    }


def _refuse_foreign(split_dir: Path, header: dict) -> None:
    """Refuse to add to a folder that holds another extraction (naming the first differing field)."""
    others = ([split_dir / MANIFEST] if (split_dir / MANIFEST).is_file() else []) + part_files(split_dir)
    for path in others:
        meta = read_json(path)
        check_target(meta.get("target"), header["target"], str(path), error=StoreMismatchError)
        for key in HEADER_KEYS:
            if meta.get(key) != header[key]:
                raise StoreError(
                    f"{path}: this folder holds another extraction ('{key}' is {meta.get(key)!r}, this run has "
                    f"{header[key]!r}); delete {split_dir} or set features.store to another folder"
                )


def _done_shards(split_dir: Path, part: dict, planned: list[list[list[int]]], rank: int, world: int) -> list[dict]:
    """Finished shards to keep: those the part file lists (size checked), then finished files it does not
    list yet (a kill between rename and part update), adopted after checking their samples match the plan."""
    done: list[dict] = []
    for entry in part.get("shards", []):
        path = split_dir / entry["file"]
        if entry["file"] != shard_name(rank, world, len(done)) or not path.is_file() or path.stat().st_size != entry["bytes"]:
            break
        done.append(entry)
    while len(done) < len(planned):
        path = split_dir / shard_name(rank, world, len(done))
        if not path.is_file():
            break
        want = [i for b in planned[len(done)] for i in b]
        try:
            idx = shard_index(path)
        except StoreError:
            break
        if idx["sample_ids"].tolist() != want:
            break
        done.append({"file": path.name, "num_samples": len(want), "num_tokens": int(idx["offsets"][-1]),
                     "bytes": path.stat().st_size, "sha256": sha256_file(path)})
    for path in split_dir.glob(f"shard-r{rank:04d}of{world:04d}-*.safetensors"):
        if int(path.stem.rsplit("-", 1)[1]) >= len(done):
            path.unlink()  # a finished file we could not adopt: it is redone
    return done


# A feature source: a batch of dataset rows (columns input_ids, loss_mask) -> (cat(last, aux) [N, width],
# the target's argmax [N]), the rows' tokens packed sample after sample without padding.
FeatureSource = Callable[[dict], tuple[torch.Tensor, torch.Tensor]]


def transformers_source(model: nn.Module, layer_ids: list[int], pad_id: int = 0) -> FeatureSource:
    """The transformers engine: one padded forward with capture hooks per batch (data.features)."""
    device = next(model.parameters()).device

    def source(rows: dict) -> tuple[torch.Tensor, torch.Tensor]:
        col = collate([{"input_ids": a, "loss_mask": m} for a, m in zip(rows["input_ids"], rows["loss_mask"])], pad_id)
        att = col["attention_mask"].to(device)
        feats, _ = forward_features(model, col["input_ids"].to(device), att, layer_ids)
        x = feats.last if feats.aux is None else torch.cat([feats.last, feats.aux], dim=-1)
        # Boolean indexing walks [B, T] row-major: sample after sample, tokens in order, padding dropped:
        # exactly the packed order the shard's offsets describe.
        keep = att.bool()
        return x[keep], greedy_ids(model, feats.last[keep])

    return source


def extract_split(model: nn.Module, dataset: datasets.Dataset, split_dir: Path, header: dict, rank: int = 0,
                  pad_id: int = 0, show_progress: bool = True, source: FeatureSource | None = None) -> dict:
    """Write (or finish) this rank's shards of one split and its part file; returns the part dict.

    source: where the features come from (default: transformers_source(model, ...); features.engine vllm:
    data.vllm_capture.feature_source); the shards, part file and resume are the same for every source.
    Locked per shard set (rank of world): a second extraction of the same shards is refused with one line
    (it would delete the first one's in-flight `.tmp`); other ranks and jobs of the array run beside it."""
    split_dir.mkdir(parents=True, exist_ok=True)
    _refuse_foreign(split_dir, header)
    world = int(header["world"])
    source = source or transformers_source(model, list(header["layer_ids"]), pad_id)
    with FolderLock(split_dir, f"an extraction of shard set r{rank:04d}of{world:04d}",
                    name=f".lock-r{rank:04d}of{world:04d}"):
        return _extract_locked(source, dataset, split_dir, header, rank, show_progress)


def _extract_locked(source: FeatureSource, dataset: datasets.Dataset, split_dir: Path, header: dict, rank: int,
                    show_progress: bool) -> dict:
    """extract_split's work, under its lock."""
    world, layer_ids = int(header["world"]), list(header["layer_ids"])
    lengths = list(dataset["length"]) if len(dataset) else []
    planned = plan_shards(lengths, rank, world, int(header["batch_tokens"]), int(header["shard_tokens"]))
    for tmp in split_dir.glob(f"shard-r{rank:04d}of{world:04d}-*.tmp"):
        tmp.unlink()  # the shard that was in flight when a previous run died
    part_path = split_dir / part_name(rank, world)
    part = read_json(part_path) if part_path.is_file() else {}
    part = {**header, "rank": rank, "planned_shards": len(planned),
            "shards": _done_shards(split_dir, part, planned, rank, world), "complete": False}
    part["complete"] = len(part["shards"]) == len(planned)
    write_json_atomic(part_path, part)
    todo = planned[len(part["shards"]):]
    total = sum(lengths[i] for s in todo for b in s for i in b)
    dtype = torch_dtype(header["dtype"])
    meta = {"format": FORMAT, "split": header["split"], "rank": str(rank), "world": str(world),
            "layer_ids": json.dumps(layer_ids), "dtype": header["dtype"], "hidden_size": str(header["hidden_size"]),
            "target_fingerprint": header["target"]["fingerprint"], "data_fingerprint": header["data_fingerprint"]}
    bar = tqdm(total=total, unit="tok", unit_scale=True, desc=f"extract {header['split']} r{rank}",
               disable=not show_progress or total == 0)
    for shard in todo:
        k = len(part["shards"])
        ids = [i for b in shard for i in b]
        writer = ShardWriter(split_dir / shard_name(rank, world, k), ids, [lengths[i] for i in ids],
                             int(header["width"]), dtype, {**meta, "index": str(k)})
        try:
            for batch in shard:
                x, top = source(dataset[batch])
                writer.write(x.to(dtype), top)
                bar.update(int(x.shape[0]))
            entry = writer.close()
        except BaseException:
            writer.abort()
            raise
        part["shards"].append(entry)
        part["complete"] = len(part["shards"]) == len(planned)
        write_json_atomic(part_path, part)
        if show_progress:
            bar.write(f"wrote {entry['file']} ({entry['num_samples']} samples, {entry['num_tokens']} tokens, "
                      f"{entry['bytes'] / 1e6:.1f} MB)", file=sys.stderr)
    bar.close()
    return part


def _existing_bytes(split_dir: Path, header: dict) -> int:
    """Bytes of finished shards already in a folder of the same extraction (not to be written again)."""
    if not split_dir.is_dir():
        return 0
    return sum(p.stat().st_size for p in split_dir.glob(f"shard-r*of{int(header['world']):04d}-*.safetensors"))


def run(cfg: RunConfig, splits: tuple[str, ...] = SPLITS, shard_index_: int = 0, num_shards: int = 1) -> list[Path]:
    """Extract the configured splits (this process's share); returns the split folders."""

    if not 0 <= shard_index_ < num_shards:
        raise ConfigError(f"--shard-index {shard_index_} must be in 0..{num_shards - 1}")
    state = None
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1  # under accelerate launch / torchrun
    if cfg.target.device_map and launched:
        raise ConfigError(f"target.device_map '{cfg.target.device_map}' spreads one target over all GPUs of its "
                         f"process; run one process per node (accelerate launch --num_processes 1; "
                         f"extract.sbatch: PROCS_PER_NODE=1), not {os.environ['WORLD_SIZE']}")
    if cfg.features.engine == "vllm" and launched:
        raise ConfigError("features.engine 'vllm': one process per job holds vLLM (its GPUs via "
                          "features.vllm_tensor_parallel_size); run python -m data.extract (data parallel: a job "
                          f"array, --shard-index/--num-shards), not {os.environ['WORLD_SIZE']} launched processes")
    if launched:
        from accelerate import PartialState

        # cpu=True selects the gloo backend when the target runs on the CPU (PartialState alone ignores
        # ACCELERATE_USE_CPU and would start one independent single process per rank).
        state = PartialState(cpu=resolve_device(cfg.target.device).type == "cpu")
        if cfg.target.device == "auto":
            cfg.target.device = str(state.device)  # one GPU per rank, not all ranks on cuda:0
    nproc, pidx = (state.num_processes, state.process_index) if state else (1, 0)
    rank, world = shard_index_ * nproc + pidx, num_shards * nproc
    loud = pidx == 0
    check_layer_ids(cfg, text_config(load_config_only(cfg.target)))  # before the weights load
    model, tok, _ = load_target(cfg.target)
    layer_ids = head_layer_ids(cfg, text_config(model.config))
    with state.main_process_first() if state else nullcontext():  # tokenized cache: written once, then read
        train, holdout = build_datasets(cfg, tok)
    data = {"train": train, "holdout": holdout}
    target = target_info(model, cfg.target.name_or_path, cfg.target.revision)
    root = store_root(cfg)
    headers = {s: make_header(target, layer_ids, cfg.features.dtype, s, data[s], world, cfg.features.batch_tokens,
                              cfg.features.shard_tokens) for s in splits}
    bpt = bytes_per_token(target["hidden_size"], len(layer_ids), cfg.features.dtype)
    tokens = sum(h["num_tokens"] for h in headers.values())
    # Headers of the safetensors files and the offsets index add ~1%: counted in the projection.
    projected = int(tokens * bpt * 1.01)
    left = max(0, projected - sum(_existing_bytes(root / s, headers[s]) for s in splits))
    if loud:
        print(f"features: {len(layer_ids)} aux layers {layer_ids} + last, hidden {target['hidden_size']}, "
              f"{cfg.features.dtype}: {bpt} bytes per token; {tokens} tokens ({', '.join(splits)}) -> projected "
              f"store {projected / 1e9:.3f} GB, {left / 1e9:.3f} GB left to write, "
              f"{free_bytes(root) / 1e9:.1f} GB free at {root}", file=sys.stderr)
    check_disk_space(root, left)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    progress = state.is_local_main_process if state else True
    if pidx == 0:
        root.mkdir(parents=True, exist_ok=True)
        record_splits(root, splits)
    report: dict[str, Any] = {"engine": cfg.features.engine, "rank": rank, "world": world, "splits": {}}
    source = capture = None
    if cfg.features.engine == "vllm":
        capture, report["numerics"], source = vllm_source(cfg, model, data, root, rank, world)
    t0 = time.perf_counter()
    for s in splits:
        t = time.perf_counter()
        part = extract_split(model, data[s], root / s, headers[s], rank, pad_id, show_progress=progress, source=source)
        report["splits"][s] = {"tokens": sum(e["num_tokens"] for e in part["shards"]),
                               "seconds_this_run": time.perf_counter() - t}
    write_report(root, report)
    if capture is not None:
        capture.close()
    if state:
        state.wait_for_everyone()
    for s in splits:
        folder = root / s
        parts = [read_json(p) for p in part_files(folder)]
        if len(parts) == world and all(p.get("complete") for p in parts):
            if loud:
                merge(folder)
        elif loud:
            print(f"{folder}: {sum(bool(p.get('complete')) for p in parts)} of {world} parts finished; after all jobs "
                  f"finish run `python -m data.extract merge {root}`", file=sys.stderr)
    if loud:
        print(f"extraction done in {time.perf_counter() - t0:.1f} s: {root}", file=sys.stderr)
    return [root / s for s in splits]


def vllm_source(cfg: RunConfig, model: nn.Module, data: dict[str, datasets.Dataset], root: Path, rank: int,
                world: int) -> tuple[Any, dict, FeatureSource]:
    """features.engine vllm: start vLLM with the capture (data/vllm_capture.py), compare it with transformers
    on features.vllm_check_samples sequences (refused above features.vllm_check_tolerance, the table written
    into the extraction report either way); returns (the VllmCapture, the numerics table, the source)."""
    # optional engine: imported only when asked for (the project never needs vLLM)
    from data.vllm_capture import NumericsError, feature_source, start_checked

    lengths = [n for d in data.values() for n in (d["length"] if len(d) else [])]
    pool = data["train"] if len(data["train"]) else data["holdout"]
    try:
        capture, numerics = start_checked(cfg, model, head_layer_ids(cfg, text_config(model.config)),
                                          pool, root / f".vllm-spool-r{rank:04d}of{world:04d}",
                                          max(lengths, default=1) + 1)
    except NumericsError as e:
        write_report(root, {"engine": "vllm", "rank": rank, "world": world, "numerics": e.report, "refused": str(e)})
        raise
    return capture, numerics, feature_source(model, capture)


def write_report(root: Path, report: dict) -> None:
    """STORE/extraction_report.{json,md} (one per job of an array: extraction_report.rRRRRofWWWW.*):
    the engine, tokens and seconds per split, and with features.engine vllm the numerics table."""
    stem = "extraction_report" if report["world"] == 1 else f"extraction_report.r{report['rank']:04d}of{report['world']:04d}"
    root.mkdir(parents=True, exist_ok=True)
    write_json_atomic(root / f"{stem}.json", report)
    lines = [f"# Extraction report ({report['engine']})", ""]
    for s, r in report.get("splits", {}).items():
        lines.append(f"- {s}: {r['tokens']} tokens in this job's shards, {r['seconds_this_run']:.1f} s this run")
    if "refused" in report:
        lines += ["", f"REFUSED: {report['refused']}"]
    if report.get("numerics"):
        from data.vllm_capture import numerics_markdown

        lines += ["", numerics_markdown(report["numerics"])]
    write_atomic(root / f"{stem}.md", "\n".join(lines) + "\n")


def _subcommand(argv: list[str]) -> int:
    """`verify STORE` / `merge STORE`: exit 0 when sound, 1 with one line per problem otherwise."""
    p = argparse.ArgumentParser(prog="python -m data.extract")
    p.add_argument("command", choices=("verify", "merge"))
    p.add_argument("store", help="store folder (with train/ holdout/ inside) or one split folder")
    p.add_argument("--no-checksums", action="store_true", help="verify: check sizes only (fast)")
    args = p.parse_args(argv)
    bad = 0
    try:
        root = Path(args.store)
        for s in named_splits(root):
            if not (root / s).is_dir():
                print(f"BAD {root / s}: missing (split named in {root / STORE_INDEX})")
                bad += 1
        for folder in split_dirs(args.store):
            if args.command == "merge":
                m = merge(folder)
                print(f"{folder}: merged {len(m['shards'])} shards, {m['num_samples']} samples, {m['num_tokens']} tokens")
                continue
            problems = verify(folder, checksums=not args.no_checksums)
            for line in problems:
                print(f"BAD {line}")
            bad += len(problems)
            if not problems:
                m = read_json(folder / MANIFEST)
                print(f"OK {folder}: {len(m['shards'])} shards, {m['num_samples']} samples, {m['num_tokens']} tokens")
    except StoreError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 1 if bad else 0


@cli_main
def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("verify", "merge"):
        raise SystemExit(_subcommand(argv))

    def extra(p: argparse.ArgumentParser) -> None:
        p.add_argument("--split", choices=(*SPLITS, "all"), default="all", help="which tokenized split(s)")
        p.add_argument("--shard-index", type=int, default=0, help="this job's index in a job array")
        p.add_argument("--num-shards", type=int, default=1, help="number of jobs in the job array")

    cfg, args = parse_args("Extract target features into the offline store.", argv, extra)
    splits = SPLITS if args.split == "all" else (args.split,)
    run(cfg, splits, args.shard_index, args.num_shards)


if __name__ == "__main__":
    main()
