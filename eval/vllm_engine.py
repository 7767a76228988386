"""Served acceptance and the engine's throughput curve: the eval's own prompts through vLLM with the exported head.

`python -m eval.run --head H --bench gsm8k --engine vllm` calls `served_sections` after the built-in eval:
the head is exported to vLLM's speculators layout (convert/) in a temporary folder, then the very
token ids the built-in decoder answered (every turn, every temperature) go through vLLM one request at a
time, once with the head as vLLM's drafter and once without speculation. Each vLLM run is a worker process
of this module (`python -m eval.vllm_engine JOB OUT`, in its own process group, killed whole on timeout),
because vLLM's engine starts processes of its own and reserves memory that the eval process should not keep.

Served draft length: the export's own proposal (`speculators_config.proposal_methods[0].speculative_tokens`,
`served_k`). For EAGLE-3 that is the eval's k; a DFlash head always proposes block_size - 1 tokens (its
block is [anchor, mask x (B-1)], convert/dflash.py), whatever the eval's k. The section records both.

The engine's curve (`concurrency_section`): the same two engines also serve c requests at once for every
c of the eval's batch sizes (eval.batch_sizes, default 1, 2, 4, 8, 16), greedy, the eval's prompts cycled
to fill c, EOS ignored so c stay in flight to the end (like eval/batch.py's sweep); the engine is started
with max_num_seqs = the largest c and one engine serves every c. Tokens/s is end to end (prefill
included). From the fixed-k curve `per_batch_size_k` chooses a draft length per concurrency (k where the
head beat plain with tau > 1, else 0: vLLM 0.32's `num_speculative_tokens_per_batch_size` takes (start,
end, k) ranges with k >= 0, 0 meaning no draft tokens at that batch size, checked on CPU), and a third
engine serves the curve again with that schedule (unless it is k everywhere: then it is the fixed-k
engine). k 0 is not plain decoding: vLLM still runs the drafter's first forward every step to keep its KV
cache in sync (`llm_base_proposer.propose` returns no tokens only after it) and the target still captures
the drafter's hidden states, so speculation cannot be switched off per batch size, only its drafts. The schedule goes in speculative_config, not into the export: vLLM's speculators config reader
(`SpeculatorsConfig.build_vllm_speculative_config`) takes only `method` and `speculative_tokens` from a
config.json.

Families: vLLM serves EAGLE-3 and DFlash heads from the speculators layouts, which are what is exported.
EAGLE-1 has no vLLM layout here (README, Known limits), Medusa is exported in the Medusa repository's layout
(vLLM's own Medusa layout differs), and vLLM serves MTP modules only inside DeepSeek-style checkpoints;
those are refused before the eval starts. The n-gram drafter is refused too: vLLM's n-gram proposer matches
differently from ours, so its acceptance would not test anything of ours.

Acceptance per position is the built-in decoder's definition, conditional acceptance at depth d: from
vLLM's counters, accepted_per_pos[d] / accepted_per_pos[d-1] (num_drafts for d = 1): with a chain every
draft reaches every depth, so "tested at depth d" is "accepted at depth d-1". Mean acceptance length is
1 + accepted tokens / drafts (tokens per target pass counting the bonus token, our tau).
Agreement: per position, the Wilson 95% intervals of the two binomial proportions must overlap (each pass
counted as one trial; passes of one answer are not independent, so this is a tolerance, not an exact
test). A greedy disagreement is printed as a likely export bug.

T > 0: when the eval samples, the head is served with speculative_config draft_sample_method
"probabilistic" (vLLM 0.32: the drafter samples from q and the rejection sampler accepts with min(1, p/q),
resampling the residual: our rule). vLLM refuses it only with `use_heterogeneous_vocab` (its draft_model
method with another tokenizer); an EAGLE-3 draft vocabulary is mapped onto the target's in the drafter's
compute_logits (-inf off the draft vocabulary), so it is allowed. The sampled turns are then compared
like the greedy ones, and a disagreement is an ENGINE FAULT (`engine_fault`): the row carries the
sentence and its acceptance, tau, tokens/s and speedup are withheld (null; the raw counts are kept). On
CPU vLLM 0.32's spec-decode path expands per-request temperatures from uninitialised memory (0.7 and 1.0
were read as 0, 1e-42, 1e23 in a check), which is what such a fault has been so far.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Which families vLLM serves, and from which layout, each family declares in convert/<family>.py.
from convert import ExportError, export_head, layouts_of, served_by_vllm
from heads.base import read_head_config

ACCEPTANCE_DEFINITION = ("conditional acceptance per draft position d: accepted at d / tested at d, where a chain "
                         "tests d when d-1 was accepted (vLLM: accepted_per_pos[d] / accepted_per_pos[d-1], "
                         "num_drafts for d = 1), the built-in decoder's acceptance_per_position")
Z95 = 1.959964


class ServeError(ValueError):
    """The head or flags cannot be served by vLLM (one line, the eval CLI exits 2)."""


def check_servable(family: str | None, drafter: str, tree: str, head_config: dict | None = None) -> None:
    """Refuse, before any eval work, what vLLM cannot serve (the reason is in the message); with the head's
    `head_config` (its config.json's), also a head its family's served layout is not for (a DSpark head)."""
    if drafter != "head" or family is None:
        raise ServeError("--engine vllm needs a head (--head): vLLM's n-gram proposer is not ours to compare")
    serving, why_not = served_by_vllm(family)
    if serving is None:
        raise ServeError(f"--engine vllm: a {family} head is not served by vLLM here: {why_not}")
    if head_config is not None and serving.format not in (own := layouts_of(family, head_config)):
        raise ServeError(f"--engine vllm: vLLM serves {family} heads here in the {serving.format} layout, which "
                         f"this head cannot be exported to (it exports to: {', '.join(own) or 'no engine layout'}; "
                         "convert/formats/README.md says why)")
    if tree not in ("auto", "chain"):
        raise ServeError(f"--engine vllm compares chains (vLLM drafts a chain); eval.tree is '{tree}'")
    from data.vllm_engine import require_vllm

    require_vllm()


# ----------------------------------------------------------------------------------------------- statistics
def wilson(successes: int, trials: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion; (0, 1) without trials."""
    if trials <= 0:
        return 0.0, 1.0
    p = successes / trials
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / (1 + z * z / trials)
    return max(0.0, centre - half), min(1.0, centre + half)


def agreement(vllm_acc: list[int], vllm_tested: list[int], ours_acc: list[int], ours_tested: list[int]
              ) -> dict[str, Any]:
    """Per position: both rates, both Wilson 95% intervals, overlap; agrees when every position overlaps."""
    rows = []
    for d in range(min(len(vllm_acc), len(ours_acc))):
        v, o = wilson(vllm_acc[d], vllm_tested[d]), wilson(ours_acc[d], ours_tested[d])
        rows.append({"position": d + 1,
                     "vllm": vllm_acc[d] / vllm_tested[d] if vllm_tested[d] else None,
                     "builtin": ours_acc[d] / ours_tested[d] if ours_tested[d] else None,
                     "vllm_trials": vllm_tested[d], "builtin_trials": ours_tested[d],
                     "vllm_ci95": list(v), "builtin_ci95": list(o), "overlap": v[0] <= o[1] and o[0] <= v[1]})
    return {"compared": True, "agrees": all(r["overlap"] for r in rows), "positions": rows,
            "rule": "Wilson 95% intervals overlap at every position"}


def served_counts(metrics: dict[str, Any], k: int) -> tuple[int, int, list[int], list[int]]:
    """(drafts, accepted tokens, accepted per position, tested per position) from vLLM counter deltas."""
    drafts = int(metrics.get("vllm:spec_decode_num_drafts", 0))
    accepted = int(metrics.get("vllm:spec_decode_num_accepted_tokens", 0))
    per_pos = [int(x) for x in metrics.get("vllm:spec_decode_num_accepted_tokens_per_pos", [])][:k]
    per_pos += [0] * (k - len(per_pos))
    tested = [drafts] + per_pos[:-1]
    return drafts, accepted, per_pos, tested


def mean_acceptance_length(metrics: dict[str, Any], k: int) -> float:
    """1 + accepted tokens / drafts from vLLM counter deltas (1.0 without drafts): our tau."""
    drafts, accepted, _, _ = served_counts(metrics, k)
    return 1 + accepted / drafts if drafts else 1.0


def engine_fault(agree: dict[str, Any], temperature: float, device: str, version: str,
                 greedy_agrees: bool | None = None) -> str | None:
    """The ENGINE FAULT sentence for a sampled (T > 0) comparison that disagrees, else None.

    At T > 0 vLLM is served with draft_sample_method "probabilistic", so its rule is ours and its acceptance
    must match the built-in decoder's on the same turns; when it does not, the numbers are the engine's
    fault, not the head's. greedy_agrees False (the greedy turns disagree too) points at the export first."""
    if temperature <= 0 or not agree.get("compared") or agree["agrees"]:
        return None
    bad = next(r for r in agree["positions"] if not r["overlap"])
    if greedy_agrees is False:
        cause = "the greedy turns disagree as well, so suspect the export first"
    elif device == "cpu":
        cause = f"on CPU vLLM {version} reads per-request temperatures from uninitialised memory"
    else:
        cause = "vLLM does not follow its own rule here (cause not known)"
    return (f"vLLM's sampled acceptance {bad['vllm']:.2f} at position {bad['position']} disagrees with its own "
            f"rule's {bad['builtin']:.2f} (built-in, same turns, T={temperature:g}): {cause}")


def served_row(spec: dict[str, Any], plain: dict[str, Any], ours: Any, k: int, device: str, version: str,
               greedy_agrees: bool | None = None) -> dict[str, Any]:
    """One benchmarks.<name>.vllm.by_temperature row from a (temperature, bench) group served with the head
    (spec) and without (plain); ours: the built-in GenerationStats on those turns or None; k: served k.

    A sampled row that disagrees (engine_fault) has its acceptance, tau, tokens/s and speedup withheld."""
    drafts, _, per_pos, tested = served_counts(spec["metrics"], k)
    tps = spec["tokens"] / spec["seconds"] if spec["seconds"] > 0 else 0.0
    plain_tps = plain["tokens"] / plain["seconds"] if plain["seconds"] > 0 else 0.0
    row: dict[str, Any] = {
        "acceptance_per_position": [a / t if t else 0.0 for a, t in zip(per_pos, tested)],
        "accepted_per_position": per_pos, "tested_per_position": tested, "drafts": drafts,
        "mean_acceptance_length": mean_acceptance_length(spec["metrics"], k),
        "tokens_per_s": tps, "plain_tokens_per_s": plain_tps,
        "speedup": tps / plain_tps if plain_tps > 0 else None,
        "new_tokens": spec["tokens"], "plain_new_tokens": plain["tokens"],
    }
    if ours is None:
        row["agreement"] = {"compared": False, "reason": "no built-in run of the head on these turns"}
        return row
    row["builtin_acceptance_per_position"] = ours.acceptance_rates
    row["agreement"] = agreement(per_pos, tested, list(ours.accepted_per_position)[:k],
                                 list(ours.judged_per_position)[:k])
    fault = engine_fault(row["agreement"], spec["temperature"], device, version, greedy_agrees)
    if fault is not None:
        row.update({"engine_fault": fault, "acceptance_per_position": None, "mean_acceptance_length": None,
                    "tokens_per_s": None, "speedup": None})
    return row


def per_batch_size_k(curve: list[tuple[int, float | None, float]], k: int) -> list[int]:
    """A draft length per measured concurrency from (concurrency, speedup, tau), ascending: k where the
    fixed-k head beat plain and accepted something (tau > 1: a head that accepted nothing cannot be faster,
    so its "speedup" there is the machine's noise), else 0 (vLLM 0.32 takes 0 in
    num_speculative_tokens_per_batch_size: no draft tokens at that batch size)."""
    return [k if speedup is not None and speedup > 1.0 and tau > 1.0 else 0 for _, speedup, tau in curve]


def batch_size_schedule(sizes: list[int], ks: list[int]) -> list[list[int]]:
    """vLLM's num_speculative_tokens_per_batch_size for ascending sizes: [start, end, k] ranges, each size's
    k covering it up to the next measured size (the first range starts at 1, as vLLM requires; vLLM carries
    the last k past the last size)."""
    starts = [1] + sizes[1:]
    ends = [s - 1 for s in sizes[1:]] + [sizes[-1]]
    return [[a, b, x] for a, b, x in zip(starts, ends, ks)]


def _tok_s(run: dict[str, Any]) -> float:
    return run["tokens"] / run["seconds"] if run["seconds"] > 0 else 0.0


def concurrency_section(sizes: list[int], head: list[dict[str, Any]], plain: list[dict[str, Any]], k: int
                        ) -> dict[str, Any]:
    """report.json's `vllm_concurrency` rows and the fixed-k head's crossover from the worker's
    per-concurrency runs (head at fixed k, plain), each list aligned with the ascending sizes."""
    from eval.batch import first_not_faster

    rows = []
    for c, h, p in zip(sizes, head, plain):
        plain_tps, head_tps = _tok_s(p), _tok_s(h)
        _, _, per_pos, tested = served_counts(h["metrics"], k)
        rows.append({"concurrency": c, "plain_tok_s": plain_tps, "head_tok_s": head_tps,
                     "speedup": head_tps / plain_tps if plain_tps > 0 else None,
                     "tau": mean_acceptance_length(h["metrics"], k),
                     "acceptance_per_position": [a / t if t else 0.0 for a, t in zip(per_pos, tested)]})
    return {"rows": rows, "crossover": first_not_faster([(r["concurrency"], r["speedup"]) for r in rows])}


def add_schedule_runs(section: dict[str, Any], scheduled: list[dict[str, Any]], ks: list[int], k: int) -> None:
    """The per-batch-size column (its k, tokens/s, speedup, tau per concurrency) and its crossover, into a
    concurrency_section from the runs with the schedule (aligned with its rows)."""
    from eval.batch import first_not_faster

    for r, s, kc in zip(section["rows"], scheduled, ks):
        tps = _tok_s(s)
        r.update({"per_batch_k": kc, "per_batch_tok_s": tps,
                  "per_batch_speedup": tps / r["plain_tok_s"] if r["plain_tok_s"] > 0 else None,
                  "per_batch_tau": mean_acceptance_length(s["metrics"], k)})
    section["per_batch_crossover"] = first_not_faster([(r["concurrency"], r["per_batch_speedup"])
                                                       for r in section["rows"]])


# ----------------------------------------------------------------------------------------------- worker
def _delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, v in after.items():
        b = before.get(name)
        if isinstance(v, list):
            b = b or []
            out[name] = [x - (b[i] if i < len(b) else 0) for i, x in enumerate(v)]
        else:
            out[name] = v - (b or 0)
    return out


def worker(job: dict[str, Any]) -> dict[str, Any]:
    """Run one vLLM engine over the job's request groups, one request at a time, then over its concurrencies
    (c requests submitted together); per group and per concurrency tokens, seconds and the metric deltas.
    Runs inside the worker process (python -m eval.vllm_engine JOB OUT)."""
    from data.config import TargetConfig
    from data.vllm_engine import VllmTarget, on_gpu

    conc = job["concurrency"]
    target = VllmTarget(TargetConfig(**job["target"]), speculative_config=job["speculative_config"],
                        memory=job["memory"], seed=job["seed"], max_model_len=job["max_model_len"],
                        engine_kwargs={"max_num_seqs": max(conc["sizes"])})
    eos = job["eos"]
    first = job["groups"][0]["requests"][0]["ids"] if job["groups"] else conc["prompts"][0]
    target.generate([first], max_new_tokens=4, eos=eos)  # warm-up: first-call allocations, not timed
    groups = []
    for g in job["groups"]:
        before = target.metrics()
        tokens = 0
        start = time.perf_counter()
        for r in g["requests"]:
            new = target.generate([r["ids"]], max_new_tokens=job["max_new_tokens"], eos=eos,
                                  temperature=g["temperature"], seeds=[r["seed"]])[0]
            tokens += len(new)
        seconds = time.perf_counter() - start
        groups.append({"temperature": g["temperature"], "bench": g["bench"], "tokens": tokens, "seconds": seconds,
                       "metrics": _delta(target.metrics(), before)})
    curve = []
    for c in conc["sizes"]:
        rows = [conc["prompts"][i % len(conc["prompts"])] for i in range(c)]
        before = target.metrics()
        start = time.perf_counter()
        out = target.generate(rows, max_new_tokens=conc["max_new_tokens"], eos=eos, ignore_eos=True)
        curve.append({"concurrency": c, "tokens": sum(len(o) for o in out), "seconds": time.perf_counter() - start,
                      "metrics": _delta(target.metrics(), before)})
    import vllm

    return {"vllm_version": vllm.__version__, "device": "cuda" if on_gpu() else "cpu", "groups": groups,
            "concurrency": curve}


def run_worker(job: dict[str, Any], timeout_s: float, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Start a worker process in its own process group; kill the whole group on timeout or error."""
    with tempfile.TemporaryDirectory(prefix="draftheads-vllm-") as tmp:
        job_path, out_path, log_path = Path(tmp) / "job.json", Path(tmp) / "out.json", Path(tmp) / "worker.log"
        job_path.write_text(json.dumps(job))
        with log_path.open("wb") as logf:
            proc = subprocess.Popen([sys.executable, "-m", "eval.vllm_engine", str(job_path), str(out_path)],
                                    stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout_s)
            except BaseException:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                tail = log_path.read_text(errors="replace")[-2000:]
                raise ServeError(f"vLLM worker stopped (timeout {timeout_s:.0f} s or interrupt); log tail: {tail}") \
                    from None
        if rc != 0 or not out_path.is_file():
            tail = log_path.read_text(errors="replace")[-3000:]
            raise ServeError(f"vLLM worker failed (exit code {rc}); log tail:\n{tail}")
        return json.loads(out_path.read_text())


# ----------------------------------------------------------------------------------------------- eval side
def add_served(benchmarks: dict[str, Any], head_dir: str | Path | None, target: Any, target_cfg: Any,
               served: dict[tuple[str, str], list[tuple[list[int], int]]], tallies: dict[str, Any], main: str,
               k: int, max_new_tokens: int, seed: int, log: Callable[[str], None],
               concurrency: list[int] | None = None, concurrency_new_tokens: int = 32) -> dict[str, Any]:
    """eval.run --engine vllm: serve the exported head in vLLM on the same turns, into benchmarks.<name>.vllm;
    returns report.json's `vllm_concurrency` (the engine's curve at the concurrencies, default 1..16).

    target: eval.turns.Target; tallies: temperature key -> eval.tally.Tally. Raises ServeError."""
    sections, curve = served_sections(head_dir, target.io, target_cfg, served,
                                      lambda t, b: tallies[t].merged(main, b), k, max_new_tokens,
                                      target.eos, seed=seed, log=log, concurrency=concurrency,
                                      concurrency_new_tokens=concurrency_new_tokens)
    for b, section in sections.items():
        benchmarks[b]["vllm"] = section
    return curve


def served_k(export: Path, k: int) -> int:
    """The draft length an export fixes (its speculators_config's first proposal), else k."""
    cfg = json.loads((export / "config.json").read_text())
    proposals = (cfg.get("speculators_config") or {}).get("proposal_methods") or [{}]
    return int(proposals[0].get("speculative_tokens", k))


def _engine_curve(base_job: dict[str, Any], spec: dict[str, Any], with_spec: dict[str, Any], plain: dict[str, Any],
                  k: int, timeout_s: float, log: Callable[[str], None]) -> dict[str, Any]:
    """The concurrency table from the fixed-k and plain engines, with the per-batch-size column: its schedule
    chosen from their curve and served by a third engine (unless it is k everywhere, the fixed-k engine)."""
    sizes = base_job["concurrency"]["sizes"]
    table = concurrency_section(sizes, with_spec["concurrency"], plain["concurrency"], k)
    ks = per_batch_size_k([(r["concurrency"], r["speedup"], r["tau"]) for r in table["rows"]], k)
    schedule = batch_size_schedule(sizes, ks)
    if all(x == k for x in ks):  # the schedule is the fixed-k configuration: its curve is the same run
        scheduled, run = with_spec["concurrency"], "the fixed-k engine's (the schedule is k at every concurrency)"
    else:
        log(f"vllm: the curve again with num_speculative_tokens_per_batch_size {schedule}")
        scheduled = run_worker(base_job | {"groups": [], "speculative_config": spec | {
            "num_speculative_tokens_per_batch_size": schedule}}, timeout_s, log)["concurrency"]
        run = "its own engine"
    add_schedule_runs(table, scheduled, ks, k)
    table.update({"per_batch_size_schedule": schedule, "per_batch_size_run": run,
                  "per_batch_size_rule": "k where the fixed-k head beat plain at that concurrency with tau > 1, "
                                         "else 0 = no drafts; in speculative_config, since vLLM's speculators config reader "
                                         "takes only speculative_tokens from config.json"})
    return table


def _bench_sections(with_spec: dict[str, Any], plain: dict[str, Any], builtin: Callable[[str, str], Any], k: int,
                    header: dict[str, Any], log: Callable[[str], None]) -> dict[str, dict[str, Any]]:
    """benchmarks.<name>.vllm from the one-at-a-time groups of both engines: a served_row per temperature (the
    greedy agreement first, so a sampled row knows whether the export is suspect), logged."""
    version = with_spec["vllm_version"]
    pairs = list(zip(with_spec["groups"], plain["groups"]))
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    greedy_agrees: dict[str, bool] = {}
    for g, p in sorted(pairs, key=lambda pair: pair[0]["temperature"] > 0):  # greedy first, whatever the eval's order
        temp, bench = f"{g['temperature']:g}", g["bench"]
        ours = builtin(temp, bench)
        row = served_row(g, p, ours, k, header["device"], version, greedy_agrees.get(bench))
        agree = row["agreement"]
        if g["temperature"] == 0 and agree["compared"]:
            greedy_agrees[bench] = agree["agrees"]
            if not agree["agrees"]:
                bad = next(r for r in agree["positions"] if not r["overlap"])
                log(f"WARNING: {bench} (T={temp}): vLLM acceptance at position {bad['position']} is "
                    f"{bad['vllm']:.3f} {bad['vllm_ci95']}, the built-in decoder's {bad['builtin']:.3f} "
                    f"{bad['builtin_ci95']}: the served head does not compute what was evaluated; likely an "
                    "export bug (layer ids, norms, d2t, RoPE): check convert/ against the engine")
        rows[bench, temp] = row
        if "engine_fault" in row:
            log(f"ENGINE FAULT {bench} T={temp}: {row['engine_fault']}; its acceptance and speedup are withheld")
            continue
        ours_txt = f", built-in {ours.acceptance_rates[0]:.3f}" if ours is not None and ours.acceptance_rates else ""
        log(f"vllm {bench} T={temp}: acceptance per position "
            f"{' / '.join(f'{a:.3f}' for a in row['acceptance_per_position'])}{ours_txt}; mean acceptance length "
            f"{row['mean_acceptance_length']:.2f}; {row['tokens_per_s']:.1f} tok/s vs {row['plain_tokens_per_s']:.1f} "
            f"plain ({row['speedup'] or 0:.2f}x); "
            + ("agrees with the built-in decoder" if agree.get("agrees") else
               "DISAGREES with the built-in decoder" if agree["compared"] else "not compared: " + agree["reason"]))
    sections: dict[str, dict[str, Any]] = {}
    for g, _ in pairs:  # in the eval's order; the section's headline is its first temperature's row
        temp, bench = f"{g['temperature']:g}", g["bench"]
        sections.setdefault(bench, header | {"by_temperature": {}})["by_temperature"][temp] = rows[bench, temp]
    for sec in sections.values():
        first = next(iter(sec["by_temperature"].values()))
        sec.update({key: first[key] for key in ("acceptance_per_position", "mean_acceptance_length", "tokens_per_s",
                                               "plain_tokens_per_s", "speedup", "agreement")})
    return sections


def served_sections(
    head_dir: str | Path,
    io: Any,
    target_cfg: Any,
    requests: dict[tuple[str, str], list[tuple[list[int], int]]],
    builtin: Callable[[str, str], Any],
    k: int,
    max_new_tokens: int,
    eos: list[int],
    seed: int = 0,
    memory: float | None = None,
    timeout_s: float = 3600.0,
    log: Callable[[str], None] = print,
    concurrency: list[int] | None = None,
    concurrency_new_tokens: int = 32,
) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """(benchmarks.<name>.vllm for every benchmark, vllm_concurrency): vLLM with and without the exported
    head, agreement; the throughput curve at fixed k, plain, and with a per-batch-size draft length.

    requests[(temperature, bench)] = [(prompt ids, sampling seed), ...] in the order the eval ran them;
    builtin(temperature, bench) -> the built-in decoder's GenerationStats for the head on those turns.
    concurrency: the curve's concurrencies (default 1, 2, 4, 8, 16), each with concurrency_new_tokens per request.
    """
    from data.config import to_dict
    from data.vllm_engine import target_folder

    serving, _ = served_by_vllm(read_head_config(head_dir)[1]["family"])  # check_servable refused None
    folder = target_folder(target_cfg)
    groups = [{"temperature": float(t), "bench": b, "requests": [{"ids": ids, "seed": s} for ids, s in reqs]}
              for (t, b), reqs in requests.items()]
    sampled = any(g["temperature"] > 0 for g in groups)
    sizes = sorted(set(concurrency or [1, 2, 4, 8, 16]))
    first_temp = groups[0]["temperature"]
    prompts = list({tuple(r["ids"]): r["ids"] for g in groups if g["temperature"] == first_temp
                    for r in g["requests"]}.values())  # the eval's prompts, once each, in order
    conc = {"sizes": sizes, "prompts": prompts, "max_new_tokens": concurrency_new_tokens}
    longest = max(len(r["ids"]) for g in groups for r in g["requests"])
    with tempfile.TemporaryDirectory(prefix="draftheads-export-") as tmp:
        export = Path(tmp) / serving.format
        try:
            export_head(head_dir, serving.format, export, io, verifier=folder, speculative_tokens=k)
        except ExportError as e:
            raise ServeError(f"cannot export {head_dir} for vLLM: {e}") from None
        k_served = served_k(export, k)
        base_job = {"target": to_dict(target_cfg) | {"device": "auto"}, "memory": memory, "seed": seed,
                    "max_new_tokens": max_new_tokens, "eos": list(eos), "groups": groups, "concurrency": conc,
                    "max_model_len": longest + max(max_new_tokens, concurrency_new_tokens) + k_served + 8}
        spec = {"method": serving.method, "model": str(export), "num_speculative_tokens": k_served}
        if sampled:  # vLLM's rule becomes ours (min(1, p/q), residual resampling): see the module docstring
            spec["draft_sample_method"] = "probabilistic"
        log(f"vllm: exported {head_dir} to the {serving.format} layout; serving it with k {k_served}"
            + (f" (the export fixes it; the eval ran k {k})" if k_served != k else "")
            + f" ({sum(len(g['requests']) for g in groups)} requests one at a time, then concurrency "
            f"{', '.join(map(str, sizes))})")
        with_spec = run_worker(base_job | {"speculative_config": spec}, timeout_s, log)
        log("vllm: the same requests without speculation")
        plain = run_worker(base_job | {"speculative_config": None}, timeout_s, log)
        table = _engine_curve(base_job, spec, with_spec, plain, k_served, timeout_s, log)
    version, device = with_spec["vllm_version"], with_spec["device"]
    engine = {"engine": f"vllm {version}", "device": device, "method": serving.method, "export": serving.format,
              "num_speculative_tokens": k_served, "eval_k": k,
              "num_speculative_tokens_source": "the export's speculators_config.proposal_methods[0]"
                                               ".speculative_tokens (dflash: block_size - 1; eagle3: the eval's k)"}
    sections = _bench_sections(with_spec, plain, builtin, k_served, engine | {
        "draft_sample_method": spec.get("draft_sample_method", "greedy"),
        "requests": "one at a time (batch 1), the eval's own prompt ids",
        "acceptance_definition": ACCEPTANCE_DEFINITION}, log)
    table.update(engine | {"concurrency": sizes, "max_num_seqs": max(sizes), "max_new_tokens": concurrency_new_tokens,
                           "prompts": len(prompts), "greedy": True, "ignore_eos": True,
                           "tokens_per_s": "end to end (prefill included), all requests together"})
    for r in table["rows"]:
        log(f"vllm concurrency {r['concurrency']}: plain {r['plain_tok_s']:.1f} tok/s, head {r['head_tok_s']:.1f} "
            f"({r['speedup'] or 0:.2f}x, tau {r['tau']:.2f}), per-batch-size k {r['per_batch_k']} "
            f"{r['per_batch_tok_s']:.1f} ({r['per_batch_speedup'] or 0:.2f}x)")
    return sections, table


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m eval.vllm_engine JOB.json OUT.json (started by eval.run --engine vllm)",
              file=sys.stderr)
        raise SystemExit(2)
    result = worker(json.loads(Path(argv[0]).read_text()))
    Path(argv[1]).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
