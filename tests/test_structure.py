"""Structure rules of the library, checked on the source text alone (pure `ast`: nothing is imported; ~1 s).

    .venv/bin/python -m pytest -q tests/test_structure.py

(a) Function length: no function or method in data/, heads/, convert/, train/ or eval/ is longer than
    MAX_LINES = 100 lines, counted from its `def` line to its last line (decorators not counted, docstring
    and blank lines counted). A nested function counts on its own and as part of its parent.
(b) No head family in the loop or the eval: in train/loop.py and every eval/*.py (subfolders included),
    outside docstrings and comments, there is
      - no string constant equal to a family name (FAMILY_NAMES, compared stripped and case-insensitively),
        as in `family == "medusa"` or `{"eagle3": ...}`; a longer text that mentions a family, such as an
        error message saying "EAGLE-1", is allowed;
      - no identifier containing a family name (case-insensitive substring): variable, function, class,
        argument, keyword argument, attribute or import alias names, as in `medusa_tree` or `cfg.mtp_steps`;
      - no import of a family module (FAMILY_MODULES and their submodules).
    The loop and the eval reach a family only through the registry (heads.base.family_module), the family
    module's own functions (`drafter_factory`, ...) and convert/ (`served_by_vllm`), so adding a family
    touches neither.
(c) Layering: scripts -> train -> eval -> convert -> data -> heads. A module of one of these packages
    imports its own package or those to its right, never one to its left, whether at module level or
    inside a function. scripts/ is not a package and may import any of them.

Known offenders that other branches of issue 17 are fixing are listed in PENDING (one key per offence,
as the failure message prints it); a PENDING entry that no longer offends fails the test too, so the list
can only shrink. Each rule is also run on a planted source tree (a 101-line function, a family constant,
an upward import) to show it can fail.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 100
LAYERS = ("train", "eval", "convert", "data", "heads")  # left imports right, never the reverse
FAMILY_NAMES = ("eagle1", "eagle3", "medusa", "mtp", "dflash")
FAMILY_MODULES = ("heads.eagle", "heads.medusa", "heads.mtp", "convert.eagle1", "convert.eagle3",
                  "convert.medusa", "convert.mtp", "heads.dflash", "convert.dflash")
# Known offences, each "long: FILE::FUNCTION" or "family: FILE::FUNCTION"; an entry that no longer offends
# fails the test, so the list only shrinks. Empty since issue 17 merged.
PENDING: set[str] = set()


def _sources(root: Path, packages: tuple[str, ...]) -> list[Path]:
    return sorted(p for pkg in packages for p in (root / pkg).rglob("*.py") if ".venv" not in p.parts)


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, node) of every function and method, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = f"{prefix}{node.name}"
            if not isinstance(node, ast.ClassDef):
                yield name, node
            yield from _functions(node, name + ".")
        else:
            yield from _functions(node, prefix)


def long_functions(root: Path) -> set[str]:
    """Rule (a): 'long: path::qualname' for every function longer than MAX_LINES."""
    found = set()
    for path in _sources(root, LAYERS):
        for name, node in _functions(_parse(path)):
            if node.end_lineno - node.lineno + 1 > MAX_LINES:
                found.add(f"long: {path.relative_to(root).as_posix()}::{name}")
    return found


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring constants of the module, its classes and functions."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                out.add(id(first.value))
    return out


def _identifiers(node: ast.AST) -> list[str]:
    """The names a node itself introduces or uses (not those of its children)."""
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, (ast.arg, ast.keyword)):
        return [node.arg] if node.arg else []
    if isinstance(node, ast.alias):
        return [node.asname or node.name.split(".")[-1]]
    if isinstance(node, (ast.Global, ast.Nonlocal)):
        return list(node.names)
    return []


def _imported(node: ast.AST, names: bool = False) -> list[str]:
    """Absolute modules an import statement imports (relative imports stay in their package); with
    `names`, also `module.name` for each name of a from-import (`from heads import medusa`)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        return [node.module] + ([f"{node.module}.{a.name}" for a in node.names] if names else [])
    return []


def _family_hits(node: ast.AST, docstrings: set[int]) -> list[str]:
    hits = []
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings \
            and node.value.strip().lower() in FAMILY_NAMES:
        hits.append(f"string {node.value!r}")
    hits += [f"identifier {n!r}" for n in _identifiers(node) if any(f in n.lower() for f in FAMILY_NAMES)]
    family_imports = [m for m in _imported(node, names=True)
                      if any(m == fm or m.startswith(fm + ".") for fm in FAMILY_MODULES)]
    return hits + [f"import of {m}" for m in family_imports[:1]]


def _enclosing(tree: ast.Module) -> dict[int, str]:
    """id(node) -> qualified name of the innermost function holding it ('<module>' outside any)."""
    owner = {id(n): "<module>" for n in ast.walk(tree)}
    for name, fn in _functions(tree):  # parents come before their nested functions, which overwrite
        for n in ast.walk(fn):
            owner[id(n)] = name
    return owner


def family_names(root: Path) -> dict[str, list[str]]:
    """Rule (b): 'family: path::function' -> what names a family there."""
    paths = [root / "train" / "loop.py"] + _sources(root, ("eval",))
    found: dict[str, list[tuple[int, str]]] = {}
    for path in (p for p in paths if p.is_file()):
        tree = _parse(path)
        docstrings, owner = _docstrings(tree), _enclosing(tree)
        for node in ast.walk(tree):
            for hit in _family_hits(node, docstrings):
                key = f"family: {path.relative_to(root).as_posix()}::{owner[id(node)]}"
                found.setdefault(key, []).append((getattr(node, "lineno", 0), hit))
    return {k: [f"line {line}: {hit}" for line, hit in sorted(v)] for k, v in found.items()}


def upward_imports(root: Path) -> set[str]:
    """Rule (c): 'layer: path imports module' for every import of a package to the module's left."""
    found = set()
    for path in _sources(root, LAYERS):
        rank = LAYERS.index(path.relative_to(root).parts[0])
        for node in ast.walk(_parse(path)):
            for module in _imported(node):
                top = module.split(".")[0]
                if top in LAYERS and LAYERS.index(top) < rank:
                    found.add(f"layer: {path.relative_to(root).as_posix()} imports {module}")
    return found


def _check(found: set[str]) -> None:
    new = sorted(found - PENDING)
    assert not new, "structure rule broken (see tests/test_structure.py):\n" + "\n".join(new)


def test_no_function_longer_than_100_lines():
    _check(long_functions(ROOT))


def test_loop_and_eval_name_no_head_family():
    found = family_names(ROOT)
    new = {k: v for k, v in found.items() if k not in PENDING}
    assert not new, "the loop / eval name a head family:\n" + "\n".join(f"{k}: {v}" for k, v in sorted(new.items()))


def test_no_import_runs_up_the_layers():
    _check(upward_imports(ROOT))


def test_pending_entries_still_offend():
    """A fixed offence leaves PENDING, so the list only shrinks (the lead empties it after merging)."""
    current = long_functions(ROOT) | set(family_names(ROOT)) | upward_imports(ROOT)
    stale = sorted(PENDING - current)
    assert not stale, "fixed: remove from PENDING in tests/test_structure.py:\n" + "\n".join(stale)


# ----------------------------------------------------------------------------------------------- planted
def _plant(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture()
def planted(tmp_path: Path) -> Path:
    body = "".join(f"    x{i} = {i}\n" for i in range(99))  # def line + 99 lines + return = 101 lines
    _plant(tmp_path, "heads/long.py", f"def too_long():\n{body}    return 0\n\n\ndef fits():\n{body}")
    _plant(tmp_path, "eval/fam.py", '"""Mentions medusa and eagle3 in a docstring: allowed."""\n'
           "from heads.medusa import build\n\n\ndef pick(family):\n"
           '    """eagle1"""\n    if family == "EAGLE3":\n        return build\n'
           '    msg = "no vLLM layout is exported for EAGLE-1"\n    mtp_steps = 2\n    return msg, mtp_steps\n')
    _plant(tmp_path, "train/loop.py", "def step(cfg):\n    return cfg.medusa_heads\n")
    _plant(tmp_path, "data/up.py", "def f():\n    from eval.run import evaluate\n\n    return evaluate\n")
    _plant(tmp_path, "convert/ok.py", "from data.config import load_config\nfrom heads.base import TargetIO\n")
    return tmp_path


def test_planted_offences_are_found(planted: Path):
    assert long_functions(planted) == {"long: heads/long.py::too_long"}
    found = family_names(planted)
    assert sorted(found) == ["family: eval/fam.py::<module>", "family: eval/fam.py::pick",
                             "family: train/loop.py::step"]
    # the docstring "eagle1" and the message mentioning EAGLE-1 are allowed
    assert found["family: eval/fam.py::pick"] == ["line 7: string 'EAGLE3'", "line 10: identifier 'mtp_steps'",
                                                  "line 11: identifier 'mtp_steps'"]
    assert found["family: eval/fam.py::<module>"] == ["line 2: import of heads.medusa"]
    assert found["family: train/loop.py::step"] == ["line 2: identifier 'medusa_heads'"]
    assert upward_imports(planted) == {"layer: data/up.py imports eval.run"}
