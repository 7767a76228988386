"""Export a trained head to a serving-engine layout, or import a public checkpoint into a native head.

    # native head -> vLLM (speculators), SGLang, Medusa repository or DeepSeek-MTP layout
    python scripts/export.py --head runs/quickstart/head --to speculators --out exports/vllm
    python scripts/export.py --head runs/quickstart/head --to sglang --out exports/sglang
    # a public checkpoint -> a native head folder that eval.run can evaluate
    python scripts/export.py --import sglang --from path/to/EAGLE3-folder --target smollm2-135m --out runs/imported

The target (needed for its config, RoPE, embedding and lm_head) defaults to the one recorded in the head
folder; `--target` names another (a named default, a local folder or a Hub id). Every export is checked
key by key against convert/formats/<format>.json and refused, unwritten, if anything is missing.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from convert import (
    EXPORT_FORMATS,
    FLOAT_DTYPES,
    IMPORT_FORMATS,
    check_out,
    export_head,
    import_folder,
    write_head_folder,
)
from data.cli import cli_main
from data.config import TargetConfig
from data.target import load_target, resolve_device
from heads.base import TargetIO, read_head_config


def load_target_io(name: str, device: str = "cpu") -> TargetIO:
    """The TargetIO of a target name (named default, folder, GGUF file or Hub id), on `device`."""
    _, _, io = load_target(TargetConfig(name_or_path=name, device=str(resolve_device(device))))
    return io


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head", help="native head folder to export")
    p.add_argument("--to", choices=EXPORT_FORMATS, help="layout to export to")
    p.add_argument("--import", dest="import_fmt", choices=IMPORT_FORMATS, help="layout of --from to import")
    p.add_argument("--from", dest="src", help="folder to import (with --import)")
    p.add_argument("--out", required=True, help="folder to write")
    p.add_argument("--target", help="target name_or_path (default: the one recorded in --head)")
    p.add_argument("--verifier", help="name_or_path engines should load as the target (default: its Hub id)")
    p.add_argument("--speculative-tokens", type=int, default=5, help="speculators proposal length (default 5)")
    p.add_argument("--dtype", choices=sorted(FLOAT_DTYPES), help="cast float weights (default: keep)")
    p.add_argument("--device", default="cpu", help="device to load the target on (default cpu)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out folder")
    args = p.parse_args(argv)
    if bool(args.to) == bool(args.import_fmt):
        p.error("give either --to FORMAT (with --head) or --import FORMAT (with --from and --target)")
    if args.to and not args.head:
        p.error("--to needs --head")
    if args.import_fmt and not (args.src and args.target):
        p.error("--import needs --from and --target")
    return args


@cli_main
def main(argv: list[str] | None = None) -> int:
    """Exit 0 on success; a user error is one `error:` line and exit code 2 (data.cli.cli_main)."""
    args = parse_args(argv)
    if args.to:
        _, meta = read_head_config(args.head)
        target = load_target_io(args.target or meta["target"]["name_or_path"], args.device)
        out = export_head(args.head, args.to, args.out, target, verifier=args.verifier,
                          speculative_tokens=args.speculative_tokens, dtype=args.dtype, force=args.force)
        print(f"exported {args.head} -> {out} ({args.to}), checked against convert/formats/{args.to}.json")
    else:
        out_dir = Path(args.out)
        check_out(out_dir, args.force, (args.src,))  # before the target loads
        target = load_target_io(args.target, args.device)
        head, cfg, provenance = import_folder(args.src, args.import_fmt, target)
        write_head_folder(out_dir, head, cfg, target, provenance, args.force, (args.src,))
        print(f"imported {args.src} ({args.import_fmt}) -> {out_dir} (native {cfg.family} head)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
