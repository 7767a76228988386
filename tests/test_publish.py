"""scripts/publish.py: the model card, the staged files, refusal without an eval report, no token leaks.

The Hub client is replaced by fakes: a dry run must never touch it, a real run must call create_repo and
upload_folder with the staged folder. Uses a tiny EAGLE-3 head on the tiny random Llama.

    .venv/bin/python -m pytest -q tests/test_publish.py
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import huggingface_hub
import pytest
import torch

from heads import eagle
from heads.base import save_head, sha256_file

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "hf_TESTsecretTOKEN0123456789"
REPORT_MD = """# Speculative decoding eval

| bench | tau | speedup |
|---|---|---|
| mt_bench | 2.314 | 1.41 |
| gsm8k | 2.907 | 1.66 |"""


def _publish():
    spec = importlib.util.spec_from_file_location("publish", ROOT / "scripts" / "publish.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture()
def run_dir(tiny_target, tmp_path):
    """tmp/run/head (an EAGLE-3 head) and tmp/run/eval/report.{json,md}, as the quickstart lays them out."""
    _, _, io = tiny_target
    cfg = eagle.Eagle3Config(layer_ids=[1, 2, 3], draft_vocab_size=64)
    torch.manual_seed(0)
    head = eagle.build(cfg, io)
    extra = {"data": {"path": "runs/q/regenerated.jsonl", "conversations": 256}, "train": {"max_steps": 40}}
    save_head(tmp_path / "run" / "head", head, cfg, io, extra=extra)
    (tmp_path / "run" / "eval").mkdir()
    (tmp_path / "run" / "eval" / "report.md").write_text(REPORT_MD + "\n")
    # the shape eval.run writes: benchmarks.<name>.by_temperature.<t>.{tau, speedup, acceptance_per_position}
    report = {"speedup_model": {"best_k": 3}, "benchmarks": {
        "mt_bench": {"by_temperature": {"0.0": {"tau": 2.314, "speedup": 1.41, "acceptance_per_position": [0.7, 0.5]}}},
        "gsm8k": {"by_temperature": {"0.0": {"tau": 2.907, "speedup": 1.66, "acceptance_per_position": [0.8, 0.6]}}},
    }, "head_sha256": sha256_file(tmp_path / "run" / "head" / "model.safetensors")}  # eval.run records the head
    (tmp_path / "run" / "eval" / "report.json").write_text(json.dumps(report))
    return tmp_path / "run"


@pytest.fixture()
def no_hub(monkeypatch):
    """Any Hub call fails the test."""

    def boom(*a, **kw):
        raise AssertionError("the Hub was called")

    monkeypatch.setattr(huggingface_hub, "HfApi", boom)
    monkeypatch.setattr(huggingface_hub, "create_repo", boom)
    monkeypatch.setattr(huggingface_hub, "upload_folder", boom)


def test_dry_run_prints_card_with_measured_table(run_dir, no_hub, monkeypatch, capsys):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    rc = _publish().main(["--head", str(run_dir / "head"), "--repo-id", "me/tiny-eagle3", "--dry-run"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    text = out.out + out.err
    assert TOKEN not in text
    assert "| mt_bench | 2.314 | 1.41 |" in out.out and "tau = tokens emitted per target forward pass" in out.out
    for f in ("config.json", "model.safetensors", "sglang/config.json", "sglang/model.safetensors",
              "draftheads/config.json", "draftheads/model.safetensors", "eval/report.md", "README.md"):
        assert f"  {f}  (" in out.out, f
    assert "vllm serve tiny-random-llama" in out.out and "sglang.launch_server" in out.out
    # the measured best k (report.json) is the served draft length
    assert """"num_speculative_tokens": 3}'""" in out.out and "--speculative-num-draft-tokens 4" in out.out
    assert "license: apache-2.0" in out.out and '"max_steps": 40' in out.out
    assert "### Speculative decoding eval" in out.out  # the report's headings sit under the card's
    assert "dry run: nothing uploaded" in out.out


def test_refuses_without_report_unless_forced(run_dir, no_hub, capsys, tmp_path):
    lonely = tmp_path / "lonely"
    (run_dir / "head").rename(lonely)
    pub = _publish()
    assert pub.main(["--head", str(lonely), "--repo-id", "me/x", "--dry-run"]) == 2
    assert "no eval report" in capsys.readouterr().err
    assert pub.main(["--head", str(lonely), "--repo-id", "me/x", "--dry-run", "--force"]) == 0
    assert "unmeasured" in capsys.readouterr().out


def test_report_json_rendered_when_no_markdown(run_dir, no_hub, capsys):
    (run_dir / "eval" / "report.md").unlink()
    rc = _publish().main(["--head", str(run_dir / "head"), "--repo-id", "me/x", "--dry-run",
                          "--report", str(run_dir / "eval" / "report.json")])
    out = capsys.readouterr().out
    assert rc == 0
    assert "| benchmark | temperature | tau | acceptance per position | speedup | identical |" in out
    assert "| gsm8k | 0.0 | 2.907 | 0.80 / 0.60 | 1.660 |" in out


def test_upload_calls_hub_and_never_prints_token(run_dir, monkeypatch, capsys):
    calls: dict = {}

    class FakeApi:
        def __init__(self, token=None):
            calls["token"] = token

        def create_repo(self, repo_id, private=False, exist_ok=False, repo_type=None):
            calls["create"] = (repo_id, private, exist_ok)
            return f"https://huggingface.co/{repo_id}"

        def upload_folder(self, folder_path, repo_id, repo_type=None, commit_message=""):
            calls["files"] = sorted(str(p.relative_to(folder_path)) for p in Path(folder_path).rglob("*") if p.is_file())
            calls["card"] = (Path(folder_path) / "README.md").read_text()

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    rc = _publish().main(["--head", str(run_dir / "head"), "--repo-id", "me/tiny-eagle3", "--private"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert TOKEN not in out.out + out.err
    assert calls["token"] == TOKEN and calls["create"] == ("me/tiny-eagle3", True, True)
    assert {"README.md", "config.json", "sglang/model.safetensors", "eval/report.json"} <= set(calls["files"])
    assert "| gsm8k | 2.907 | 1.66 |" in calls["card"]


def test_hub_error_message_scrubs_token(run_dir, monkeypatch, capsys):
    class FailingApi:
        def __init__(self, token=None):
            self.token = token

        def create_repo(self, *a, **kw):
            raise RuntimeError(f"401 Unauthorized for token {self.token}")

    monkeypatch.setattr(huggingface_hub, "HfApi", FailingApi)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    assert _publish().main(["--head", str(run_dir / "head"), "--repo-id", "me/x"]) == 2
    out = capsys.readouterr()
    assert TOKEN not in out.out + out.err and "401 Unauthorized for token ***" in out.err
