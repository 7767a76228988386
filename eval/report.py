"""Assemble and write an eval run's report: report.json, report.md and PNG plots (matplotlib, Agg, no display).

`assemble_report(...)` puts eval.run's measured sections together with what ran and the definitions.

Files written into the run folder by `write_report(report, out_dir)` (report.json last, see there):
  report.json                  everything eval.run measured (benchmarks.<name>.tau / .speedup /
                               .acceptance_per_position, speedup_model.best_k / .predicted / .measured,
                               batch_sweep, vllm_concurrency, costs, ...)
  report.md                    a table per benchmark, what the drafting policy did (chosen draft lengths,
                               share of passes that drafted, accepted tokens by proposer), the speedup
                               model, the batch sweep (per method: throughput, latency, tau, crossover;
                               a text plot); with --engine vllm the served acceptance per benchmark
                               (engine faults in place of their numbers) and the engine's throughput
                               against concurrency (plain, fixed k, per-batch-size k, crossovers)
  acceptance_per_position.png  conditional acceptance at each draft position, per benchmark
  tau_by_category.png          tau per category, per benchmark
  speedup_vs_k.png             predicted speedup for each k, and the measured one at the k that ran
  throughput_vs_batch.png      tokens/s of the whole machine and per-request latency against batch size,
                               plain and every swept method (eval/batch.py)

    python -m eval.report runs/x/eval/report.json      # re-render report.md and the plots from the JSON
"""

from __future__ import annotations

import hashlib
import json
import math
import platform
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers and in tests
import matplotlib.pyplot as plt  # noqa: E402  (must follow the backend choice)
import torch  # noqa: E402

from data.cli import UserError, cli_main, write_atomic  # noqa: E402
from data.config import to_dict  # noqa: E402
from data.files import claim_folder  # noqa: E402
from heads.base import sha256_file  # noqa: E402

if TYPE_CHECKING:
    from data.config import EvalConfig, TargetConfig
    from eval.calibrate import Costs
    from eval.turns import Subject

PLOTS = ("acceptance_per_position.png", "tau_by_category.png", "speedup_vs_k.png", "throughput_vs_batch.png")
# Everything eval writes into its folder: it claims an unmarked folder only when it holds nothing else.
EVAL_OUTPUTS = ("config.yaml", "report.json", "report.md", *PLOTS)


def _f(x: Any, digits: int = 2, suffix: str = "") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    if isinstance(x, (int, float)):
        return f"{x:.{digits}f}{suffix}"
    return str(x)


def _acc(rates: list[float] | None) -> str:
    return " / ".join("-" if r is None else f"{r:.2f}" for r in rates) if rates else "-"


def _row(method: str, cat: str, r: dict[str, Any]) -> str:
    return (f"| {method} | {cat} | {_f(r.get('tau'))} | {_acc(r.get('acceptance_per_position'))} | "
            f"{_f(r.get('tokens_per_s'), 1)} | {_f(r.get('speedup'), 2, 'x')} | "
            f"{_f(r.get('decode_speedup'), 2, 'x')} | {_f(r.get('identical'))} |")


def markdown(report: dict[str, Any]) -> str:
    """The report as Markdown tables (also what `python -m eval.run` prints at the end)."""
    lines = [
        "# Speculative decoding eval",
        "",
        f"Target `{report['target']}`, drafter **{report['drafter']}**"
        + (f" (head `{report['head']}`)" if report.get("head") else "")
        + (f" sha256 `{report['head_sha256'][:16]}`" if report.get("head_sha256") else "")
        + (f", drafting in {report['draft_dtype']}" if report.get("draft_dtype") else "")
        + f", k = {report['k']} ({report['k_source']}), tree `{report.get('tree', 'chain')}`, "
        f"{report.get('cache', 'dynamic')} KV cache, "
        f"max {report['max_new_tokens']} new tokens, device {report['machine']['device']}.",
        "",
        f"- tau = {report['tau_definition']}.",
        f"- speedup = {report['speedup_definition']}.",
        "- acceptance per position = P(draft i accepted | drafts 1..i-1 accepted), positions 1..k.",
        "- identical = greedy output equal to plain decoding token for token (float32; '-' when sampling).",
        "",
    ]
    for name, b in report["benchmarks"].items():
        for temp, t in b["by_temperature"].items():
            lines += [f"## {name} (temperature {temp})", "",
                      "| method | category | tau | acceptance per position | tok/s | speedup | decode speedup | identical |",
                      "|---|---|---|---|---|---|---|---|",
                      f"| plain | all | 1.00 | - | {_f(t['plain']['tokens_per_s'], 1)} | 1.00x | 1.00x | yes |",
                      _row(report["drafter"], "all", t)]
            if len(t["categories"]) > 1:
                lines += [_row(report["drafter"], c, r) for c, r in t["categories"].items()]
            for m, r in t["baselines"].items():
                lines.append(_row(m, "all", r))
            if t.get("draft_vocab_coverage") is not None:
                cats = t["categories"] if len(t["categories"]) > 1 else {}
                by_cat = ", ".join(f"{c} {_f(r.get('draft_vocab_coverage'))}" for c, r in cats.items())
                lines += ["", f"Draft vocabulary: {_f(t['draft_vocab_coverage'])} of the plain answers' tokens are "
                          "inside the head's" + (f" ({by_cat})" if by_cat else "") + "; no draft can match a "
                          "token outside it."]
            lines.append("")
    lines += _policy_lines(report)
    sm = report["speedup_model"]
    dc = sm["draft_cost"]
    lines += [
        "## Speedup model",
        "",
        "speedup(k) = E(k) * T(1) / (D(k) + f*T(k+1) + (1-f)*T(1)), E(k) = 1 + f*(a1 + a1*a2 + ...) (eval.costs), "
        f"with the measured conditional acceptance a_i = {_acc(sm['acceptance_measured'])} (deeper positions reuse "
        f"the deepest measured rate), share of passes that draft f = {_f(sm['draft_rate'])}, draft cost "
        f"D(k) = {_f(dc['fixed_s'] * 1e3)} ms + k * {_f(dc['per_token_s'] * 1e3)} ms "
        f"(c = per-token draft cost / T(1) = {_f(sm['c'], 3)}), verify cost T(n) in ms: "
        + ", ".join(f"T({n}) {v * 1e3:.1f}" for n, v in sm["verify_cost_s"].items()) + ".",
        "",
        "| k | predicted tau | predicted speedup |",
        "|---|---|---|",
    ]
    lines += [f"| {k}{' (best)' if int(k) == sm['best_k'] else ''} | {_f(sm['predicted_tau'][k])} | {_f(v, 2, 'x')} |"
              for k, v in sm["predicted"].items()]
    m = sm.get("measured")
    if m:
        lines += ["", f"Best k = **{sm['best_k']}** (predicted {_f(sm['best_predicted_speedup'], 2, 'x')}). "
                  f"Ran k = {m['k']}: predicted tau {_f(m['predicted_tau'])} / decode speedup "
                  f"{_f(m['predicted_speedup'], 2, 'x')}; measured tau {_f(m['tau'])} / decode speedup "
                  f"{_f(m['speedup'], 2, 'x')} (end to end {_f(m.get('end_to_end_speedup'), 2, 'x')}; the measured tau "
                  f"priced at the measured costs with no loop overhead: {_f(m.get('ideal_speedup'), 2, 'x')})."]
    if sm.get("tree"):
        t = sm["tree"]
        lines += ["", f"The run drafted trees (~{t['nodes']} nodes, depth {t['depth']}): its measured tau {_f(t['tau'])} "
                  f"at the measured costs predicts {_f(t['predicted_speedup'], 2, 'x')}."]
    lines += batch_lines(report["batch_sweep"])
    lines += served_lines(report["benchmarks"])
    if report.get("vllm_concurrency"):
        lines += concurrency_lines(report["vllm_concurrency"])
    return "\n".join(lines)


def batch_lines(bs: dict[str, Any]) -> list[str]:
    """The batch sweep's section: throughput and per-request latency per batch size and method, the crossovers,
    and batch 1's tau against the single-stream decoder's on the same row."""
    names = bs["methods"]
    lines = ["", "## Batch-size sweep", "",
             f"Greedy, {bs['max_new_tokens']} new tokens per row, tokens/s = {bs['tokens_per_s']}, latency = "
             f"{bs['latency']}. Every row keeps its own accepted length (ragged acceptance, eval/batch.py). Methods: "
             + "; ".join(f"{n} (k {bs['k'][n]}, {bs['policy'][n]})" for n in names) + "." + _rounds(bs), "",
             "| batch | plain tok/s | plain latency s | " + " | ".join(f"{n} tok/s (speedup) | {n} latency s | {n} tau"
                                                            for n in names) + " | identical |",
             "|---" * (3 + 3 * len(names) + 1) + "|"]
    for r in bs["rows"]:
        ms = r["methods"]
        cells = [f"{_f(ms[n]['tok_s'], 1)} ({_f(ms[n]['speedup'], 2, 'x')}) | {_f(ms[n]['latency_s'])} | "
                 f"{_f(ms[n]['tau'])}" for n in names]
        lines.append(f"| {r['batch_size']} | {_f(r['plain_tok_s'], 1)} | {_f(r['plain_latency_s'])} | "
                     + " | ".join(cells) + f" | {_f(all(ms[n]['identical'] for n in names))} |")
    lines += ["", "Crossover (the first batch size where a method is not faster than plain): "
              + ", ".join(f"{n} **{c if c is not None else 'none in this range'}**" for n, c in bs["crossover"].items())
              + ".", "", "Batch 1 tau against the single-stream decoder's on the same row: "
              + ", ".join(f"{n} {_f(bs['rows'][0]['methods'][n]['tau'])} / {_f(t)}"
                          for n, t in bs["single_stream_tau"].items() if bs["rows"]) + ".", ""]
    lines += ["```", *text_plot(bs), "```", ""]
    return lines


def _rounds(bs: dict[str, Any]) -> str:
    """The sweep's rounds, as the report's sentence (empty for a report written before they were recorded)."""
    if not bs.get("repeats"):
        return ""
    extra = (f", the load-aware policy's over {bs['load_aware_repeats']} (the extra ones beside plain alone)"
             if bs.get("load_aware_repeats") else "")
    return f" Speedup = median of per-round ratios over {bs['repeats']} rounds{extra}."


def served_lines(benchmarks: dict[str, Any]) -> list[str]:
    """Per benchmark served by vLLM (--engine vllm): acceptance, tau, tokens/s and agreement per temperature;
    a row with an engine fault shows the fault sentence instead of its numbers."""
    lines: list[str] = []
    for name, b in benchmarks.items():
        v = b.get("vllm")
        if not v:
            continue
        lines += ["", f"## Served by vLLM: {name}", "",
                  f"{v['engine']} ({v.get('device', '?')}), method {v['method']}, k {v['num_speculative_tokens']} "
                  f"(eval k {v.get('eval_k', v['num_speculative_tokens'])}), drafts {v.get('draft_sample_method', 'greedy')}"
                  f", {v['requests']}.", "",
                  "| temperature | vLLM acceptance per position | built-in | tau | tok/s | plain tok/s | speedup | agreement |",
                  "|---|---|---|---|---|---|---|---|"]
        for temp, r in v["by_temperature"].items():
            agree = r["agreement"]
            verdict = (f"ENGINE FAULT: {r['engine_fault']}" if r.get("engine_fault") else
                       _f(agree["agrees"]) if agree["compared"] else f"not compared ({agree['reason']})")
            withheld = "withheld" if r.get("engine_fault") else None
            lines.append(f"| {temp} | {withheld or _acc(r['acceptance_per_position'])} | "
                         f"{_acc(r.get('builtin_acceptance_per_position'))} | {_f(r['mean_acceptance_length'])} | "
                         f"{_f(r['tokens_per_s'], 1)} | {_f(r['plain_tokens_per_s'], 1)} | "
                         f"{_f(r['speedup'], 2, 'x')} | {verdict} |")
    return lines + ([""] if lines else [])


def concurrency_lines(vc: dict[str, Any]) -> list[str]:
    """The engine's curve beside the batch sweep: plain and head tokens/s per concurrency, tau, the
    per-batch-size draft length's column, and both crossovers."""
    cross = ", ".join(f"{label} **{c if c is not None else 'none in this range'}**"
                      for label, c in (("fixed k", vc["crossover"]), ("per-batch-size k", vc.get("per_batch_crossover"))))
    lines = ["", "## vLLM throughput against concurrency", "",
             f"{vc['engine']} ({vc['device']}), {vc['method']} at k {vc['num_speculative_tokens']}: c requests "
             f"submitted together to one engine (max_num_seqs {vc['max_num_seqs']}), greedy, the eval's "
             f"{vc['prompts']} prompts cycled, {vc['max_new_tokens']} new tokens each (EOS ignored); tokens/s = "
             f"{vc['tokens_per_s']} (the batch sweep above counts decode only); tau = vLLM's mean acceptance "
             f"length. Per-batch-size k: num_speculative_tokens_per_batch_size {vc['per_batch_size_schedule']} "
             f"({vc['per_batch_size_rule']}), its columns from {vc['per_batch_size_run']}.", "",
             "| concurrency | plain tok/s | head tok/s | speedup | tau | per-batch-size k | its tok/s | its speedup | its tau |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in vc["rows"]:
        lines.append(f"| {r['concurrency']} | {_f(r['plain_tok_s'], 1)} | {_f(r['head_tok_s'], 1)} | "
                     f"{_f(r['speedup'], 2, 'x')} | {_f(r['tau'])} | {r.get('per_batch_k', '-')} | "
                     f"{_f(r.get('per_batch_tok_s'), 1)} | {_f(r.get('per_batch_speedup'), 2, 'x')} | "
                     f"{_f(r.get('per_batch_tau'))} |")
    return lines + ["", f"Crossover (the first concurrency where the head is not faster than plain): {cross}.", ""]


def text_plot(bs: dict[str, Any], width: int = 40) -> list[str]:
    """Speedup over plain against batch size as text bars (| marks 1.0x), one line per batch size and method."""
    top = max([1.0] + [m["speedup"] for r in bs["rows"] for m in r["methods"].values()])
    one = round(width / top)
    out = []
    for r in bs["rows"]:
        for n, m in r["methods"].items():
            bar = "#" * round(width * m["speedup"] / top)
            bar = (bar + " " * width)[:width]
            bar = bar[:one] + "|" + bar[one:]
            out.append(f"B={r['batch_size']:<3} {n:<18.18} {bar} {m['speedup']:.2f}x")
    return out


def _counts(d: dict[str, int] | None) -> str:
    return ", ".join(f"{k}: {v}" for k, v in d.items()) if d else "-"


def _policy_lines(report: dict[str, Any]) -> list[str]:
    """Per benchmark and category: the chosen draft lengths, drafted share and accepted tokens by proposer."""
    lines = ["## Drafting policy", "",
             f"Policy **{report.get('policy', 'fixed')}** (eval.policy). chosen k = passes per draft length per "
             "proposer (0 = a plain one-token pass); drafted = share of passes that verified a draft; accepted = "
             "accepted draft tokens by the proposer of their node (head+ngram = both proposed it).", "",
             "| benchmark | method | category | passes | drafted | chosen k | accepted by proposer |",
             "|---|---|---|---|---|---|---|"]
    for name, b in report["benchmarks"].items():
        rows = [(report["drafter"], b)] + [(m, r) for m, r in b.get("baselines", {}).items() if r.get("chosen_k")]
        for method, r in rows:
            cats = r.get("categories") or {}
            for cat, c in [("all", r)] + (list(cats.items()) if len(cats) > 1 else []):
                if not c.get("chosen_k") and not c.get("target_passes"):
                    continue
                ks = "; ".join(f"{src} {{{_counts(v)}}}" for src, v in (c.get("chosen_k") or {}).items())
                lines.append(f"| {name} | {method} | {cat} | {c.get('target_passes')} | {_f(c.get('draft_rate'))} | "
                             f"{ks or '-'} | {_counts(c.get('accepted_by_source'))} |")
    return lines + [""]


# ----------------------------------------------------------------------------------------------- plots
def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_acceptance(report: dict[str, Any], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for name, b in report["benchmarks"].items():
        rates = b.get("acceptance_per_position") or []
        if rates:
            ax.plot(range(1, len(rates) + 1), rates, marker="o", label=f"{name} ({report['drafter']})")
        ng = b["baselines"].get("ngram", {}).get("acceptance_per_position") if report["drafter"] != "ngram" else None
        if ng:
            ax.plot(range(1, len(ng) + 1), ng, marker="x", linestyle="--", label=f"{name} (ngram)")
    ax.set_xlabel("draft position i")
    ax.set_ylabel("P(accept i | 1..i-1 accepted)")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"Conditional acceptance per draft position (k={report['k']}, T={report['temperatures'][0]:g})")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    return _save(fig, path)


def plot_tau_by_category(report: dict[str, Any], path: Path) -> Path:
    labels, values = [], []
    for name, b in report["benchmarks"].items():
        for cat, r in b["categories"].items():
            labels.append(cat if cat == name else f"{name}/{cat}")
            values.append(r.get("tau") or 0.0)
    fig, ax = plt.subplots(figsize=(max(6.4, 0.6 * len(labels) + 2), 4.0))
    ax.bar(range(len(values)), values, color="tab:blue")
    ax.axhline(1.0, color="gray", linestyle=":", label="plain decoding (tau 1)")
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
    ax.set_ylabel("tau (tokens per target pass, incl. bonus)")
    ax.set_title(f"tau by category ({report['drafter']}, k={report['k']}, T={report['temperatures'][0]:g})")
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_speedup_vs_k(report: dict[str, Any], path: Path) -> Path:
    sm = report["speedup_model"]
    ks = [int(k) for k in sm["predicted"]]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    ax.plot(ks, list(sm["predicted"].values()), marker="o", label="predicted (measured acceptance and costs)")
    m = sm.get("measured")
    if m:
        ax.plot([m["k"]], [m["speedup"]], marker="*", markersize=14, linestyle="none", color="tab:red",
                label=f"measured at k={m['k']} (decode)")
    ax.axhline(1.0, color="gray", linestyle=":", label="plain decoding")
    ax.axvline(sm["best_k"], color="tab:green", linestyle="--", alpha=0.5, label=f"best k = {sm['best_k']}")
    ax.set_xlabel("draft length k")
    ax.set_ylabel("decode speedup over plain (x)")
    ax.set_title(f"Speedup against draft length k ({report['drafter']})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_throughput(report: dict[str, Any], path: Path) -> Path:
    """Throughput (left) and per-request latency (right) against batch size, plain and every swept method."""
    bs = report["batch_sweep"]
    b = [r["batch_size"] for r in bs["rows"]]
    fig, (ax, lat) = plt.subplots(1, 2, figsize=(11, 4.0))
    ax.plot(b, [r["plain_tok_s"] for r in bs["rows"]], marker="o", color="black", label="plain")
    lat.plot(b, [r["plain_latency_s"] for r in bs["rows"]], marker="o", color="black", label="plain")
    for name in bs["methods"]:
        ax.plot(b, [r["methods"][name]["tok_s"] for r in bs["rows"]], marker="s", label=f"{name} ({bs['policy'][name]})")
        lat.plot(b, [r["methods"][name]["latency_s"] for r in bs["rows"]], marker="s", label=name)
        cross = bs["crossover"].get(name)
        if cross is not None:
            ax.axvline(cross, linestyle="--", alpha=0.4, color=ax.lines[-1].get_color())
    for a_, ylabel in ((ax, "decode tokens/s, all rows together"), (lat, "mean per-request decode latency, s")):
        a_.set_xscale("log", base=2)
        a_.set_xticks(b, [str(x) for x in b])
        a_.set_xlabel("batch size")
        a_.set_ylabel(ylabel)
        a_.grid(alpha=0.3)
        a_.legend(fontsize=7)
    ax.set_title("Throughput (dashed: a fixed-k method's crossover)")
    lat.set_title("Latency per request")
    return _save(fig, path)


def claim_eval_folder(out_dir: str | Path) -> Path:
    """Make out_dir an eval folder (data.files.claim_folder): a training run, an export or a user's files
    there are refused (one line), never overwritten."""
    return claim_folder(out_dir, "eval", EVAL_OUTPUTS)


def write_report(report: dict[str, Any], out_dir: str | Path, config_yaml: str | None = None) -> list[Path]:
    """config.yaml (when given), report.md, the four plots, then report.json into out_dir; returns the paths.

    report.json is the commit record, written last and removed first: a run killed while writing leaves
    the previous complete set (killed before) or no report.json (killed during), never a report.json beside
    another run's report.md or config.yaml. It records the sha256 of both (`files`), which load_report checks."""
    out = claim_eval_folder(out_dir)
    (out / "report.json").unlink(missing_ok=True)
    report = {**report, "files": {}}
    if config_yaml is not None:
        write_atomic(out / "config.yaml", config_yaml)
        report["config_sha256"] = report["files"]["config.yaml"] = _sha256(config_yaml)
    md = markdown(report)
    paths = [write_atomic(out / "report.md", md)]
    report["files"]["report.md"] = _sha256(md)
    for fn, name in zip((plot_acceptance, plot_tau_by_category, plot_speedup_vs_k, plot_throughput), PLOTS):
        paths.append(fn(report, out / name))
    return [write_atomic(out / "report.json", json.dumps(report, indent=2, default=str)), *paths]


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def load_report(folder: str | Path) -> dict[str, Any]:
    """report.json of an eval folder, refused (UserError) when a file it records was changed or replaced
    since (an interrupted eval, an edit): the report and its Markdown always describe one run."""
    path = Path(folder) / "report.json"
    try:
        report = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path}: missing (no eval finished in {folder}; run eval.run --out {folder})") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: cannot read the report ({e})") from None
    if not isinstance(report, dict):
        raise UserError(f"{path}: not an eval report")
    for name, want in (report.get("files") or {}).items():
        f = Path(folder) / name
        if not f.is_file() or hashlib.sha256(f.read_bytes()).hexdigest() != want:
            raise UserError(f"{f}: does not match {path} (changed, or left by an interrupted eval): rerun the eval")
    return report


TAU_DEFINITION = "tokens per target forward pass, counting the corrected or bonus token (prefill excluded)"


def assemble_report(target_cfg: TargetConfig, head_dir: str | Path | None, subject: Subject, costs: Costs,
                    cfg_eval: EvalConfig, device: torch.device, *, benchmarks: dict[str, Any],
                    speedup: dict[str, Any], batch: dict[str, Any],
                    vllm_concurrency: dict[str, Any] | None = None) -> dict[str, Any]:
    """report.json: what ran and the definitions, then the measured sections, the machine and the config.
    vllm_concurrency: the engine's curve (eval/vllm_engine.py, --engine vllm), None without it."""
    return {
        "target": target_cfg.name_or_path,
        "head": None if head_dir is None else str(head_dir),
        "head_sha256": None if head_dir is None else sha256_file(Path(head_dir) / "model.safetensors"),
        "family": None if subject.head_cfg is None else subject.head_cfg.family,
        "drafter": subject.main,
        "draft_dtype": subject.draft_dtype,
        "k": costs.k,
        "k_source": "eval.num_draft_tokens" if cfg_eval.num_draft_tokens is not None
        else "eval.costs.choose_k: calibration acceptance and draft cost, measured verify curve",
        "tree": costs.tree["used"],  # eval.tree, or what "auto" became (costs.tree says why)
        "policy": cfg_eval.policy,
        "cache": cfg_eval.cache,
        "ngram_k": costs.k_ng,
        "tau_definition": TAU_DEFINITION,
        "speedup_definition": "speculative tokens/s over plain tokens/s of the same target on the same turns in "
                              "the same run (interleaved); end to end per turn, decode_speedup without prefill",
        "temperatures": list(cfg_eval.temperature),
        "max_new_tokens": cfg_eval.max_new_tokens,
        "methods": ["plain"] + subject.methods,
        "benchmarks": benchmarks,
        "speedup_model": speedup,
        "costs": costs.section(),
        "batch_sweep": batch,
        "vllm_concurrency": vllm_concurrency,
        "machine": {"device": str(device), "torch_threads": torch.get_num_threads(), "platform": platform.platform(),
                    "torch": torch.__version__},
        "eval_config": to_dict(cfg_eval),
    }


@cli_main
def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise UserError("usage: python -m eval.report REPORT.json")
    path = Path(args[0])
    try:
        report = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: cannot read the report ({e})") from None
    for p in write_report(report, path.parent):
        print(p)


if __name__ == "__main__":
    main()
