"""Every repository file or module the prose names exists (pure text and `ast`: nothing is imported; ~1 s).

    .venv/bin/python -m pytest -q tests/test_docs.py

Prose is every docstring and comment of the Python files, the comments of the shell scripts (scripts/, .ci/),
and the docs: README.md, docs/*.md,
configs/**/README.md, convert/formats/README.md, data/bundled/README.md. In it:
  - a path that starts at a top-level folder of the repository (`train/loop.py`, `configs/tiny-eagle.yaml`,
    `docs/results.md`) must exist; one that climbs out of the repository (`../shared/docs/...`) is an error
    (the project must not need anything outside it); a bare upper-case document name (`README.md`) must
    exist next to the file naming it, at the top or in docs/ (lower-case bare names are run outputs:
    `report.md`);
  - a dotted module (`eval.policy`, `data.cli.cli_main`, `heads.base`) must have its first two parts as a
    module or package; `data.max_length`, `train.batch_size`, `eval.policy`, ... are config keys as well,
    so a key of that config section counts too (read from data/config.py's dataclasses by `ast`).
Paths with placeholders (`*`, `<...>`, `NNN`), folders that runs write (OUT/, runs/) and the docs' examples of
files a user or a new family adds (EXAMPLES) are not checked.
The rule is also run on a planted text to show it can fail.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP = ("configs", "convert", "data", "docs", "eval", "heads", "scripts", "tests", "train")
PACKAGES = ("convert", "data", "eval", "heads", "scripts", "tests", "train")
# Names the docs use for files that do not exist yet: docs/architecture.md walks through adding a family
# `hydra`, docs/multinode.md launches a user's own configs/my-run.yaml and configs/llama70b.yaml, and
# tests/test_registry.py writes its toy family into a temporary copy of the tree (heads/toy/).
EXAMPLES = ("hydra", "my-run", "llama70b", "heads/toy", "heads.toy")
_EXT = r"(?:py|md|yaml|yml|sh|sbatch|toml|json|jsonl|txt)"
# (a `.jsonl.gz` is a `.jsonl` followed by more extension: not matched; a sentence's full stop is fine)
PATH = re.compile(rf"(?<![\w./~$-])((?:\.\./)*(?:[\w.-]+/)*[\w-][\w.-]*\.{_EXT})(?![\w/]|\.\w)")
MODULE = re.compile(rf"(?<![\w./~$-])((?:{'|'.join(PACKAGES)})(?:\.[a-z_][a-z0-9_]*)+)(?![\w(/-])")
SECTIONS = {"data": "DataConfig", "train": "TrainConfig", "eval": "EvalConfig"}


def doc_files(root: Path) -> list[Path]:
    docs = [root / "README.md", *sorted((root / "docs").glob("*.md")), *sorted((root / "configs").rglob("README.md")),
            root / "convert" / "formats" / "README.md", root / "data" / "bundled" / "README.md"]
    return [p for p in docs if p.is_file()]


def python_prose(path: Path) -> str:
    """The docstrings and comments of one Python file, one per line group."""
    text = path.read_text()
    parts = [tok.string for tok in tokenize.generate_tokens(io.StringIO(text).readline) if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            parts += [doc] if doc else []
    return "\n".join(parts)


def config_keys(root: Path) -> dict[str, set[str]]:
    """{section: its field names} for the config sections that share a package's name."""
    tree = ast.parse((root / "data" / "config.py").read_text())
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    return {section: {s.target.id for s in classes[cls].body if isinstance(s, ast.AnnAssign)
                      and isinstance(s.target, ast.Name)} for section, cls in SECTIONS.items()}


def _path_ok(root: Path, where: Path, ref: str) -> bool | None:
    """True/False for a checked path, None for one this rule does not judge."""
    if re.search(r"[*<>{}]|NNN", ref) or any(name in ref for name in EXAMPLES):
        return None
    if ref.startswith("../"):
        return False
    if "/" not in ref:
        if not re.fullmatch(r"[A-Z][A-Z0-9_-]*\.md", ref):
            return None
        return any((d / ref).is_file() for d in (where.parent, root, root / "docs"))
    return (root / ref).exists() if ref.split("/")[0] in TOP else None


def _module_ok(root: Path, ref: str, keys: dict[str, set[str]]) -> bool:
    pkg, name = ref.split(".")[:2]
    return (name in EXAMPLES or (root / pkg / f"{name}.py").is_file()
            or (root / pkg / name).is_dir() or name in keys.get(pkg, set()))


def offenders(root: Path, sources: dict[Path, str]) -> list[str]:
    """'FILE: REF' for every reference in `sources` (file -> prose) to a file or module that is not there."""
    keys = config_keys(root)
    bad = []
    for where, text in sources.items():
        for ref in sorted(set(PATH.findall(text))):
            if _path_ok(root, where, ref) is False:
                bad.append(f"{where.relative_to(root)}: {ref}")
        # a path's dots (`data/config.py` read as `config.py`) are not module names: take paths out first
        for ref in sorted(set(MODULE.findall(PATH.sub(" ", text)))):
            if not _module_ok(root, ref, keys):
                bad.append(f"{where.relative_to(root)}: {ref}")
    return bad


def shell_prose(path: Path) -> str:
    return "\n".join(line for line in path.read_text().splitlines() if line.lstrip().startswith("#"))


def repo_sources(root: Path) -> dict[Path, str]:
    py = sorted(p for top in TOP for p in (root / top).rglob("*.py") if ".venv" not in p.parts)
    shell = sorted(p for p in [*(root / "scripts").rglob("*"), *(root / ".ci").glob("*")]
                   if p.is_file() and (p.suffix in (".sh", ".sbatch") or p.parent.name == ".ci"))
    return {**{p: python_prose(p) for p in py}, **{p: shell_prose(p) for p in shell},
            **{p: p.read_text() for p in doc_files(root)}}


def test_every_named_file_and_module_exists() -> None:
    bad = offenders(ROOT, repo_sources(ROOT))
    assert not bad, "prose names files or modules that do not exist:\n  " + "\n  ".join(bad)


def test_the_rule_can_fail() -> None:
    """Planted references: a missing doc, a missing module, a path out of the repository, a wrong config key."""
    where = ROOT / "train" / "planted.py"
    text = ("See SCIENCE.md and docs/nothing.md; train.nothing_here builds it (../shared/docs/FORMATS.md).\n"
            "data.not_a_key, but data.max_length, eval.policy, heads.base.HeadConfig and train/loop.py are fine.")
    assert offenders(ROOT, {where: text}) == [
        "train/planted.py: ../shared/docs/FORMATS.md", "train/planted.py: SCIENCE.md",
        "train/planted.py: docs/nothing.md", "train/planted.py: data.not_a_key", "train/planted.py: train.nothing_here"]
