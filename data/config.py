"""Run configuration: nested dataclasses loaded from YAML, with dotted command-line overrides.

Every entry script (`python -m data.regenerate`, `python -m data.extract`, `train/*.py`, `python -m eval.run`)
accepts the same flags:

    python train/eagle.py --config configs/tiny-eagle.yaml --optim.lr=3e-4 --head.ttt_length=3 --out runs/x

Values read as YAML 1.2 does: `3e-4` is a float, only true / false are booleans (`no`, `off` stay strings, so
`--train.mixed_precision=no` is the choice "no").

The sections are plain dataclasses (building one in code checks nothing); `load_config` validates the YAML
tree against them with pydantic: unknown keys (`extra="forbid"`), strict types (no "5" for an int, no 1 for a
bool), closed sets of strings (`Literal[...]`: every choice such as `eval.policy` or `regenerate.engine` is
checked here, not where it is used) and ranges (`Field(gt=0)`, ... in the annotations). A failure raises
`ConfigError`, one line naming the file and YAML line (or the command line), the dotted key and pydantic's
own words for what is wrong, when the config is loaded and before any model loads; entry scripts turn that into one line on stderr and exit code 2 (data.cli.cli_main).
`check_layer_ids` checks the head's layer ids against the target's config (read without its weights).
The resolved config is written as `config.yaml` into the run's output folder (`save_config`).

The `head` section is family specific: its `family` key selects the dataclass from the head registry
(`heads.registry`), so a Medusa field in an EAGLE config is an error too.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import re
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import pydantic
import pydantic.dataclasses
import yaml
from pydantic import BeforeValidator, ConfigDict, Field, PlainValidator, Strict
from pydantic_core import InitErrorDetails, PydanticCustomError

from data.cli import UserError, one_line, write_atomic
from heads import registry
from heads.base import HeadConfig

T = TypeVar("T")


class ConfigError(UserError, ValueError):
    """A config key or value is wrong; the message names the key and where it came from."""


# ----------------------------------------------------------------------------------------------- field types
# Leaves are strict (a YAML "5" is not an int, 1 is not a bool; an int is a fine float); out-of-range numbers
# and NaN/inf are refused where a range is given. Sections stay lax so a YAML mapping builds the dataclass.
_SECTION = ConfigDict(extra="forbid")
Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]
Bool = Annotated[bool, Strict()]
Str = Annotated[str, Strict()]
Count = Annotated[Int, Field(ge=1)]  # a number of things: >= 1
NonNegative = Annotated[Float, Field(ge=0, allow_inf_nan=False)]
Positive = Annotated[Float, Field(gt=0, allow_inf_nan=False)]
Fraction = Annotated[Float, Field(ge=0, le=1, allow_inf_nan=False)]
Beta = Annotated[Float, Field(ge=0, le=0.999999, allow_inf_nan=False)]
Dtype = Literal["float32", "bfloat16", "float16"]


def _list_as_tuple(value: Any) -> Any:
    """YAML has no tuples: a list of the right length is one."""
    return tuple(value) if isinstance(value, list) else value


def _validate_head(value: Any) -> HeadConfig:
    """The head section: `family` picks the family's dataclass (heads/), then its keys are checked strictly."""
    if isinstance(value, HeadConfig):
        return value
    if not isinstance(value, dict):
        raise PydanticCustomError("mapping_type", "expected a mapping")
    try:
        cls = HeadConfig.resolve_class(value)
    except (KeyError, ValueError) as e:
        error = PydanticCustomError("head_family", "{reason}", {"reason": str(e).strip("'\"")})
        raise pydantic.ValidationError.from_exception_data(
            "head", [InitErrorDetails(type=error, loc=("family",), input=value.get("family"))]) from None
    # Keys as strings, so a YAML key like `1:` is reported as an unknown key (not a TypeError from **value).
    checked = _strict_head_class(cls)(**{str(k): v for k, v in value.items()})  # ValidationError: in the section
    return cls(**{f.name: getattr(checked, f.name) for f in dataclasses.fields(cls)})


@functools.cache
def _strict_head_class(cls: type) -> type:
    """A pydantic copy of a family's head dataclass (heads/ keeps plain dataclasses; the original is unchanged)."""
    return pydantic.dataclasses.dataclass(cls, config=ConfigDict(extra="forbid", strict=True))


# ----------------------------------------------------------------------------------------------- schema
@dataclass
class TargetConfig:
    """The frozen target model."""

    __pydantic_config__ = _SECTION
    name_or_path: Str = "smollm2-135m"  # hub id, local folder, .gguf file, or a named default (see data.target)
    revision: Str | None = None  # hub revision (branch, tag or commit)
    gguf_file: Str | None = None  # GGUF file name inside name_or_path (hub id or folder)
    dtype: Dtype = "float32"
    device: Str = "auto"  # auto (cuda if available) | cpu | cuda | cuda:N
    # "auto" (or balanced, sequential): split the target's layers over every GPU this process sees, to
    # extract features of a target bigger than one GPU (one process per node; data.extract refuses more).
    # `device` is then unused. Training refuses it (ZeRO-3 / FSDP shard the target there).
    device_map: Str | None = None
    trust_remote_code: Bool = False  # never set unless you trust the repository's code
    # CPU float32 inference (eval, prompts, regeneration). packed: the large matrices run on oneDNN-prepacked
    # weights (data.packed; on one machine a verify pass over 2-3 tokens went from 1.6-2x to 1.2x a one-token
    # pass, on another packing made it 2.3x); skinny: each row count 1-8 takes the MKL product timed fastest for
    # each weight shape at load (on an AMD EPYC, T(2) went from 1.6x to 1.04x T(1)); dense: torch's default
    # kernels; auto: the decoder's target (eval, benchmarks) times all three at load and keeps the fastest
    # (printed), batched generation runs dense.
    cpu_kernels: Literal["auto", "packed", "skinny", "dense"] = "auto"


@dataclass
class DataConfig:
    """Conversations to train on and how to tokenize them."""

    __pydantic_config__ = _SECTION
    path: Str = "data/bundled/tiny_conversations.jsonl"  # JSONL file, folder, or `datasets` name
    format: Literal["auto", "sharegpt", "messages", "mtbench", "qa", "prompts", "hf"] = "auto"
    split: Str = "train"  # split, for `datasets` names
    max_samples: Count | None = None  # keep the first N records
    skip_malformed: Bool = False  # skip (and count) malformed records instead of failing
    max_length: Annotated[Int, Field(ge=2)] = 2048  # truncate tokenized conversations to this many tokens
    holdout_fraction: Fraction = 0.05  # share of conversations kept out of training for held-out metrics
    chat_template: Str | None = None  # Jinja template overriding the tokenizer's own
    cache_dir: Str | None = None  # where tokenized datasets are cached (default: next to the run)


@dataclass
class RegenerateConfig:
    """Self-distillation: answer the prompts with the target itself (python -m data.regenerate)."""

    __pydantic_config__ = _SECTION
    prompts: Str = "data/bundled/gsm8k_train.jsonl"  # prompt file (any format data.readers understands)
    output: Str = "regenerated.jsonl"  # ShareGPT JSONL written (relative paths go under --out)
    num_prompts: Count | None = 64  # first N prompts; null for all
    batch_size: Count = 8  # prompts generated together (left padded)
    max_new_tokens: Count = 256
    temperature: NonNegative = 0.0  # 0 = greedy
    top_p: Annotated[Float, Field(gt=0, le=1, allow_inf_nan=False)] = 1.0
    system_prompt: Str | None = None
    split: Str = "train"  # split, for `datasets` names (e.g. train_sft for UltraChat)
    skip_malformed: Bool = False  # skip (and count) malformed prompt records instead of failing
    # hf: transformers' batched generate (batch_size prompts at a time). vllm: vLLM's offline engine (the
    # `vllm` extra); batch_size is then the chunk of prompts handed to vLLM at once and fsynced after
    # (vLLM batches inside a chunk itself: use hundreds on GPUs).
    engine: Literal["hf", "vllm"] = "hf"
    tensor_parallel_size: Count = 1  # vllm: GPUs one copy of the target is split over
    data_parallel_size: Count = 1  # vllm: copies of the target on this node, each serving part of a chunk
    memory: Float | None = None  # vllm: gpu_memory_utilization (CPU: share of host memory); null = 0.9 GPU, 0.3 CPU
    # SLURM job arrays (scripts/slurm/regenerate.sbatch): this task answers the shard_index-th of num_shards
    # contiguous slices of the prompts into <output stem>.shard-I-of-N.jsonl; `merge` joins them in order.
    num_shards: Count = 1
    shard_index: Annotated[Int, Field(ge=0)] = 0  # < num_shards (data.regenerate checks)


@dataclass
class PromptDomain:
    """One kind of self-written prompt (python -m data.prompts)."""

    __pydantic_config__ = _SECTION
    name: Str = "general"
    weight: Float = 1.0  # relative share of candidates drawn from this domain
    system: Str | None = None  # system hint rendered while the target writes the user turn (not kept)
    openers: list[Str] = field(default_factory=list)  # opening words of the user turn; one is drawn per item
    # Context-carrying domains (summarise, answer from a passage, translate, extract, continue code): with
    # `requests`, the target's text (or, with `passages`, a supplied passage) is a PASSAGE and the user turn is
    # the passage, a blank line, then one request drawn per item ("Summarise the text above in two sentences."),
    # or a request holding `{passage}` with the passage in its place ("Complete this function:\n\n{passage}").
    requests: list[Str] = field(default_factory=list)
    # A file of passages to use instead of sampling them: JSONL with a "text" field per line, or plain text
    # with passages separated by blank lines (relative paths from the working folder); needs `requests`.
    passages: Str | None = None


def _default_domains() -> list[PromptDomain]:
    return [
        PromptDomain("coding", 1.0, "The user asks for help with a programming task.",
                     ["Write a Python function that", "How do I", "Write a program that", "Fix this code:"]),
        PromptDomain("math", 1.0, "The user asks a math problem.",
                     ["A store", "If", "Tom has", "Solve", "Find", "What is the area of"]),
        PromptDomain("writing", 1.0, "The user asks for a piece of writing.",
                     ["Write a short story about", "Write an email to", "Write a poem about", "Compose"]),
        PromptDomain("explain", 1.0, "The user asks a question about science, history or the world.",
                     ["What is", "Explain", "Why do", "How does"]),
        PromptDomain("reasoning", 1.0, "The user asks a question that needs careful reasoning.",
                     ["Which", "Compare", "What are the pros and cons of", "Is it true that"]),
        PromptDomain("advice", 1.0, "The user asks for everyday advice.",
                     ["How can I", "What should I", "Give me tips", "I want to"]),
        PromptDomain("roleplay", 1.0, "The user asks the assistant to play a character.",
                     ["Pretend you are", "Imagine you are", "Act as", "You are a"]),
    ]


@dataclass
class PromptsConfig:
    """Self-written prompts: the target writes user turns, filtered and mixed (python -m data.prompts).

    Types only here: data.prompts.check_prompts_config checks the ranges when prompts are written."""

    __pydantic_config__ = _SECTION

    output: Str = "prompts.jsonl"  # prompt JSONL written (relative paths go under --out)
    num_prompts: Int = 256  # prompts in the output, mixed ones included
    mix_prompts: Str | None = "data/bundled/gsm8k_train.jsonl"  # prompt file mixed in (its first prompts)
    mix_share: Float = 0.25  # share of the output taken from mix_prompts, in [0, 1)
    domains: list[PromptDomain] = field(default_factory=_default_domains)
    batch_size: Int = 16  # candidates sampled together (left padded)
    max_new_tokens: Int = 96  # a user turn longer than this is dropped as unfinished
    temperature: Float = 1.0  # > 0: a greedy target would write one prompt per domain
    top_p: Float = 0.95
    min_chars: Int = 16  # shorter prompts are dropped
    min_words: Int = 4
    ngram: Int = 5  # word n-gram size for duplicate and benchmark-overlap checks
    max_dup_overlap: Float = 0.5  # drop a prompt sharing this share of its n-grams with one kept prompt
    max_bench_overlap: Float = 0.3  # drop a prompt sharing this share of n-grams with a benchmark prompt
    max_candidates_factor: Int = 8  # give up after num_prompts x this many candidates


@dataclass
class FeaturesConfig:
    """Where training features come from (python -m data.extract for the offline store)."""

    __pydantic_config__ = _SECTION

    mode: Literal["offline", "online"] = "offline"  # offline: read a store; online: run the target in the loop
    store: Str = "features"  # store folder (relative paths go under --out)
    dtype: Dtype = "bfloat16"  # stored dtype
    shard_tokens: Count = 262144  # tokens per shard file
    batch_tokens: Count = 8192  # tokens per target forward during extraction
    verify_on_read: Bool = True  # offline: hash each shard once when first read (names a corrupted shard)
    # python -m data.extract: transformers (a forward with hooks) or vllm (vLLM's extract_hidden_states, the
    # `vllm` extra; data/vllm_capture.py): the same store either way; features.mode online: the same batches.
    engine: Literal["transformers", "vllm"] = "transformers"
    vllm_tensor_parallel_size: Count = 1  # vllm: GPUs one copy of the target is split over (vLLM's own flag)
    vllm_memory: Float | None = None  # vllm: gpu_memory_utilization (CPU: share of host memory); null = 0.9 GPU, 0.3 CPU
    vllm_check_samples: Count = 4  # vllm: sequences run through both engines before extracting (numerics table)
    # vllm: refuse when a layer's mean relative L2 difference per token exceeds this (a wrong layer or norm
    # gives ~0.25 on SmolLM2; float32 rounding ~2e-6 there)
    vllm_check_tolerance: Positive = 0.02


@dataclass
class OptimConfig:
    """AdamW over head parameters, linear warmup then cosine decay."""

    __pydantic_config__ = _SECTION

    lr: Positive = 1e-4
    weight_decay: NonNegative = 0.0
    betas: Annotated[tuple[Beta, ...], Field(min_length=2, max_length=2), BeforeValidator(_list_as_tuple)] = (0.9, 0.95)
    warmup_steps: Annotated[Int, Field(ge=0)] = 50
    min_lr_ratio: Fraction = 0.1  # cosine decays to lr * min_lr_ratio
    grad_clip: NonNegative = 0.5
    grad_accum: Count = 1


@dataclass
class TrainConfig:
    """The shared training loop (train/loop.py)."""

    __pydantic_config__ = _SECTION

    epochs: Count = 1
    max_steps: Count | None = None  # stop after this many optimizer steps (overrides epochs)
    batch_size: Count = 4  # conversations per micro-batch per process
    # sequences per optimizer step over all processes; null = batch_size x processes x optim.grad_accum.
    # When set, grad_accum = global_batch_size / (batch_size x processes), so 1 and N processes train alike.
    global_batch_size: Count | None = None
    mixed_precision: Literal["no", "bf16", "fp16"] = "no"  # accelerate
    checkpoint_every: Count = 500  # optimizer steps between checkpoints
    eval_every: Count = 200  # optimizer steps between held-out evaluations
    log_every: Count = 10
    eval_at_end: Bool = False  # run eval.run on the trained head when training ends
    # also keep OUT/head_best: the head at the evaluation with the best held-out simulated tau so far
    keep_best: Bool = False
    # true: the loss covers the assistant's tokens only (EAGLE's and SpecForge's rule; TRL's assistant_only_loss);
    # false: every real token, the prompt's too. A head whose labels are the target's own (its distribution or
    # greedy token: EAGLE-1/3, DFlash, Medusa with head.distill) then learns the target's predictions on the
    # user's and system's text as well, which the store already holds: on the quickstart's store held-out
    # tau_sim 1.614 -> 1.645 at the same steps (docs/results.md). Held-out evaluation always scores the
    # assistant's tokens, what decoding drafts.
    assistant_only_loss: Bool = True


@dataclass
class LoggingConfig:
    __pydantic_config__ = _SECTION
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"  # never prompts for a login
    wandb_project: Str = "draftheads"
    run_name: Str | None = None


@dataclass
class EvalConfig:
    """Speculative decoding evaluation (python -m eval.run)."""

    __pydantic_config__ = _SECTION

    bench: list[Str] = field(default_factory=lambda: ["mt_bench"])  # bundled names or question files
    max_questions: Count | None = None
    max_new_tokens: Count = 128
    temperature: list[NonNegative] = field(default_factory=lambda: [0.0])
    num_draft_tokens: Count | None = None  # chain length k; null = choose from measured costs
    # auto: the family's default (EAGLE and DFlash: chains, Medusa: its configured tree), except that with k chosen
    # from the measured costs (num_draft_tokens null) an EAGLE or DFlash head drafts a dynamic tree of as many nodes
    # as the verify curve takes for about the price of none or as the chain's best k, whichever is more, topk and
    # tokens capped by the two keys below, when its calibration predicts more than the chain's
    # (eval.calibrate.choose_tree; the report's costs.tree says what and why). static: Medusa's tree, or DFlash's
    # top-k tree over its block's slots. dynamic: EAGLE-2's tree over EAGLE's steps or DFlash's slots
    tree: Literal["auto", "chain", "static", "dynamic"] = "auto"
    # EAGLE-2's dynamic tree (tree: dynamic; SGLang's speculative_eagle_topk and speculative_num_draft_tokens):
    # each expanded node's children, and the nodes verified. The defaults are EAGLE-2's, sized for a GPU, where
    # 61 verify rows cost about one; on a CPU whose verify curve is flat to a few rows a tree of 2-3 each
    # fits it (docs/results.md, "Small dynamic trees").
    tree_topk: Count = 10
    tree_tokens: Count = 60
    policy: Literal["adaptive", "fixed"] = "adaptive"  # adaptive (eval.policy: per-pass k from this request's acceptance) | fixed (k every pass)
    # The dtype the head drafts in (the decoder verifies with the target, so greedy output and the sampling law
    # do not depend on it). target: the target's dtype; bfloat16; auto: a CPU float32 target's head drafts in
    # bfloat16 when its matrices run at least 10% faster so on this machine (eval.costs.place_head, printed),
    # else in the target's dtype. A drafted token reads every head matrix once, so on a CPU drafting is bound
    # by memory traffic, which bfloat16 halves: the quickstart head's 3-token drafts took 30% less time. Inputs of
    # many rows (the head's begin over the prompt, catch-ups) are bound by arithmetic instead, slower in bfloat16
    # on a CPU without native bfloat16: auto then runs them in float32 from the row count it times as the
    # crossing (eval.costs.WideRowsLinear; printed, and in the report's header).
    draft_dtype: Literal["auto", "target", "bfloat16"] = "auto"
    # The target's KV cache in the single-stream runs and the verify curve (data.kvcache): dynamic
    # (transformers' DynamicCache, eager) or static (preallocated; on CUDA every verify size is captured once
    # as a CUDA graph and replayed). Each method keeps one static cache for the whole eval, so a size is
    # captured once, not once per turn. On an H200 the static cache's graphs ran an 8B-shaped target 11.8x
    # faster than eager (docs/results.md, "GPU"); on a CPU there are no graphs and it brings nothing. The batch
    # sweep keeps its ragged dynamic cache (eval/batch.py).
    cache: Literal["dynamic", "static"] = "dynamic"
    batch_sizes: list[Count] = field(default_factory=lambda: [1, 2, 4, 8, 16])


@dataclass
class RunConfig:
    """Everything one run needs; each section is documented by its dataclass."""

    __pydantic_config__ = _SECTION

    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)
    prompts: PromptsConfig = field(default_factory=PromptsConfig)
    features: FeaturesConfig = field(default_factory=FeaturesConfig)
    head: Annotated[HeadConfig, PlainValidator(_validate_head)] = field(default_factory=lambda: HeadConfig.resolve_class({})())  # see heads/*.py
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    seed: Int = 0
    out: Str = "runs/default"  # output folder; --out overrides


def check_layer_ids(cfg: RunConfig, target_config: Any) -> list[int]:
    """The head's feature layers for this target config (read without weights); ConfigError when out of range."""
    try:
        return list(registry.get(cfg.head.family).feature_layers(cfg.head, target_config))
    except ValueError as e:
        raise ConfigError(f"config key 'head.layer_ids' for target '{cfg.target.name_or_path}': {e}") from None


def _check_layer_ids_shape(cfg: Any, where: str) -> None:
    ids = getattr(getattr(cfg, "head", None), "layer_ids", None)
    if ids is not None and (not ids or list(ids) != sorted(set(ids)) or min(ids) < 0):
        raise ConfigError(f"{where}: key 'head.layer_ids': {list(ids)} must be ascending, distinct and >= 0")


# ----------------------------------------------------------------------------------------------- errors
Loc = tuple[str | int, ...]


def _dotted(loc: Loc) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")


def _unwrap(tp: Any, tree: Any) -> Any:
    """`tp` without Annotated and `| None`; the head section's family class for the head subtree `tree`."""
    while typing.get_origin(tp) is Annotated or type(None) in typing.get_args(tp):
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    return tp.resolve_class(tree if isinstance(tree, dict) else {}) if hasattr(tp, "resolve_class") else tp


def _section_at(cls: Any, tree: Any, loc: Loc) -> Any:
    """The dataclass of the section at `loc` in `tree` (for an unknown key's list of known ones); None if none."""
    tp = cls
    for part in loc:
        tp = _unwrap(tp, tree)
        if isinstance(part, int):  # a list item (prompts.domains[0])
            tp = (typing.get_args(tp) or (None,))[0]
            tree = tree[part] if isinstance(tree, list) and part < len(tree) else {}
        elif dataclasses.is_dataclass(tp):
            tp = typing.get_type_hints(tp, include_extras=True).get(part)
            tree = tree.get(part, {}) if isinstance(tree, dict) else {}
        else:
            return None
    tp = _unwrap(tp, tree)
    return tp if dataclasses.is_dataclass(tp) else None


def _describe(err: Any, cls: type, tree: dict) -> str:
    """One pydantic error as one sentence naming the dotted key; an unknown key lists its section's keys."""
    loc = tuple(err["loc"])
    if err["type"] in ("unexpected_keyword_argument", "extra_forbidden"):
        section = _section_at(cls, tree, loc[:-1])
        known = sorted(f.name for f in dataclasses.fields(section)) if section else []
        close = difflib.get_close_matches(str(loc[-1]), known, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        return f"unknown key '{_dotted(loc)}' ({hint}known in '{_dotted(loc[:-1]) or '<top>'}': {', '.join(known)})"
    return f"key '{_dotted(loc)}': {err['msg'].removeprefix('Input ')}, got {err['input']!r}"


# ----------------------------------------------------------------------------------------------- machinery
@functools.cache
def _adapter(cls: type) -> pydantic.TypeAdapter:
    return pydantic.TypeAdapter(cls)


def _validate(cls: type[T], tree: dict, where: Any) -> T:
    """`tree` checked and built into `cls`; `where(loc)` names the source of a failing key."""
    try:
        return _adapter(cls).validate_python(tree)
    except pydantic.ValidationError as e:
        err = e.errors(include_url=False)[0]
        if err["type"] == "invalid_key":  # a YAML key that is not a string (`1:`): unknown like any other
            err.update(loc=(*err["loc"][:-1], str(err["loc"][-1])), type="unexpected_keyword_argument")
        raise ConfigError(f"{where(tuple(err['loc']))}: {_describe(err, cls, tree)}") from None


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
    """A safe YAML loader that refuses duplicate keys (plain YAML silently keeps the last one) and reads
    `3e-4` as a float and only true / false as booleans (YAML 1.2; PyYAML's YAML 1.1 wants a dot in a float
    and would read the string '3e-4', and reads yes / no / on / off as booleans, so `--train.mixed_precision=no`
    would have been False)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key '{key}'", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))
_UniqueKeyLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in _UniqueKeyLoader.yaml_implicit_resolvers.items()}
_UniqueKeyLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))


MAX_YAML_DEPTH = 32  # far deeper than any config; the composer recurses per level


def _check_yaml_events(text: str) -> None:
    """Refuse aliases and very deep nesting before anything is composed (yaml.YAMLError naming the line):
    an alias bomb ("billion laughs") expands exponentially, a recursive alias or deep nesting exhausts
    the recursion of the composer. A config never needs either. The parser itself does not recurse."""
    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        line = event.start_mark.line + 1
        if isinstance(event, yaml.AliasEvent):
            raise yaml.YAMLError(f"line {line}: YAML aliases (*{event.anchor}) are not allowed in a config")
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > MAX_YAML_DEPTH:
                raise yaml.YAMLError(f"line {line}: nested more than {MAX_YAML_DEPTH} levels deep")
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1


def _parse_yaml(text: str) -> tuple[Any, dict[Loc, int]]:
    """The YAML document and the 1-based line of every key and list item in it (by its pydantic loc)."""
    _check_yaml_events(text)
    loader = _UniqueKeyLoader(text)
    try:
        node = loader.get_single_node()
        tree = loader.construct_document(node) if node is not None else None
    finally:
        loader.dispose()
    lines: dict[Loc, int] = {}

    def walk(n: yaml.Node, loc: Loc) -> None:
        if isinstance(n, yaml.MappingNode):
            for k, v in n.value:
                lines[(*loc, k.value)] = k.start_mark.line + 1
                walk(v, (*loc, k.value))
        elif isinstance(n, yaml.SequenceNode):
            for i, v in enumerate(n.value):
                lines[(*loc, i)] = v.start_mark.line + 1
                walk(v, (*loc, i))

    if node is not None:
        walk(node, ())
    return tree, lines


def _read_yaml(path: str | Path) -> tuple[dict, dict[Loc, int]]:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start})") from None
    try:
        tree, lines = _parse_yaml(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from None
    if tree is None:
        raise ConfigError(f"{path}: the config file is empty (give at least one section, e.g. `target:`)")
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    return tree, lines


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


def _apply_overrides(tree: dict, overrides: list[str]) -> list[Loc]:
    """Set each `--a.b=value` (value parsed as YAML) in `tree`; returns the keys set, as locs."""
    keys = []
    for item in overrides:
        flag = item[2:] if item.startswith("--") else item
        if "=" not in flag:
            raise ConfigError(f"command line: override '{item}' must look like --key.sub=value")
        key, raw = flag.split("=", 1)
        try:
            _check_yaml_events(raw)  # an alias or deep nesting stays the plain string it was typed as
            value = yaml.load(raw, Loader=_UniqueKeyLoader) if raw != "" else None
        except yaml.YAMLError:
            value = raw
        _set_dotted(tree, key, value)
        keys.append(tuple(key.split(".")))
    return keys


def load_config(
    path: str | Path | None, overrides: list[str] | None = None, cls: type[T] = RunConfig
) -> T:
    """Load `cls` from a YAML file and apply `--a.b=value` overrides (values parsed as YAML).

    A bad key is named with the YAML line it is on, or as coming from the command line when an override set
    it (or a section above it)."""
    tree: dict = {}
    lines: dict[Loc, int] = {}
    source = "<defaults>"
    if path is not None:
        source = str(path)
        tree, lines = _read_yaml(path)
    # Overrides go onto the file's own tree (not the filled-in defaults), so switching
    # --head.family does not drag the old family's default keys along.
    set_keys = _apply_overrides(tree, overrides or [])
    command_line = f"command line ({source} + overrides)"

    def where(loc: Loc) -> str:
        if any(loc[:len(k)] == k for k in set_keys):
            return command_line
        known = [loc[:n] for n in range(len(loc), 0, -1) if loc[:n] in lines]
        return f"{source}:{lines[known[0]]}" if known else command_line if set_keys else source

    cfg = _validate(cls, tree, where)
    _check_layer_ids_shape(cfg, command_line if set_keys else source)
    return cfg


def config_text(cfg: Any) -> str:
    """The resolved config as config.yaml holds it."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def save_config(cfg: Any, out_dir: str | Path) -> Path:
    """Write the resolved config to OUT/config.yaml (what the run really used)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return write_atomic(out / "config.yaml", config_text(cfg))


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
