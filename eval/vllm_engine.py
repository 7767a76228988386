"""Served acceptance: run the eval's own prompts through vLLM with the exported head, and check agreement.

`python -m eval.run --head H --bench gsm8k --engine vllm` calls `served_sections` after the built-in eval:
the head is exported to vLLM's speculators layout (convert/) in a temporary folder, then the very
token ids the built-in decoder answered (every turn, every temperature) go through vLLM one request at a
time, once with the head as vLLM's EAGLE-3 drafter (num_speculative_tokens = the eval's k) and once
without speculation. Each vLLM run is a worker process of this module (`python -m eval.vllm_engine JOB
OUT`, in its own process group, killed whole on timeout), because vLLM's engine starts processes of its
own and reserves memory that the eval process should not keep.

Families: vLLM serves EAGLE-3 heads from the speculators layout, which is what is exported. EAGLE-1 has no
vLLM layout here (README, Known limits), Medusa is exported in the Medusa repository's layout (vLLM's own
Medusa layout differs), and vLLM serves MTP modules only inside DeepSeek-style checkpoints; those are
refused before the eval starts. The n-gram drafter is refused too: vLLM's n-gram proposer matches
differently from ours, so its acceptance would not test anything of ours.

Acceptance per position is the built-in decoder's definition, conditional acceptance at depth d: from
vLLM's counters, accepted_per_pos[d] / accepted_per_pos[d-1] (num_drafts for d = 1): with a chain every
draft reaches every depth, so "tested at depth d" is "accepted at depth d-1". Mean acceptance length is
1 + accepted tokens / drafts (tokens per target pass counting the bonus token, our tau).
Agreement: per position, the Wilson 95% intervals of the two binomial proportions must overlap (each pass
counted as one trial; passes of one answer are not independent, so this is a tolerance, not an exact
test). Only greedy temperature is compared: at T > 0 vLLM's EAGLE proposer drafts the head's argmax
(speculative_config draft_sample_method "greedy", its default; no draft probabilities with a draft
vocabulary) and its rejection sampler accepts it by the target's probability, while our chain samples from
the head and accepts with min(1, p/q): different rules, different rates. A greedy disagreement is printed
as a likely export bug.
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
from convert import ExportError, export_head, served_by_vllm
from heads.base import read_head_config

ACCEPTANCE_DEFINITION = ("conditional acceptance per draft position d: accepted at d / tested at d, where a chain "
                         "tests d when d-1 was accepted (vLLM: accepted_per_pos[d] / accepted_per_pos[d-1], "
                         "num_drafts for d = 1), the built-in decoder's acceptance_per_position")
Z95 = 1.959964


class ServeError(ValueError):
    """The head or flags cannot be served by vLLM (one line, the eval CLI exits 2)."""


def check_servable(family: str | None, drafter: str, tree: str) -> None:
    """Refuse, before any eval work, what vLLM cannot serve (the reason is in the message)."""
    if drafter != "head" or family is None:
        raise ServeError("--engine vllm needs a head (--head): vLLM's n-gram proposer is not ours to compare")
    serving, why_not = served_by_vllm(family)
    if serving is None:
        raise ServeError(f"--engine vllm: a {family} head is not served by vLLM here: {why_not}")
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
    """Run one vLLM engine over the job's request groups, one request at a time; per group tokens, seconds
    and the metric deltas. Runs inside the worker process (python -m eval.vllm_engine JOB OUT)."""
    from data.config import TargetConfig
    from data.vllm_engine import VllmTarget

    target = VllmTarget(TargetConfig(**job["target"]), speculative_config=job["speculative_config"],
                        memory=job["memory"], seed=job["seed"], max_model_len=job["max_model_len"])
    eos = job["eos"]
    first = job["groups"][0]["requests"][0]
    target.generate([first["ids"]], max_new_tokens=4, eos=eos)  # warm-up: first-call allocations, not timed
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
    import vllm

    return {"vllm_version": vllm.__version__, "groups": groups}


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
               k: int, max_new_tokens: int, seed: int, log: Callable[[str], None]) -> None:
    """eval.run --engine vllm: serve the exported head in vLLM on the same turns, into benchmarks.<name>.vllm.

    target: eval.turns.Target; tallies: temperature key -> eval.tally.Tally. Raises ServeError."""
    for b, section in served_sections(head_dir, target.io, target_cfg, served,
                                      lambda t, b: tallies[t].merged(main, b), k, max_new_tokens,
                                      target.eos, seed=seed, log=log).items():
        benchmarks[b]["vllm"] = section


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
) -> dict[str, dict[str, Any]]:
    """benchmarks.<name>.vllm for every benchmark: vLLM with and without the exported head, agreement.

    requests[(temperature, bench)] = [(prompt ids, sampling seed), ...] in the order the eval ran them;
    builtin(temperature, bench) -> the built-in decoder's GenerationStats for the head on those turns.
    """
    from data.config import to_dict
    from data.vllm_engine import target_folder

    serving, _ = served_by_vllm(read_head_config(head_dir)[1]["family"])  # check_servable refused None
    folder = target_folder(target_cfg)
    groups = [{"temperature": float(t), "bench": b, "requests": [{"ids": ids, "seed": s} for ids, s in reqs]}
              for (t, b), reqs in requests.items()]
    longest = max(len(r["ids"]) for g in groups for r in g["requests"])
    base_job = {"target": to_dict(target_cfg) | {"device": "auto"}, "memory": memory, "seed": seed,
                "max_new_tokens": max_new_tokens, "eos": list(eos), "groups": groups,
                "max_model_len": longest + max_new_tokens + k + 8}
    with tempfile.TemporaryDirectory(prefix="draftheads-export-") as tmp:
        export = Path(tmp) / serving.format
        try:
            export_head(head_dir, serving.format, export, io, verifier=folder, speculative_tokens=k)
        except ExportError as e:
            raise ServeError(f"cannot export {head_dir} for vLLM: {e}") from None
        spec = {"method": serving.method, "model": str(export), "num_speculative_tokens": k}
        log(f"vllm: exported {head_dir} to the {serving.format} layout; serving it with k {k} "
            f"({sum(len(g['requests']) for g in groups)} requests, one at a time)")
        with_spec = run_worker(base_job | {"speculative_config": spec}, timeout_s, log)
    log("vllm: the same requests without speculation")
    plain = run_worker(base_job | {"speculative_config": None}, timeout_s, log)

    sections: dict[str, dict[str, Any]] = {}
    for g, p in zip(with_spec["groups"], plain["groups"]):
        temp, bench = f"{g['temperature']:g}", g["bench"]
        drafts, accepted, per_pos, tested = served_counts(g["metrics"], k)
        tps = g["tokens"] / g["seconds"] if g["seconds"] > 0 else 0.0
        plain_tps = p["tokens"] / p["seconds"] if p["seconds"] > 0 else 0.0
        row: dict[str, Any] = {
            "acceptance_per_position": [a / t if t else 0.0 for a, t in zip(per_pos, tested)],
            "accepted_per_position": per_pos, "tested_per_position": tested, "drafts": drafts,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
            "tokens_per_s": tps, "plain_tokens_per_s": plain_tps,
            "speedup": tps / plain_tps if plain_tps > 0 else None,
            "new_tokens": g["tokens"], "plain_new_tokens": p["tokens"],
        }
        ours = builtin(temp, bench)
        if ours is None:
            row["agreement"] = {"compared": False, "reason": "no built-in run of the head on these turns"}
        elif g["temperature"] > 0:
            row["builtin_acceptance_per_position"] = ours.acceptance_rates
            row["agreement"] = {"compared": False, "reason": "T > 0: vLLM drafts the head's argmax and accepts it "
                                "by the target's probability, the built-in chain samples q and accepts with "
                                "min(1, p/q)"}
        else:
            row["builtin_acceptance_per_position"] = ours.acceptance_rates
            row["agreement"] = agreement(per_pos, tested, list(ours.accepted_per_position)[:k],
                                         list(ours.judged_per_position)[:k])
            if not row["agreement"]["agrees"]:
                bad = next(r for r in row["agreement"]["positions"] if not r["overlap"])
                log(f"WARNING: {bench} (T={temp}): vLLM acceptance at position {bad['position']} is "
                    f"{bad['vllm']:.3f} {bad['vllm_ci95']}, the built-in decoder's {bad['builtin']:.3f} "
                    f"{bad['builtin_ci95']}: the served head does not compute what was evaluated; likely an "
                    "export bug (layer ids, norms, d2t, RoPE): check convert/ against the engine")
        sec = sections.setdefault(bench, {"engine": f"vllm {with_spec['vllm_version']}", "method": serving.method,
                                          "export": serving.format, "num_speculative_tokens": k,
                                          "requests": "one at a time (batch 1), the eval's own prompt ids",
                                          "acceptance_definition": ACCEPTANCE_DEFINITION, "by_temperature": {}})
        sec["by_temperature"][temp] = row
        agree = row["agreement"]
        ours_txt = (f", built-in {ours.acceptance_rates[0]:.3f}" if ours is not None and ours.acceptance_rates else "")
        log(f"vllm {bench} T={temp}: acceptance per position "
            f"{' / '.join(f'{a:.3f}' for a in row['acceptance_per_position'])}{ours_txt}; mean acceptance length "
            f"{row['mean_acceptance_length']:.2f}; {tps:.1f} tok/s vs {plain_tps:.1f} plain ({row['speedup'] or 0:.2f}x); "
            + ("agrees with the built-in decoder" if agree.get("agrees") else
               "DISAGREES with the built-in decoder" if agree["compared"] else "not compared: " + agree["reason"]))
    for sec in sections.values():
        first = next(iter(sec["by_temperature"].values()))
        sec.update({key: first[key] for key in ("acceptance_per_position", "mean_acceptance_length", "tokens_per_s",
                                               "plain_tokens_per_s", "speedup", "agreement")})
    return sections


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
