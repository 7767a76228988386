"""Write the bundled Python function stubs (data/bundled/python_stubs.jsonl) from the running Python's stdlib.

    python scripts/make_code_stubs.py --out data/bundled/python_stubs.jsonl     # what made the bundled file

A stub is a public top-level function of a pure-Python stdlib module cut after its docstring: the `def` line(s)
and the docstring, no body, as a HumanEval problem is. A `code_stub` prompt domain (configs/smollm2-135m-code.yaml)
reads them as passages and asks the target to complete one, so the head sees the target finish a function from
its signature and docstring. The stdlib is under the PSF license (data/bundled/licenses/Python.LICENSE); the
selection is deterministic for a given Python version (the bundled file's is in data/bundled/README.md):
files in sorted order, functions in source order, every function that passes the filters below, then an even
thinning to --max-stubs.
"""

from __future__ import annotations

import argparse
import ast
import json
import sysconfig
import textwrap
from pathlib import Path

from data.cli import cli_main, number_arg

# Packages whose code is tests, demos, GUI or generated tables: not what a user asks a model to write.
_SKIP_PARTS = {"test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip", "site-packages",
               "pydoc_data", "encodings", "__pycache__", "distutils", "venv", "unittest", "msilib"}


def stubs_of(path: Path, root: Path) -> list[dict]:
    """The stubs of one source file: public top-level functions with a docstring of 60-600 characters and a
    body of 3-25 lines after it (a task, not a one-line wrapper nor a page)."""
    source = path.read_text(encoding="utf-8")
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    lines = source.splitlines()
    out = []
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_") or node.decorator_list:
            continue
        doc = ast.get_docstring(node)
        if not doc or not 60 <= len(doc) <= 600 or len(node.body) < 2:
            continue
        body_lines = node.end_lineno - node.body[0].end_lineno
        if not 3 <= body_lines <= 25:
            continue
        stub = textwrap.dedent("\n".join(lines[node.lineno - 1: node.body[0].end_lineno])) + "\n"
        out.append({"text": stub, "source": f"{path.relative_to(root).as_posix()}:{node.lineno}"})
    return out


@cli_main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--max-stubs", type=number_arg("--max-stubs"), default=400)
    args = parser.parse_args()
    root = Path(sysconfig.get_paths()["stdlib"])
    stubs = []
    for path in sorted(root.rglob("*.py")):
        if not _SKIP_PARTS.intersection(path.relative_to(root).parts):
            stubs.extend(stubs_of(path, root))
    step = max(1.0, len(stubs) / args.max_stubs)
    kept = [stubs[int(i * step)] for i in range(min(args.max_stubs, len(stubs)))]
    with args.out.open("w", encoding="utf-8") as f:
        for row in kept:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"{len(kept)} of {len(stubs)} stubs from {root} -> {args.out}")


if __name__ == "__main__":
    main()
