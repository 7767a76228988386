"""Response regeneration (self-distillation): answer prompts with the target itself, write ShareGPT JSONL.

Drafters accept more tokens when trained on the target's own answers (Medusa-2, EAGLE-3, SpecForge), so
this rewrites every assistant turn of the prompt set with the target's greedy (or sampled) answer.

    python -m data.regenerate --config configs/smollm2-135m.yaml --out runs/smol \
        --regenerate.num_prompts=64 --regenerate.max_new_tokens=160

What it does:
- reads `regenerate.prompts` with data.readers (any format: plain prompts, MT-bench, ShareGPT, messages,
  a `datasets` name). Only system and user messages are kept; multi-turn records are answered turn by
  turn, each user turn seeing the target's OWN earlier answers (not the dataset's).
- generates in batches of `regenerate.batch_size` (left padding + attention mask; a row leaves the batch
  and its KV cache when it finishes; stop at EOS or `max_new_tokens`); greedy when `temperature` is 0, else
  temperature / top-p sampling.
- appends one ShareGPT line per finished conversation to OUT/<regenerate.output> (flush + fsync after
  each batch). A killed run rerun with the same command continues where it stopped: completed ids are
  read back, a trailing partial line is cut off, and the remaining prompts are generated in the same
  batches as an uninterrupted run would use, so the final file is the same, with no duplicates.
- sampling uses one random generator per (prompt id, turn), seeded from `seed`, so a sampled answer does
  not depend on which other prompts share its batch or on an interruption.
- `regenerate.engine=vllm` (the `vllm` extra) hands each batch of `batch_size` prompts (then a chunk:
  use hundreds on GPUs) to vLLM's offline engine (data/vllm_engine.py), `regenerate.tensor_parallel_size`
  GPUs per copy of the target; same prompts (our chat template, as token ids), same file, same fsync per
  chunk and the same resume rules; sampled requests carry their (prompt id, turn) seed.
- `regenerate.data_parallel_size=D` runs D copies of the target, one child process each (vLLM's offline
  LLM refuses D > 1 in one process), on D contiguous slices of the prompts, joined in order at the end.
- `regenerate.num_shards=N regenerate.shard_index=I` answers the I-th contiguous slice of the prompts into
  OUT/<stem>.shard-IIIII-of-NNNNN.jsonl (one SLURM array task each: scripts/slurm/regenerate.sbatch), and
  `python -m data.regenerate merge --config C --out D --regenerate.num_shards=N` joins the finished shards
  in order into OUT/<output>, refusing a missing or unfinished one:

    python -m data.regenerate --config configs/smollm2-135m.yaml --out runs/smol --regenerate.engine=vllm \
        --regenerate.batch_size=256

The settings that change answers are stored in OUT/<output stem>.meta.json; resuming with different ones
is refused (delete the output or pick another --out). A rerun with a larger `num_prompts` extends the file. Bad input (malformed prompt line, unknown config
key, missing model or package) prints one `error:` line naming the place and exits with code 2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import yaml
from tqdm import tqdm

from data.cli import cli_main, write_atomic
from data.config import RegenerateConfig, RunConfig, parse_args, save_config, to_dict
from data.kvcache import DynamicKV, left_pad
from data.readers import DataError, Record, read_records, to_sharegpt
from data.sampling import target_distribution, turn_seed
from data.target import load_model, load_tokenizer
from data.tokenize import render_chat


@dataclass
class Job:
    """One conversation to answer: its id, optional system prompt and user turns in order."""

    id: str
    system: str | None
    users: list[str]


@dataclass
class Answer:
    text: str
    tokens: int  # generated tokens counted for throughput: the answer plus its EOS token when it stopped
    stopped: bool  # False when max_new_tokens cut the answer off


def make_jobs(records: list[Record], system_prompt: str | None) -> tuple[list[Job], list[str]]:
    """Jobs from read records and the ids of records without any user turn (reported, not answered).

    Existing assistant turns are dropped (they are what we regenerate). A record's own system message is
    kept unless `system_prompt` replaces it. Duplicate ids get a `#2`, `#3`, ... suffix (the next one no
    other record uses: a record may itself be called `a#2`) so that every id is unique and resuming by id
    stays exact.
    """
    jobs: list[Job] = []
    no_user: list[str] = []
    seen: dict[str, int] = {}
    used: set[str] = set()
    for rec in records:
        users = [m["content"] for m in rec.messages if m["role"] == "user"]
        if not users:
            no_user.append(rec.id)
            continue
        own_system = next((m["content"] for m in rec.messages if m["role"] == "system"), None)
        rid = rec.id
        while rid in used:
            seen[rec.id] = seen.get(rec.id, 1) + 1
            rid = f"{rec.id}#{seen[rec.id]}"
        used.add(rid)
        jobs.append(Job(rid, system_prompt if system_prompt is not None else own_system, users))
    return jobs, no_user


class RowSampler:
    """Temperature / top-p sampling with one torch.Generator per row, keyed by the row's place in the batch.

    One global generator would make a row's tokens depend on its batch neighbours (and on which of them
    have already finished); here row i always draws from its own seeded generator."""

    def __init__(self, seeds: list[int], temperature: float, top_p: float, device: torch.device):
        self.generators = [torch.Generator(device=device).manual_seed(s) for s in seeds]
        self.temperature = temperature
        self.top_p = top_p

    def __call__(self, rows: list[int], scores: torch.Tensor) -> torch.Tensor:
        """One token per row of scores [len(rows), V]; rows[j] names the generator of scores[j]."""
        # transformers' own temperature / top-p warpers (data.sampling), as model.generate would sample
        probs = target_distribution(scores, self.temperature, top_p=self.top_p)
        return torch.cat([torch.multinomial(probs[j], 1, generator=self.generators[r]) for j, r in enumerate(rows)])


def eos_ids(model: Any, tokenizer: Any) -> list[int]:
    """Token ids that end an answer: the tokenizer's EOS plus the model's generation-config EOS id(s).

    The one EOS helper (regeneration, prompt writing and eval); DataError when neither defines one."""
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    listed = list(gen_eos) if isinstance(gen_eos, (list, tuple)) else [gen_eos]
    ids = {i for i in (tokenizer.eos_token_id, *listed) if i is not None}
    if not ids:
        raise DataError("the target's tokenizer and generation config define no EOS token; cannot stop answers")
    return sorted(ids)


def render_texts(tokenizer: Any, conversations: list[list[dict]]) -> list[str]:
    """Each conversation chat-templated with the generation prompt."""
    return [render_chat(tokenizer, c, gen=True) for c in conversations]


def encode_texts(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Rendered texts as token ids (what every engine gets)."""
    # The template already renders BOS-like markers, so the tokenizer must not add its own.
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def render_rows(tokenizer: Any, conversations: list[list[dict]]) -> list[list[int]]:
    """Each conversation chat-templated with the generation prompt, as token ids."""
    return encode_texts(tokenizer, render_texts(tokenizer, conversations))


def decode_answers(tokenizer: Any, new_rows: list[list[int]], eos: list[int]) -> list[Answer]:
    """Generated token ids per row -> answers: cut at the first EOS, decoded without special tokens."""
    answers = []
    eos_set = set(eos)
    for row in new_rows:
        stop = next((j for j, t in enumerate(row) if t in eos_set), None)
        body = row if stop is None else row[:stop]
        text = tokenizer.decode(body, skip_special_tokens=True).strip()
        answers.append(Answer(text, len(row) if stop is None else stop + 1, stop is not None))
    return answers


def generate_batch(
    model: Any, tokenizer: Any, conversations: list[list[dict]], rcfg: RegenerateConfig, seeds: list[int] | None
) -> list[Answer]:
    """The target's next assistant answer for each conversation, generated together (left padded).

    `seeds` (one per conversation) switch on per-row sampling; None means greedy.
    """
    return generate_texts(model, tokenizer, render_texts(tokenizer, conversations), rcfg.max_new_tokens,
                          rcfg.temperature, rcfg.top_p, seeds)


def generate_texts(
    model: Any, tokenizer: Any, texts: list[str], max_new_tokens: int, temperature: float, top_p: float,
    seeds: list[int] | None, stop_ids: list[int] | None = None,
) -> list[Answer]:
    """Continue each rendered text (batched, left padded) until a stop token or `max_new_tokens`.

    Stops at the target's EOS ids plus `stop_ids`. `seeds` (one per text) switch on per-row sampling at
    `temperature` / `top_p`; None means greedy. The answer text excludes the stop token.
    """
    eos = sorted(set(eos_ids(model, tokenizer)) | set(stop_ids or []))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    rows = encode_texts(tokenizer, texts)
    device = next(model.parameters()).device
    # Left padding: every row's last prompt token sits at the same column, so new tokens line up; the cache
    # (data.kvcache.DynamicKV, padded) hides the pads and counts positions of real tokens only, which is what
    # keeps batched output equal to one-at-a-time output. Built from the model config: sliding-window layers
    # keep only their window (generation only appends).
    ids, att = left_pad(rows, pad)
    sampler = RowSampler(seeds, temperature, top_p, device) if seeds is not None else None
    stop = torch.as_tensor(eos, device=device)
    kv = DynamicKV(model, windowed=True)
    live = list(range(len(rows)))  # batch index -> row of texts; a row leaves the batch when it stops
    new: list[list[int]] = [[] for _ in rows]
    with torch.no_grad():
        for step in range(max_new_tokens):
            logits = kv.run(ids, logits_to_keep=1, pad=att if step == 0 else None)[0][:, -1].float()
            kv.keep(range(ids.shape[1]))
            tok = sampler(live, logits) if sampler is not None else logits.argmax(-1)
            for r, t in zip(live, tok.tolist()):
                new[r].append(t)
            going = ~torch.isin(tok, stop)
            if step + 1 == max_new_tokens or not bool(going.any()):
                break
            if not bool(going.all()):
                # Finished rows leave the batch (and the cache): model.generate would keep computing them
                # to the longest row's end, which is most of the work when answer lengths vary.
                keep = going.nonzero().squeeze(1)
                kv.select(keep)
                tok = tok[keep]
                live = [live[j] for j in keep.tolist()]
            ids = tok.unsqueeze(1)
    return decode_answers(tokenizer, new, eos)


def vllm_generate_batch(
    target: Any, tokenizer: Any, conversations: list[list[dict]], rcfg: RegenerateConfig, seeds: list[int] | None
) -> list[Answer]:
    """generate_batch through vLLM (target: data.vllm_engine.VllmTarget): same prompts, same answers format.

    Sampled requests carry their (prompt id, turn) seed, so an answer does not depend on its chunk either."""
    eos = eos_ids(target, tokenizer)
    new = target.generate(render_rows(tokenizer, conversations), max_new_tokens=rcfg.max_new_tokens, eos=eos,
                          temperature=rcfg.temperature, top_p=rcfg.top_p, seeds=seeds)
    return decode_answers(tokenizer, new, eos)


def answer_jobs(model: Any, tokenizer: Any, jobs: list[Job], rcfg: RegenerateConfig, seed: int,
                generate: Any = None) -> tuple[list[Record], list[Answer]]:
    """Answer a batch of jobs turn by turn: round r generates the r-th answer of every job that has one.

    generate: generate_batch (default) or vllm_generate_batch, called as generate(model, tokenizer, ...)."""
    generate = generate or generate_batch
    convs: list[list[dict]] = [[{"role": "system", "content": j.system}] if j.system is not None else [] for j in jobs]
    answers: list[Answer] = []
    for turn in range(max(len(j.users) for j in jobs)):
        active = [i for i, j in enumerate(jobs) if turn < len(j.users)]
        for i in active:
            convs[i].append({"role": "user", "content": jobs[i].users[turn]})
        seeds = [turn_seed(seed, jobs[i].id, turn) for i in active] if rcfg.temperature > 0 else None
        got = generate(model, tokenizer, [convs[i] for i in active], rcfg, seeds)
        for i, a in zip(active, got):
            convs[i].append({"role": "assistant", "content": a.text})
        answers += got
    return [Record(j.id, c) for j, c in zip(jobs, convs)], answers


def read_done(path: Path) -> list[str]:
    """Ids already written to `path`, in order; a trailing partial line (a kill mid-write) is cut off, but
    only once every complete line is a regenerated record (a file that is not one is refused unchanged)."""
    if not path.is_file():
        return []
    data = path.read_bytes()
    cut = data.rfind(b"\n") + 1
    ids = []
    for lineno, line in enumerate(data[:cut].splitlines(), 1):
        try:
            ids.append(str(json.loads(line)["id"]))
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise DataError(f"{path}:{lineno}: not a regenerated record ({type(e).__name__}: {e}); "
                            "delete the file to start over") from None
    if cut < len(data):
        with path.open("r+b") as f:
            f.truncate(cut)
        print(f"regenerate: {path}: dropped a partial last line ({len(data) - cut} bytes) from an interrupted run",
              file=sys.stderr)
    return ids


# Settings absent from the .meta.json of a run written before they existed, with the value it used then.
_SETTING_DEFAULTS = {"engine": "hf"}


def _settings(cfg: RunConfig) -> dict[str, Any]:
    """What decides the answers. Not batch_size (batched output equals one-at-a-time output) and not
    num_prompts (the first N prompts are a prefix of the first M > N: a rerun with more extends the file).
    The engine does: vLLM's kernels can flip a near-tie that transformers' would not."""
    r = cfg.regenerate
    return {"target": to_dict(cfg.target) | {"device": None}, "prompts": r.prompts, "split": r.split,
            "max_new_tokens": r.max_new_tokens, "temperature": r.temperature,
            "top_p": r.top_p, "system_prompt": r.system_prompt, "seed": cfg.seed, "engine": r.engine}


def check_settings(meta_path: Path, out_path: Path, settings: dict[str, Any], resuming: bool,
                   section: str = "regenerate") -> None:
    """Store `settings` beside a new output, or refuse to resume an output written with other settings."""
    if not resuming:
        write_atomic(meta_path, json.dumps(settings, indent=2))
        return
    if not meta_path.is_file():
        raise DataError(f"{out_path} exists but {meta_path.name} does not, so it cannot be resumed safely; "
                        "delete it or use another --out")
    old = json.loads(meta_path.read_text())
    for key in settings:
        was = old.get(key, _SETTING_DEFAULTS.get(key))
        if was != settings[key]:
            raise DataError(f"{out_path} was written with {section} setting '{key}' = {was!r}, now "
                            f"{settings[key]!r}; rerun with the old settings to resume, or delete it")


def _check(rcfg: RegenerateConfig) -> None:
    if rcfg.batch_size < 1 or rcfg.max_new_tokens < 1:
        raise DataError("regenerate.batch_size and regenerate.max_new_tokens must be >= 1")
    if rcfg.temperature < 0 or not 0 < rcfg.top_p <= 1:
        raise DataError("regenerate.temperature must be >= 0 and regenerate.top_p in (0, 1]")
    if rcfg.tensor_parallel_size < 1 or rcfg.data_parallel_size < 1:
        raise DataError("regenerate.tensor_parallel_size and regenerate.data_parallel_size must be >= 1")
    if rcfg.num_shards < 1 or not 0 <= rcfg.shard_index < rcfg.num_shards:
        raise DataError(f"regenerate.shard_index must be in 0..num_shards-1 (num_shards {rcfg.num_shards}), "
                        f"got {rcfg.shard_index}")


def _jobs(rcfg: RegenerateConfig) -> tuple[list[Job], list[str], Any]:
    records, stats = read_records(rcfg.prompts, "auto", rcfg.split, rcfg.num_prompts, rcfg.skip_malformed)
    jobs, no_user = make_jobs(records, rcfg.system_prompt)
    if not jobs:
        raise DataError(f"{rcfg.prompts}: no prompts with a user turn")
    return jobs, no_user, stats


def shard_slice(n_jobs: int, index: int, count: int) -> slice:
    """The contiguous slice of the prompt order that shard `index` of `count` answers (sizes differ by <= 1)."""
    return slice(index * n_jobs // count, (index + 1) * n_jobs // count)


def output_path(cfg: RunConfig, shard: int | None = None) -> Path:
    """OUT/<regenerate.output>, or for a shard of an array job OUT/<stem>.shard-IIIII-of-NNNNN<suffix>."""
    rcfg = cfg.regenerate
    path = Path(rcfg.output) if Path(rcfg.output).is_absolute() else Path(cfg.out) / rcfg.output
    if shard is None:
        return path
    return path.with_name(f"{path.stem}.shard-{shard:05d}-of-{rcfg.num_shards:05d}{path.suffix}")


def load_engine(cfg: RunConfig) -> tuple[Any, Any, Any]:
    """(model, tokenizer, generate function) of regenerate.engine for cfg.target."""
    rcfg = cfg.regenerate
    if rcfg.engine == "vllm":
        # optional engine: data.vllm_engine is imported only when asked for (the project never needs vLLM)
        from data.vllm_engine import VllmTarget

        target = VllmTarget(cfg.target, tensor_parallel_size=rcfg.tensor_parallel_size, memory=rcfg.memory,
                            seed=cfg.seed)
        return target, load_tokenizer(cfg.target), vllm_generate_batch
    return load_model(cfg.target, decode=True), load_tokenizer(cfg.target), generate_batch


def regenerate(cfg: RunConfig, model: Any = None, tokenizer: Any = None) -> dict[str, Any]:
    """Run (or resume) regeneration for `cfg`; returns the summary. Loads the target unless given one
    (a transformers model, or with regenerate.engine vllm a data.vllm_engine.VllmTarget)."""
    rcfg = cfg.regenerate
    _check(rcfg)
    if rcfg.data_parallel_size > 1 and model is None:
        return _data_parallel(cfg)
    jobs, no_user, stats = _jobs(rcfg)
    sharded = rcfg.num_shards > 1
    if sharded:
        jobs = jobs[shard_slice(len(jobs), rcfg.shard_index, rcfg.num_shards)]
    generate = vllm_generate_batch if rcfg.engine == "vllm" else generate_batch
    if model is None or tokenizer is None:
        model, tokenizer, generate = load_engine(cfg)
    out_dir = Path(cfg.out)
    out_path = output_path(cfg, rcfg.shard_index if sharded else None)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    # A file without its .meta.json is not ours: refused before anything (config.yaml included) is written.
    check_settings(out_path.with_suffix(".meta.json"), out_path, _settings(cfg), out_path.exists())
    done_ids = read_done(out_path)
    save_config(cfg, out_dir)
    done = set(done_ids)
    pending = sum(j.id not in done for j in jobs)

    tokens = truncated = answered = 0
    start = time.perf_counter()
    bar = tqdm(total=len(jobs), initial=len(jobs) - pending, unit="prompt", desc="regenerate", dynamic_ncols=True)
    with out_path.open("a", encoding="utf-8") as f:
        # Batches are fixed slices of the prompt order, so a resumed run forms the same batches (minus what
        # is already written) as an uninterrupted one, and appends its lines in the same order.
        for b in range(0, len(jobs), rcfg.batch_size):
            batch = [j for j in jobs[b: b + rcfg.batch_size] if j.id not in done]
            if not batch:
                continue
            recs, answers = answer_jobs(model, tokenizer, batch, rcfg, cfg.seed, generate)
            f.write("".join(json.dumps(to_sharegpt(r), ensure_ascii=False) + "\n" for r in recs))
            f.flush()
            os.fsync(f.fileno())
            tokens += sum(a.tokens for a in answers)
            truncated += sum(not a.stopped for a in answers)
            answered += len(answers)
            bar.update(len(batch))
            bar.set_postfix_str(f"{tokens / (time.perf_counter() - start):.1f} tok/s")
    bar.close()
    seconds = time.perf_counter() - start
    return {
        "output": str(out_path),
        "records": len(read_done(out_path)),
        "prompts_generated": pending,
        "prompts_resumed": len(jobs) - pending,
        "answers": answered,
        "answers_cut_at_max_new_tokens": truncated,
        "skipped_malformed": stats.skipped,
        "skipped_without_user_turn": len(no_user),
        "generated_tokens": tokens,
        "seconds": seconds,
        "prompts_per_s": pending / seconds if seconds > 0 else 0.0,
        "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
    }


def format_summary(s: dict[str, Any]) -> str:
    if "data_parallel_size" in s:
        return (f"regenerate: {s['records']} records in {s['output']} from {s['data_parallel_size']} "
                f"data-parallel copies in {s['seconds']:.1f} s")
    return (f"regenerate: {s['records']} records in {s['output']} ({s['prompts_generated']} generated now, "
            f"{s['prompts_resumed']} from an earlier run) | {s['prompts_per_s']:.2f} prompts/s, "
            f"{s['tokens_per_s']:.1f} tokens/s, {s['generated_tokens']} tokens in {s['seconds']:.1f} s | "
            f"{s['answers_cut_at_max_new_tokens']}/{s['answers']} answers cut at max_new_tokens | skipped: "
            f"{s['skipped_malformed']} malformed, {s['skipped_without_user_turn']} without a user turn")


def _join(parts: list[tuple[Path, list[str]]], out_path: Path, settings: dict[str, Any]) -> None:
    """Concatenate finished part files (each must hold exactly its ids, in order) into out_path, atomically:
    written under a temporary name, fsynced, renamed; the parts' settings become out_path's .meta.json."""
    for part, want in parts:
        got = read_done(part)
        if got != want:
            raise DataError(f"{part}: holds {len(got)} of its {len(want)} records"
                            + ("" if len(got) < len(want) else " (other ids)") + "; rerun it, then merge")
        check_settings(part.with_suffix(".meta.json"), part, settings, True)
    tmp = out_path.with_name(out_path.name + ".merging")
    with tmp.open("wb") as f:
        for part, _ in parts:
            f.write(part.read_bytes())
        f.flush()
        os.fsync(f.fileno())
    out_path.with_suffix(".meta.json").write_text(json.dumps(settings, indent=2))
    tmp.replace(out_path)


def merge(cfg: RunConfig) -> dict[str, Any]:
    """Join the num_shards shard files of an array job into OUT/<regenerate.output>, in prompt order.

    A missing or unfinished shard is named and nothing is written; the joined file is what one
    uninterrupted run would have written (and resumes like one)."""
    rcfg = cfg.regenerate
    _check(rcfg)
    jobs, _, _ = _jobs(rcfg)
    parts = [(output_path(cfg, i), [j.id for j in jobs[shard_slice(len(jobs), i, rcfg.num_shards)]])
             for i in range(rcfg.num_shards)]
    _join(parts, output_path(cfg), _settings(cfg))
    return {"output": str(output_path(cfg)), "records": len(jobs), "shards": rcfg.num_shards}


def _data_parallel(cfg: RunConfig) -> dict[str, Any]:
    """data_parallel_size D > 1: D child processes (python -m data.regenerate), each with one copy of the
    target (with a GPU: its own tensor_parallel_size GPUs), answer D contiguous sub-slices of this task's
    prompts (shards I*D+r of num_shards*D, which nest inside shard I of num_shards); their files are then
    joined in order into this task's output, so the result equals a single process's. One process per copy
    because vLLM's offline LLM refuses data_parallel_size > 1 in one process. Rerun after a kill: each child
    resumes its own file."""
    rcfg = cfg.regenerate
    n_dp, tp = rcfg.data_parallel_size, rcfg.tensor_parallel_size
    out_dir = Path(cfg.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out_dir)
    sharded = rcfg.num_shards > 1
    out_path = output_path(cfg, rcfg.shard_index if sharded else None)
    jobs, _, _ = _jobs(rcfg)
    if sharded:
        jobs = jobs[shard_slice(len(jobs), rcfg.shard_index, rcfg.num_shards)]
    done = read_done(out_path)
    if out_path.exists() and done != [j.id for j in jobs]:
        raise DataError(f"{out_path}: an unfinished file from a run without data parallelism; resume it with "
                        "regenerate.data_parallel_size=1, or delete it")
    start = time.perf_counter()
    if not out_path.exists():
        child_cfg = out_dir / f".regenerate-dp-{rcfg.shard_index}.yaml"
        child_cfg.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        gpus: list[str] = []
        if torch.cuda.is_available():
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
            if len(gpus) < n_dp * tp:
                raise DataError(f"regenerate.data_parallel_size {n_dp} x tensor_parallel_size {tp} needs "
                                f"{n_dp * tp} GPUs, {len(gpus)} visible")
        procs = []
        for r in range(n_dp):
            env = dict(os.environ)
            if gpus:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[r * tp:(r + 1) * tp])
            cmd = [sys.executable, "-m", "data.regenerate", "--config", str(child_cfg), "--out", str(out_dir),
                   "--regenerate.data_parallel_size=1", f"--regenerate.num_shards={rcfg.num_shards * n_dp}",
                   f"--regenerate.shard_index={rcfg.shard_index * n_dp + r}"]
            procs.append(subprocess.Popen(cmd, env=env, start_new_session=True))
        try:
            codes = [p.wait() for p in procs]
        finally:  # an interrupted parent takes its children (and their vLLM engines) with it
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, 9)
                    p.wait()
        failed = [(r, c) for r, c in enumerate(codes) if c]
        if failed:
            raise DataError(f"data-parallel copy {failed[0][0]} exited with code {failed[0][1]}; rerun the same "
                            "command to resume")
        n_fine = rcfg.num_shards * n_dp
        fine = replace(cfg, regenerate=replace(rcfg, data_parallel_size=1, num_shards=n_fine))
        all_jobs, _, _ = _jobs(rcfg)
        parts = [(output_path(fine, i), [j.id for j in all_jobs[shard_slice(len(all_jobs), i, n_fine)]])
                 for i in range(rcfg.shard_index * n_dp, (rcfg.shard_index + 1) * n_dp)]
        _join(parts, out_path, _settings(cfg))
        for part, _ in parts:
            part.unlink()
            part.with_suffix(".meta.json").unlink()
        child_cfg.unlink()
        save_config(cfg, out_dir)  # the children wrote theirs there
    seconds = time.perf_counter() - start
    return {"output": str(out_path), "records": len(read_done(out_path)), "data_parallel_size": n_dp,
            "seconds": seconds}


def run_cli(description: str, run: Callable[[RunConfig], dict[str, Any]], fmt: Callable[[dict[str, Any]], str],
            name: str, saved: str, argv: list[str] | None) -> None:
    """The data stages' runner (inside their `cli_main`): parse the common flags, run, print the summary;
    Ctrl-C says what `saved` and exits 130."""
    cfg, _ = parse_args(description, argv)
    try:
        summary = run(cfg)
    except KeyboardInterrupt:
        print(f"\n{name}: interrupted; {saved}, rerun the same command to resume", file=sys.stderr)
        raise SystemExit(130) from None
    print(fmt(summary))


def format_merge(s: dict[str, Any]) -> str:
    return f"regenerate merge: {s['records']} records from {s['shards']} shards in {s['output']}"


@cli_main
def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "merge":
        run_cli("Join the shard files of a job array (regenerate.num_shards) into one output.", merge,
                format_merge, "regenerate merge", "nothing was written", argv[1:])
        return
    run_cli("Answer prompts with the target (self-distillation) and write ShareGPT JSONL "
            "(`merge`: join the shards of a job array).", regenerate, format_summary, "regenerate",
            "finished conversations are saved", argv)


if __name__ == "__main__":
    main()
