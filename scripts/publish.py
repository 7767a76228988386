"""Publish a trained head to the Hugging Face Hub with a model card built from its measured eval report.

    python scripts/publish.py --head runs/quickstart/head --repo-id ORG/NAME --dry-run   # no network
    python scripts/publish.py --head runs/quickstart/head --repo-id ORG/NAME [--private]

The uploaded folder holds the engine layout at its root (EAGLE-3: vLLM speculators; Medusa: the Medusa
repository layout; MTP: the DeepSeek layout), `sglang/` for EAGLE-3, `draftheads/` (the native head, for
eval.run), `eval/` (the report) and README.md (the card: target, data, training config, the report's
table, how to serve with vLLM and SGLang, license). Every export is checked against convert/formats/.

The eval report is looked up as `--report PATH` (a report.json / report.md file or a folder holding them),
else next to the head (`HEAD/`, `HEAD/eval/`, `HEAD/../eval/`). Without one the script refuses unless
`--force`. The report must be eval.run's report.json of THIS head (its `head_sha256` is the sha256 of the
head's model.safetensors, and the files it records beside it are unchanged): a report of another head, or
a report.md alone (nothing to check it by), is refused even with --force. The card carries the head's
sha256 and the eval config's. `--repo-id` is checked against the Hub's rules
(huggingface_hub.utils.validate_repo_id) before anything runs. Only a failing Hub call is reported as
"upload failed"; the token comes from HF_TOKEN or huggingface_hub's login and is never printed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from convert import export_head, layouts_of, serving_note, verifier_id
from data.cli import UserError, cli_main, is_user_error, one_line
from data.config import TargetConfig
from data.files import MARKER
from data.target import load_target
from eval.report import load_report
from heads.base import read_head_config, sha256_file


class PublishError(UserError, RuntimeError):
    """Nothing to publish, or nowhere to stage it; the message names the folder."""

TAU_NOTE = "tau = tokens emitted per target forward pass, counting the corrected or bonus token (SGLang's accept_length)."


def find_report(head: Path, report: str | None) -> tuple[Path | None, Path | None]:
    """(report.json, report.md) for a head; either may be None."""
    candidates = [Path(report)] if report else [head, head / "eval", head.parent / "eval"]
    for c in candidates:
        if c.is_file():
            return (c, None) if c.suffix == ".json" else (None, c)
        js, md = c / "report.json", c / "report.md"
        if js.is_file() or md.is_file():
            return (js if js.is_file() else None, md if md.is_file() else None)
    if report:
        raise PublishError(f"--report {report}: no report.json or report.md there")
    return None, None


def check_report(head: Path, js: Path | None, md: Path | None) -> dict[str, str]:
    """Refuse (PublishError) a report that is not eval.run's of this head; returns what the card records
    of it (the head's and the eval config's sha256)."""
    if js is None:
        raise PublishError(f"{md}: a report.md without its report.json cannot be checked against the head; "
                           f"pass the eval folder (eval.run writes both)")
    report = load_report(js.parent) if js.name == "report.json" else json.loads(js.read_text())
    have = sha256_file(head / "model.safetensors")
    recorded = report.get("head_sha256")
    if recorded != have:
        what = f"measured another head (sha256 {str(recorded)[:16]}...)" if recorded else "records no head sha256"
        raise PublishError(f"{js}: {what}, not {head} (sha256 {have[:16]}...); rerun eval.run --head {head}")
    return {"head_sha256": have, "config_sha256": str(report.get("config_sha256") or "-")}


def _rows(obj: Any) -> list[dict] | None:
    """The first list of flat dicts inside a report (depth first): the rows of its table."""
    if isinstance(obj, list) and obj and all(isinstance(r, dict) for r in obj):
        return obj
    children = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, list) else []
    for v in children:
        found = _rows(v)
        if found:
            return found
    return None


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3f}"
    if isinstance(v, (dict, list)):
        return json.dumps(v)[:60]
    return str(v)


def benchmark_rows(report: dict) -> list[dict] | None:
    """One row per benchmark and temperature from eval.run's report.json (`benchmarks.<name>.by_temperature`)."""
    benches = report.get("benchmarks") if isinstance(report, dict) else None
    if not isinstance(benches, dict):
        return None
    rows = []
    for name, b in benches.items():
        for temp, t in (b.get("by_temperature") or {}).items():
            rows.append({"benchmark": name, "temperature": temp, "tau": t.get("tau"),
                         "acceptance per position": " / ".join(f"{a:.2f}" for a in t.get("acceptance_per_position") or []),
                         "speedup": t.get("speedup"), "identical": t.get("identical")})
    return rows or None


def report_table(js: Path | None, md: Path | None) -> str:
    """The measured table: report.md as eval wrote it, else a table rendered from report.json's rows."""
    if md is not None:
        # Demote the report's headings two levels: they sit under the card's "## Evaluation".
        return "\n".join("##" + line if line.startswith("#") else line for line in md.read_text().strip().splitlines())
    data = json.loads(js.read_text())
    rows = benchmark_rows(data) or _rows(data)
    if not rows:
        raise ValueError(f"{js}: no table rows (a list of objects) found in the report")
    cols = list(dict.fromkeys(k for r in rows for k in r if not isinstance(r[k], (dict, list))))
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_cell(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def best_k(js: Path | None, default: int = 5) -> int:
    """The draft length eval.run found best (report.json speedup_model.best_k), else `default`."""
    if js is None:
        return default
    k = json.loads(js.read_text()).get("speedup_model", {}).get("best_k")
    return int(k) if isinstance(k, int) and k > 0 else default


def serving_section(family: str, repo_id: str, target_hub: str, k: int = 5, head_config: dict | None = None) -> str:
    """How to serve the published folder with vLLM and SGLang (or why an engine cannot): the family's
    declaration in convert/<family>.py writes it, for the layouts `stage` puts in the folder (head_config: the
    native config.json's, which picks them)."""
    return serving_note(family, repo_id, target_hub, k, head_config)


def model_card(meta: dict, repo_id: str, table: str | None, files: list[str], license_id: str, k: int = 5,
               ids: dict[str, str] | None = None) -> str:
    """README.md for the Hub: YAML front matter, then target, data, config, eval table, serving, license.
    `ids`: the head's and the eval config's sha256 (check_report), named beside the table."""
    family = meta["family"]
    t = meta["target"]
    hub = verifier_id(t.get("name_or_path", ""))
    extra = meta.get("extra", {})
    front = ["---", f"license: {license_id}", f"base_model: {hub}", "tags:", "- speculative-decoding",
             f"- {family}", "- draftheads", "---"]
    measured = (f"\n\nMeasured head: sha256 `{ids['head_sha256']}`; eval config sha256 `{ids['config_sha256']}`."
                if ids else "")
    eval_part = (f"{table}\n\n{TAU_NOTE}{measured}" if table
                 else "No eval report was found: this head was published with --force and is unmeasured.")
    files_part = "\n".join(f"- `{f}`" for f in files)
    return "\n".join(front) + f"""

# {family} draft head for {hub}

A speculative-decoding drafter ({family}) trained with draftheads on the frozen target `{hub}`.

## Target
- name_or_path: `{t.get("name_or_path")}` (served as `{hub}`)
- hidden size {t.get("hidden_size")}, vocab {t.get("vocab_size")}, {t.get("num_hidden_layers")} layers,
  fingerprint `{t.get("fingerprint")}`
- captured layers (transformers `hidden_states` indices): {meta.get("layer_ids")}

## Training data and run
```json
{json.dumps(extra, indent=2)[:4000]}
```

## Head configuration
```json
{json.dumps(meta.get("head_config", {}), indent=2)}
```

## Evaluation (measured with the exact speculative decoder)
{eval_part}

## Serving
{serving_section(family, repo_id, hub, k, meta.get("head_config"))}

## Files
{files_part}

## License
{license_id}. The head was trained on outputs of `{hub}`; its use is also subject to the target's license.
"""


def stage(head: Path, meta: dict, out: Path, target_name: str, js: Path | None, md: Path | None, k: int = 5) -> None:
    """Write the folder to upload: root engine layout, sglang/, draftheads/, eval/."""
    family = meta["family"]
    _, _, target = load_target(TargetConfig(name_or_path=target_name, device="cpu"))
    # the family's main engine layout first (convert/<family>.py), of those this head exports to
    layouts = layouts_of(family, meta.get("head_config"))
    if not layouts:
        export_head(head, "native", out, target, force=True)
    else:
        export_head(head, layouts[0], out, target, speculative_tokens=k, force=True)
        export_head(head, "native", out / "draftheads", target)
        for fmt in layouts[1:]:  # EAGLE-3: sglang/
            export_head(head, fmt, out / fmt, target)
    report_dir = (js or md).parent if (js or md) else None
    extras = sorted(report_dir.glob("*.png")) if report_dir else []  # the plots report.md links to
    for src in [p for p in (js, md) if p is not None] + extras:
        (out / "eval").mkdir(exist_ok=True)
        shutil.copyfile(src, out / "eval" / src.name)


def _scrub(text: str, token: str | None) -> str:
    return text.replace(token, "***") if token else text


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head", required=True, help="native head folder")
    p.add_argument("--repo-id", required=True, help="Hub repository ORG/NAME")
    p.add_argument("--private", action="store_true", help="create the repository as private")
    p.add_argument("--dry-run", action="store_true", help="stage, list the files and print the card; no network")
    p.add_argument("--force", action="store_true", help="publish even without an eval report")
    p.add_argument("--report", help="report.json / report.md, or a folder holding them")
    p.add_argument("--target", help="target name_or_path (default: the one recorded in the head)")
    p.add_argument("--license", default="apache-2.0", help="license id for the card (default apache-2.0)")
    p.add_argument("--stage", help="folder to stage into (default: a temporary folder)")
    args = p.parse_args(argv)
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:  # the Hub's own rules (characters, length, '--' and '..'): a bad id never reaches the card's commands
        validate_repo_id(args.repo_id)
    except HFValidationError as e:
        p.error(f"--repo-id '{args.repo_id}': {' '.join(str(e).split())}")
    if args.repo_id.count("/") != 1:
        p.error(f"--repo-id must look like ORG/NAME, got '{args.repo_id}'")
    return args


def prepare(args: argparse.Namespace, out: Path) -> tuple[dict, list[str], str]:
    """Check the head and its report, stage the folder `out`, write its card: (meta, files, card)."""
    head = Path(args.head)
    _, meta = read_head_config(head)
    js, md = find_report(head, args.report)
    if js is None and md is None and not args.force:
        raise PublishError(
            f"{head}: no eval report (report.json / report.md in {head}, {head}/eval or {head.parent}/eval); "
            "run `python -m eval.run --head ...` first, pass --report, or --force to publish unmeasured"
        )
    ids = check_report(head, js, md) if (js or md) else None
    table = report_table(js, md) if (js or md) else None
    if out.exists():  # created fresh: a folder the tool did not create is never deleted
        raise PublishError(f"{out}: already exists; remove it yourself or give another --stage")
    k = best_k(js)  # the measured best draft length goes into the speculators config and the commands
    stage(head, meta, out, args.target or meta["target"]["name_or_path"], js, md, k)
    for marker in out.rglob(MARKER):  # the exports' ownership markers are local bookkeeping, not for the Hub
        marker.unlink()
    files = sorted(str(f.relative_to(out)) for f in out.rglob("*") if f.is_file()) + ["README.md"]
    card = model_card(meta, args.repo_id, table, sorted(files), args.license, k, ids)
    (out / "README.md").write_text(card)
    return meta, files, card


def upload(args: argparse.Namespace, out: Path, meta: dict, n_files: int, token: str | None) -> int:
    """create_repo + upload_folder; a failing Hub call (HTTP, auth) is one `upload failed` line, the token
    scrubbed (no traceback that could echo headers)."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        raise PublishError("HF_HUB_OFFLINE is set: unset it to publish (or use --dry-run)")
    from huggingface_hub import HfApi

    try:
        api = HfApi(token=token)
        url = api.create_repo(args.repo_id, private=args.private, exist_ok=True, repo_type="model")
        api.upload_folder(folder_path=str(out), repo_id=args.repo_id, repo_type="model",
                          commit_message=f"Upload {meta['family']} head ({n_files} files)")
    except Exception as e:
        print(f"error: upload failed: {type(e).__name__}: {_scrub(' '.join(str(e).split()), token)}", file=sys.stderr)
        return 2
    print(f"uploaded to {url}")
    return 0


@cli_main
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    token = os.environ.get("HF_TOKEN") or None
    tmp: tempfile.TemporaryDirectory | None = None
    try:
        if not args.stage:
            tmp = tempfile.TemporaryDirectory()
        out = Path(args.stage or tmp.name) / "publish"
        meta, files, card = prepare(args, out)
        print(f"files to upload to {args.repo_id}{' (private)' if args.private else ''}:")
        for f in sorted(files):
            print(f"  {f}  ({(out / f).stat().st_size} bytes)")
        print("\n" + card)
        if args.dry_run:
            print("dry run: nothing uploaded")
            return 0
        return upload(args, out, meta, len(files), token)
    except Exception as e:
        if not is_user_error(e):
            raise  # a bug in this tool, not an upload failure: its traceback says where
        print(f"error: {_scrub(one_line(e), token)}", file=sys.stderr)
        return 2
    finally:
        if tmp is not None:
            tmp.cleanup()


if __name__ == "__main__":
    raise SystemExit(main())
