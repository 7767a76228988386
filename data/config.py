"""Run configuration: nested dataclasses loaded from YAML, with dotted command-line overrides.

Every entry script (`python -m data.regenerate`, `python -m data.extract`, `train/*.py`, `python -m eval.run`)
accepts the same flags:

    python train/eagle.py --config configs/tiny-eagle.yaml --optim.lr=3e-4 --head.ttt_length=3 --out runs/x

An unknown key, a value of the wrong type, a value out of range (ENUMS, RANGES: `optim.lr` > 0,
`optim.warmup_steps` >= 0, 0 <= `optim.min_lr_ratio` <= 1, ...) or an empty file raises `ConfigError` naming
the key and the file (or the command-line flag) it came from, when the config is loaded and before any
model loads; entry scripts turn that into one line on stderr and exit code 2 (data.cli.cli_main).
`check_layer_ids` checks the head's layer ids against the target's config (read without its weights).
The resolved config is written as `config.yaml` into the run's output folder (`save_config`).

The `head` section is family specific: its `family` key selects the dataclass from the head registry
(`heads.registry`), so a Medusa field in an EAGLE config is an error too.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

from data.cli import UserError, one_line, write_atomic
from heads.base import HeadConfig

T = TypeVar("T")


class ConfigError(UserError, ValueError):
    """A config key or value is wrong; the message names the key and where it came from."""


# ----------------------------------------------------------------------------------------------- schema
@dataclass
class TargetConfig:
    """The frozen target model."""

    name_or_path: str = "smollm2-135m"  # hub id, local folder, .gguf file, or a named default (see data.target)
    revision: str | None = None  # hub revision (branch, tag or commit)
    gguf_file: str | None = None  # GGUF file name inside name_or_path (hub id or folder)
    dtype: str = "float32"  # float32 | bfloat16 | float16
    device: str = "auto"  # auto (cuda if available) | cpu | cuda | cuda:N
    # "auto" (or balanced, sequential): split the target's layers over every GPU this process sees, to
    # extract features of a target bigger than one GPU (one process per node; data.extract refuses more).
    # `device` is then unused. Training refuses it (ZeRO-3 / FSDP shard the target there).
    device_map: str | None = None
    trust_remote_code: bool = False  # never set unless you trust the repository's code
    # packed: CPU float32 inference (eval, prompts, regeneration) runs the linear layers on oneDNN-prepacked
    # weights (data.packed: T(k) nearly flat in k); dense: torch's default kernels.
    cpu_kernels: str = "packed"


@dataclass
class DataConfig:
    """Conversations to train on and how to tokenize them."""

    path: str = "data/bundled/tiny_conversations.jsonl"  # JSONL file, folder, or `datasets` name
    format: str = "auto"  # auto | sharegpt | messages | mtbench | qa | prompts | hf
    split: str = "train"  # split, for `datasets` names
    max_samples: int | None = None  # keep the first N records
    skip_malformed: bool = False  # skip (and count) malformed records instead of failing
    max_length: int = 2048  # truncate tokenized conversations to this many tokens
    holdout_fraction: float = 0.05  # share of conversations kept out of training for held-out metrics
    chat_template: str | None = None  # Jinja template overriding the tokenizer's own
    cache_dir: str | None = None  # where tokenized datasets are cached (default: next to the run)


@dataclass
class RegenerateConfig:
    """Self-distillation: answer the prompts with the target itself (python -m data.regenerate)."""

    prompts: str = "data/bundled/gsm8k_train.jsonl"  # prompt file (any format data.readers understands)
    output: str = "regenerated.jsonl"  # ShareGPT JSONL written (relative paths go under --out)
    num_prompts: int | None = 64  # first N prompts; null for all
    batch_size: int = 8  # prompts generated together (left padded)
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    system_prompt: str | None = None
    split: str = "train"  # split, for `datasets` names (e.g. train_sft for UltraChat)
    skip_malformed: bool = False  # skip (and count) malformed prompt records instead of failing
    # hf: transformers' batched generate (batch_size prompts at a time). vllm: vLLM's offline engine (the
    # `vllm` extra); batch_size is then the chunk of prompts handed to vLLM at once and fsynced after
    # (vLLM batches inside a chunk itself: use hundreds on GPUs).
    engine: str = "hf"
    tensor_parallel_size: int = 1  # vllm: GPUs one copy of the target is split over
    data_parallel_size: int = 1  # vllm: copies of the target on this node, each serving part of a chunk
    memory: float | None = None  # vllm: gpu_memory_utilization (CPU: share of host memory); null = 0.9 GPU, 0.3 CPU
    # SLURM job arrays (scripts/slurm/regenerate.sbatch): this task answers the shard_index-th of num_shards
    # contiguous slices of the prompts into <output stem>.shard-I-of-N.jsonl; `merge` joins them in order.
    num_shards: int = 1
    shard_index: int = 0


@dataclass
class PromptDomain:
    """One kind of self-written prompt (python -m data.prompts)."""

    name: str = "general"
    weight: float = 1.0  # relative share of candidates drawn from this domain
    system: str | None = None  # system hint rendered while the target writes the user turn (not kept)
    openers: list[str] = field(default_factory=list)  # opening words of the user turn; one is drawn per item


def _default_domains() -> list[PromptDomain]:
    return [
        PromptDomain("coding", 1.0, "The user asks for help with a programming task.",
                     ["Write a Python function that", "How do I", "Write a program that", "Fix this code:"]),
        PromptDomain("math", 1.0, "The user asks a math word problem.", ["A store", "If", "Tom has", "Solve"]),
        PromptDomain("writing", 1.0, "The user asks for a piece of writing.",
                     ["Write a short story about", "Write an email to", "Write a poem about", "Compose"]),
        PromptDomain("explain", 1.0, "The user asks a question about science, history or the world.",
                     ["What is", "Explain", "Why do", "How does"]),
        PromptDomain("reasoning", 1.0, "The user asks a question that needs careful reasoning.",
                     ["Which", "Compare", "What are the pros and cons of", "Is it true that"]),
        PromptDomain("advice", 1.0, "The user asks for everyday advice.",
                     ["How can I", "What should I", "Give me tips", "I want to"]),
    ]


@dataclass
class PromptsConfig:
    """Self-written prompts: the target writes user turns, filtered and mixed (python -m data.prompts)."""

    output: str = "prompts.jsonl"  # prompt JSONL written (relative paths go under --out)
    num_prompts: int = 256  # prompts in the output, mixed ones included
    mix_prompts: str | None = "data/bundled/gsm8k_train.jsonl"  # prompt file mixed in (its first prompts)
    mix_share: float = 0.25  # share of the output taken from mix_prompts, in [0, 1)
    domains: list[PromptDomain] = field(default_factory=_default_domains)
    batch_size: int = 16  # candidates sampled together (left padded)
    max_new_tokens: int = 96  # a user turn longer than this is dropped as unfinished
    temperature: float = 1.0  # > 0: a greedy target would write one prompt per domain
    top_p: float = 0.95
    min_chars: int = 16  # shorter prompts are dropped
    min_words: int = 4
    ngram: int = 5  # word n-gram size for duplicate and benchmark-overlap checks
    max_dup_overlap: float = 0.5  # drop a prompt sharing this share of its n-grams with one kept prompt
    max_bench_overlap: float = 0.3  # drop a prompt sharing this share of n-grams with a benchmark prompt
    max_candidates_factor: int = 8  # give up after num_prompts x this many candidates


@dataclass
class FeaturesConfig:
    """Where training features come from (python -m data.extract for the offline store)."""

    mode: str = "offline"  # offline (read a store) | online (run the target inside the training loop)
    store: str = "features"  # store folder (relative paths go under --out)
    dtype: str = "bfloat16"  # stored dtype: bfloat16 | float16 | float32
    shard_tokens: int = 262144  # tokens per shard file
    batch_tokens: int = 8192  # tokens per target forward during extraction
    verify_on_read: bool = True  # offline: hash each shard once when first read (names a corrupted shard)


@dataclass
class OptimConfig:
    """AdamW over head parameters, linear warmup then cosine decay."""

    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    grad_clip: float = 0.5
    grad_accum: int = 1


@dataclass
class TrainConfig:
    """The shared training loop (train/loop.py)."""

    epochs: int = 1
    max_steps: int | None = None  # stop after this many optimizer steps (overrides epochs)
    batch_size: int = 4  # conversations per micro-batch per process
    # sequences per optimizer step over all processes; null = batch_size x processes x optim.grad_accum.
    # When set, grad_accum = global_batch_size / (batch_size x processes), so 1 and N processes train alike.
    global_batch_size: int | None = None
    mixed_precision: str = "no"  # no | bf16 | fp16 (accelerate)
    checkpoint_every: int = 500  # optimizer steps between checkpoints
    eval_every: int = 200  # optimizer steps between held-out evaluations
    log_every: int = 10
    eval_at_end: bool = False  # run eval.run on the trained head when training ends


@dataclass
class LoggingConfig:
    wandb_mode: str = "offline"  # offline | online | disabled (never prompts for a login)
    wandb_project: str = "draftheads"
    run_name: str | None = None


@dataclass
class EvalConfig:
    """Speculative decoding evaluation (python -m eval.run)."""

    bench: list[str] = field(default_factory=lambda: ["mt_bench"])  # bundled names or question files
    max_questions: int | None = None
    max_new_tokens: int = 128
    temperature: list[float] = field(default_factory=lambda: [0.0])
    num_draft_tokens: int | None = None  # chain length k; null = choose from measured costs
    tree: str = "auto"  # auto | chain | static | dynamic
    policy: str = "adaptive"  # adaptive (eval.policy: per-pass k from this request's acceptance) | fixed (k every pass)
    batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])


@dataclass
class RunConfig:
    """Everything one run needs; each section is documented by its dataclass."""

    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)
    prompts: PromptsConfig = field(default_factory=PromptsConfig)
    features: FeaturesConfig = field(default_factory=FeaturesConfig)
    head: HeadConfig = field(default_factory=lambda: HeadConfig.resolve_class({})())  # see heads/*.py
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    seed: int = 0
    out: str = "runs/default"  # output folder; --out overrides


# ----------------------------------------------------------------------------------------------- ranges
# (section, key) -> allowed values; checked when a config is loaded, before anything heavy starts.
ENUMS: dict[tuple[str, str], tuple[str, ...]] = {
    ("target", "dtype"): ("float32", "bfloat16", "float16"),
    ("target", "cpu_kernels"): ("packed", "dense"),
    ("data", "format"): ("auto", "sharegpt", "messages", "mtbench", "qa", "prompts", "hf"),
    ("features", "mode"): ("offline", "online"),
    ("features", "dtype"): ("bfloat16", "float16", "float32"),
    ("train", "mixed_precision"): ("no", "bf16", "fp16"),
    ("logging", "wandb_mode"): ("offline", "online", "disabled"),
    ("eval", "tree"): ("auto", "chain", "static", "dynamic"),
}
# (section, key) -> (lowest, highest, lowest excluded); None values (where allowed) are not checked.
RANGES: dict[tuple[str, str], tuple[float, float, bool]] = {
    ("optim", "lr"): (0.0, math.inf, True),
    ("optim", "weight_decay"): (0.0, math.inf, False),
    ("optim", "warmup_steps"): (0, math.inf, False),
    ("optim", "min_lr_ratio"): (0.0, 1.0, False),
    ("optim", "grad_clip"): (0.0, math.inf, False),
    ("optim", "grad_accum"): (1, math.inf, False),
    ("train", "epochs"): (1, math.inf, False),
    ("train", "max_steps"): (1, math.inf, False),
    ("train", "batch_size"): (1, math.inf, False),
    ("train", "global_batch_size"): (1, math.inf, False),
    ("train", "checkpoint_every"): (1, math.inf, False),
    ("train", "eval_every"): (1, math.inf, False),
    ("train", "log_every"): (1, math.inf, False),
    ("data", "max_samples"): (1, math.inf, False),
    ("data", "max_length"): (2, math.inf, False),
    ("data", "holdout_fraction"): (0.0, 1.0, False),
    ("features", "shard_tokens"): (1, math.inf, False),
    ("features", "batch_tokens"): (1, math.inf, False),
    ("regenerate", "num_prompts"): (1, math.inf, False),
    ("regenerate", "batch_size"): (1, math.inf, False),
    ("regenerate", "max_new_tokens"): (1, math.inf, False),
    ("regenerate", "temperature"): (0.0, math.inf, False),
    ("regenerate", "top_p"): (0.0, 1.0, True),
    ("eval", "max_questions"): (1, math.inf, False),
    ("eval", "max_new_tokens"): (1, math.inf, False),
    ("eval", "num_draft_tokens"): (1, math.inf, False),
}


def _check_value(value: Any, key: str, source: str, lo: float, hi: float, open_lo: bool) -> None:
    if value is None or isinstance(value, str):
        return
    bad = not math.isfinite(value) or value < lo or value > hi or (open_lo and value == lo)
    if bad:
        low = f"> {lo:g}" if open_lo else f">= {lo:g}"
        want = low if hi == math.inf else f"in [{lo:g}, {hi:g}]" if not open_lo else f"in ({lo:g}, {hi:g}]"
        raise ConfigError(f"{source}: key '{key}': must be {want}, got {value!r}")


def validate(cfg: Any, source: str) -> None:
    """Refuse values out of range or misspelled enums (a RunConfig; other classes are not checked)."""
    if not isinstance(cfg, RunConfig):
        return
    for (section, key), allowed in ENUMS.items():
        value = getattr(getattr(cfg, section), key)
        if value not in allowed:
            raise ConfigError(f"{source}: key '{section}.{key}': '{value}' is not one of {', '.join(allowed)}")
    for (section, key), (lo, hi, open_lo) in RANGES.items():
        _check_value(getattr(getattr(cfg, section), key), f"{section}.{key}", source, lo, hi, open_lo)
    for i, b in enumerate(cfg.optim.betas):
        _check_value(b, f"optim.betas[{i}]", source, 0.0, 0.999999, False)
    for t in cfg.eval.temperature:
        _check_value(t, "eval.temperature", source, 0.0, math.inf, False)
    for b in cfg.eval.batch_sizes:
        _check_value(b, "eval.batch_sizes", source, 1, math.inf, False)
    ids = getattr(cfg.head, "layer_ids", None)
    if ids is not None and (not ids or list(ids) != sorted(set(ids)) or min(ids) < 0):
        raise ConfigError(f"{source}: key 'head.layer_ids': {list(ids)} must be ascending, distinct and >= 0")


def check_layer_ids(cfg: RunConfig, target_config: Any) -> list[int]:
    """The head's feature layers for this target config (read without weights); ConfigError when out of range."""
    from heads.base import family_module

    try:
        return list(family_module(cfg.head.family).feature_layers(cfg.head, target_config))
    except ValueError as e:
        raise ConfigError(f"config key 'head.layer_ids' for target '{cfg.target.name_or_path}': {e}") from None


# ----------------------------------------------------------------------------------------------- machinery
def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str, source: str) -> Any:
    """Check `value` against the annotation `tp`, converting only where it is lossless (int -> float)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key, source)
            except ConfigError:
                continue
        raise ConfigError(f"{source}: key '{key}': expected {_type_name(tp)}, got {value!r}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: key '{key}': expected a mapping, got {value!r}")
        return from_dict(tp, value, source, prefix=key + ".")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{source}: key '{key}': expected a list, got {value!r}")
        args = typing.get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(f"{source}: key '{key}': expected {len(args)} items, got {value!r}")
            return tuple(_coerce(v, a, f"{key}[{i}]", source) for i, (v, a) in enumerate(zip(value, args)))
        item = args[0] if args else Any
        out = [_coerce(v, item, f"{key}[{i}]", source) for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: key '{key}': expected a mapping, got {value!r}")
        return dict(value)
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        # YAML 1.1 reads "3e-4" (no dot) as a string; accept it where a float is expected.
        try:
            return float(value)
        except ValueError:
            pass
    if tp is bool and not isinstance(value, bool):
        raise ConfigError(f"{source}: key '{key}': expected true/false, got {value!r}")
    if tp is int and isinstance(value, bool):
        raise ConfigError(f"{source}: key '{key}': expected int, got {value!r}")
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(f"{source}: key '{key}': expected {_type_name(tp)}, got {value!r}")
    return value


def from_dict(cls: type[T], data: dict, source: str = "<dict>", prefix: str = "") -> T:
    """Build dataclass `cls` from `data`, refusing unknown keys and wrong types (naming key and source).

    A dataclass may define `resolve_class(data) -> subclass` to pick a subclass from the data itself
    (the head section picks its family's dataclass from `family`).
    """
    if hasattr(cls, "resolve_class"):
        try:
            cls = cls.resolve_class(data)
        except (KeyError, ValueError) as e:
            raise ConfigError(f"{source}: key '{prefix}family': {e}") from None
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(
            f"{source}: unknown key '{prefix}{unknown[0]}' (known in '{prefix or '<top>'}': {', '.join(sorted(names))})"
        )
    kwargs = {k: _coerce(v, hints[k], prefix + k, source) for k, v in data.items()}
    return cls(**kwargs)


def to_dict(obj: Any) -> Any:
    """Dataclass -> plain dict (tuples become lists), ready for YAML or JSON."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


class _UniqueKeyLoader(yaml.SafeLoader):
    """A safe YAML loader that refuses duplicate keys (plain YAML silently keeps the last one)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key '{key}'", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        nxt = node.get(p)
        if nxt is None:
            nxt = node[p] = {}
        if not isinstance(nxt, dict):
            raise ConfigError(f"command line: key '{dotted}': '{p}' is not a section")
        node = nxt
    node[parts[-1]] = value


def load_config(
    path: str | Path | None, overrides: list[str] | None = None, cls: type[T] = RunConfig
) -> T:
    """Load `cls` from a YAML file and apply `--a.b=value` overrides (values parsed as YAML)."""
    tree: dict = {}
    source = "<defaults>"
    if path is not None:
        source = str(path)
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ConfigError(f"{path}: cannot read config: {e.strerror}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not UTF-8 text (byte {e.start})") from None
        try:
            tree = yaml.load(text, Loader=_UniqueKeyLoader)
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: invalid YAML: {e}") from None
        if tree is None:
            raise ConfigError(f"{path}: the config file is empty (give at least one section, e.g. `target:`)")
        if not isinstance(tree, dict):
            raise ConfigError(f"{path}: top level must be a mapping")
    cfg = from_dict(cls, tree, source)
    if not overrides:
        validate(cfg, source)
    else:
        # Overrides go onto the file's own tree (not the filled-in defaults), so switching
        # --head.family does not drag the old family's default keys along.
        merged = tree
        for item in overrides:
            flag = item[2:] if item.startswith("--") else item
            if "=" not in flag:
                raise ConfigError(f"command line: override '{item}' must look like --key.sub=value")
            key, raw = flag.split("=", 1)
            try:
                value = yaml.safe_load(raw) if raw != "" else None
            except yaml.YAMLError:
                value = raw
            _set_dotted(merged, key, value)
        where = f"command line ({source} + overrides)"
        cfg = from_dict(cls, merged, where)
        validate(cfg, where)
    return cfg


def save_config(cfg: Any, out_dir: str | Path) -> Path:
    """Write the resolved config to OUT/config.yaml (what the run really used)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return write_atomic(out / "config.yaml", yaml.safe_dump(to_dict(cfg), sort_keys=False))


def parse_args(
    description: str, argv: list[str] | None = None, extra: typing.Callable[[argparse.ArgumentParser], None] | None = None
) -> tuple[RunConfig, argparse.Namespace]:
    """The common CLI: `--config FILE`, `--out DIR`, dotted overrides; `extra` adds script flags.

    Exits with code 2 and one line on stderr on a config error.
    """
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", help="YAML run config (configs/*.yaml)")
    parser.add_argument("--out", help="output folder (overrides the config's `out`)")
    if extra is not None:
        extra(parser)
    args, rest = parser.parse_known_args(argv)
    try:
        cfg = load_config(args.config, rest)
    except ConfigError as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.out:
        cfg.out = args.out
    return cfg, args
