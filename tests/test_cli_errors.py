"""Bad input at the real entry points (python -m data.regenerate / data.tokenize / data.prompts, as subprocesses):
a malformed JSONL line, an unknown config key and a missing model file each give exit code 2 and one
`error:` line on stderr that names the place (file and line, key and file, or the missing path).

The subprocesses start together (each spends ~4 s importing torch and transformers).

    .venv/bin/python -m pytest -q tests/test_cli_errors.py
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from procs import communicate, start

ROOT = Path(__file__).resolve().parents[1]
NAMES = ["regenerate-malformed-line", "regenerate-unknown-key", "regenerate-missing-model",
         "tokenize-malformed-line", "tokenize-unknown-key", "tokenize-missing-model",
         "prompts-out-of-range", "prompts-unknown-domain-key"]


def _cases(tmp: Path) -> dict[str, tuple[list[str], str]]:
    """name -> (command-line arguments, text the one error line must contain)."""
    bad = tmp / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "fine"}) + "\n\n" + '{"prompt": "no closing brace"\n')
    typo = tmp / "typo.yaml"
    typo.write_text("target:\n  name_or_path: tiny-random-llama\nregenerate:\n  max_new_token: 8\n")
    tiny = ["--target.name_or_path=tiny-random-llama", "--target.device=cpu", "--out", str(tmp / "run")]
    return {
        "regenerate-malformed-line": (["data.regenerate", *tiny, f"--regenerate.prompts={bad}"],
                                      f"{bad}:3: invalid JSON"),
        "regenerate-unknown-key": (["data.regenerate", "--config", str(typo)],
                                   f"{typo}:4: unknown key 'regenerate.max_new_token'"),
        "regenerate-missing-model": (["data.regenerate", f"--target.name_or_path={tmp / 'gone.gguf'}"],
                                     f"GGUF file {tmp / 'gone.gguf'} does not exist"),
        "tokenize-malformed-line": (["data.tokenize", *tiny, f"--data.path={bad}"], f"{bad}:3: invalid JSON"),
        "tokenize-unknown-key": (["data.tokenize", *tiny, "--data.max_lenght=9"],
                                 "command line (<defaults> + overrides): unknown key 'data.max_lenght'"),
        "tokenize-missing-model": (["data.tokenize", f"--target.name_or_path={tmp / 'no-model'}"],
                                   f"target.name_or_path: {tmp / 'no-model'} does not exist"),
        "prompts-out-of-range": (["data.prompts", *tiny, "--prompts.mix_share=1.5"],
                                 "prompts.mix_share must be in [0, 1)"),
        "prompts-unknown-domain-key": (["data.prompts", *tiny, "--prompts.domains=[{name: a, hint: b}]"],
                                       "unknown key 'prompts.domains[0].hint'"),
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli")
    cases = _cases(tmp)
    assert sorted(cases) == sorted(NAMES)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1",
               WANDB_MODE="disabled")
    procs = {name: (start([sys.executable, "-m", *args], merge_stderr=False, cwd=ROOT, env=env), want)
             for name, (args, want) in cases.items()}
    out = {}
    for name, (p, want) in procs.items():
        stdout, stderr = communicate(p, timeout=300)
        out[name] = (p.returncode, stdout, stderr, want)
    return out


@pytest.mark.parametrize("name", NAMES)
def test_bad_input_gives_one_error_line_and_exit_2(results, name):
    rc, stdout, stderr, want = results[name]
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert rc == 2, f"exit code {rc}; stderr:\n{stderr}"
    assert len(lines) == 1 and lines[0].startswith("error: "), f"stderr is not one error line:\n{stderr}"
    assert want in lines[0]
    assert stdout == ""
