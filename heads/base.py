"""The head interface every drafter family implements, the family registry, and the head folder format.

A family is a module in `heads/` (`eagle.py`, `medusa.py`, `mtp.py`) that provides:

    CONFIGS: dict[str, type[HeadConfig]]          family name -> its config dataclass
    feature_layers(cfg, target_config) -> list[int]   hidden_states indices the head needs as `aux`
    build(cfg, target: TargetIO) -> nn.Module         a fresh head (frozen target parts are NOT inside it)
    loss(head, batch, target: TargetIO) -> (loss, metrics)   metrics has per-position top-1 (`top1/0`, ...)
    drafter(head, target: TargetIO, **kw) -> Drafter  the decoder adapter (see `Drafter` below)

A head folder is what `save_head` writes and `load_head` reads (`config.json` + `model.safetensors`);
`load_head` refuses a folder whose target (hidden size, vocab, layers, fingerprint) does not match, whose
weights differ from the sha256 config.json records, or hold NaN/inf (HeadError, one line at the CLI).

Feature convention (shared with data.features, the store and the decoder): `aux` is the concatenation, in
ascending order, of transformers' `hidden_states[i]` for the requested indices i (index 0 is the embedding
output, index i the INPUT of decoder layer i = the output of layer i-1); `last` is the target's final
hidden state after its final norm (what the target's lm_head reads).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import inspect
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import load_file, save_file
from torch import nn

FORMAT_VERSION = 1

# family name -> module implementing it; eval and export rebuild any head from its folder through this.
FAMILIES: dict[str, str] = {
    "eagle1": "heads.eagle",
    "eagle3": "heads.eagle",
    "medusa": "heads.medusa",
    "mtp": "heads.mtp",
}


class HeadError(ValueError):
    """A head folder is unusable (unreadable, truncated, tampered, non-finite); the message names the file.

    data.cli.cli_main reports it (and every subclass) as one line with exit code 2."""


class HeadMismatchError(HeadError):
    """A head folder does not fit the target (or the store); the message names the mismatch."""


def family_module(family: str) -> Any:
    if family not in FAMILIES:
        raise ValueError(f"unknown head family '{family}' (known: {', '.join(sorted(FAMILIES))})")
    return importlib.import_module(FAMILIES[family])


@dataclass
class HeadConfig:
    """Base of every family's head config; `family` picks the dataclass (see `resolve_class`)."""

    family: str = "eagle3"

    @classmethod
    def resolve_class(cls, data: dict) -> type[HeadConfig]:
        family = data.get("family", "eagle3")
        if family not in FAMILIES:
            raise ValueError(f"unknown head family '{family}' (known: {', '.join(sorted(FAMILIES))})")
        return family_module(family).CONFIGS[family]


# ----------------------------------------------------------------------------------------------- features
@dataclass
class Features:
    """Target features for a batch: aux [B, T, n*H] (may be None when no layer is asked), last [B, T, H]."""

    last: torch.Tensor
    aux: torch.Tensor | None = None

    def slice(self, start: int, stop: int) -> Features:
        """Positions [start, stop) along the time axis."""
        return Features(
            last=self.last[:, start:stop], aux=None if self.aux is None else self.aux[:, start:stop]
        )

    def index(self, idx: torch.Tensor) -> Features:
        """Positions `idx` (1-D long tensor) along the time axis, in that order."""
        return Features(last=self.last[:, idx], aux=None if self.aux is None else self.aux[:, idx])


@dataclass
class TargetIO:
    """The frozen pieces of the target a head trains and drafts with (never saved inside the head)."""

    config: Any  # the target's transformers PretrainedConfig (the text config for multimodal models)
    embed: nn.Module  # token ids -> input embeddings, scaled as the target scales them
    lm_head: nn.Module  # final hidden -> logits over the target vocab
    norm: nn.Module | None = None  # the target's final norm
    last_layer: nn.Module | None = None  # the target's last decoder layer (template for MTP blocks)
    rotary: nn.Module | None = None  # the target's rotary embedding module (cos, sin = rotary(x, pos))
    name: str = ""
    fingerprint: str = ""

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    def record(self) -> dict[str, Any]:
        """This target's identity record (see target_record), without re-hashing the weights."""
        return _identity(self.config, self.name, self.fingerprint)


def _identity(config: Any, name: str, fingerprint: str) -> dict[str, Any]:
    return {"name_or_path": name, "fingerprint": fingerprint, "model_type": getattr(config, "model_type", None),
            "hidden_size": int(config.hidden_size), "num_hidden_layers": int(config.num_hidden_layers),
            "vocab_size": int(config.vocab_size)}


def target_record(config: Any, embed_weight: torch.Tensor, name: str) -> dict[str, Any]:
    """The ONE target identity (TargetInfo) that head folders, store manifests and checkpoints record and
    check_target compares: name, fingerprint of the weights, model type, hidden size, layers, vocab."""
    return _identity(config, name, target_fingerprint(config, embed_weight))


def cache_kwarg(module: nn.Module) -> str:
    """The name of a model's or decoder layer's cache argument: `cache` (transformers >= 5.2x) or
    `past_key_values` (5.17, which takes **kwargs and silently ignores `cache=`: no cache would be used)."""
    return _cache_kwarg_of(type(module))


@functools.cache
def _cache_kwarg_of(cls: type) -> str:  # per class: drafters ask once per draft step
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def target_fingerprint(config: Any, embed_weight: torch.Tensor) -> str:
    """A short id of a target: architecture fields plus a checksum of the first embedding rows.

    Cheap to compute (no full weight hash) yet differs between models of the same shape.
    """
    fields = {k: getattr(config, k, None) for k in ("model_type", "hidden_size", "num_hidden_layers", "vocab_size")}
    rows = embed_weight.detach()[:64].float().cpu().contiguous()
    h = hashlib.sha256(json.dumps(fields, sort_keys=True).encode())
    h.update(rows.numpy().tobytes())
    return h.hexdigest()[:16]


def shift_targets(input_ids: torch.Tensor, valid: torch.Tensor, shift: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The token `shift` positions ahead of each position, and whether it may be learnt.

    Returns (ids [B,T] long, mask [B,T] bool): ids[t] = input_ids[t+shift] and mask[t] = valid[t+shift],
    padded at the end where t+shift runs past the sequence (id 0, mask 0). `valid` should already combine
    loss_mask and attention_mask: position t+shift must be a learnable, real token. Medusa head i uses
    shift 2+i; MTP step k embeds x[t+k] (shift k) and predicts x[t+1+k] (shift 1+k).
    Worked example, shift 2 with tokens [A0 A1 A2 A3] all valid: ids [A2 A3 pad pad], mask [1 1 0 0];
    shift 1: [A1 A2 A3 pad]. Raises ValueError for shift < 1 (a head never predicts its own or an
    earlier token).
    """
    if shift < 1:
        raise ValueError(f"shift must be >= 1 (token t+shift read at position t), got {shift}")
    ids = torch.zeros_like(input_ids)
    mask = torch.zeros(valid.shape, dtype=torch.bool, device=valid.device)
    if shift < input_ids.shape[1]:
        ids[:, :-shift] = input_ids[:, shift:]
        mask[:, :-shift] = valid[:, shift:].bool()
    return ids, mask


# ----------------------------------------------------------------------------------------------- drafting
@dataclass
class DraftTree:
    """Draft tokens as a tree hanging below the root (the last committed token, not yet seen by the target).

    tokens  [N] long: the drafted token of each node, nodes in topological order (parents first).
    parents [N] long: index of each node's parent node, -1 for children of the root.
    probs   [N, V] float or None: the drafter's distribution q each node was drawn from (the distribution
            at its parent, over the TARGET vocab). None means deterministic drafts (q one-hot on the token).
    sampling: how siblings were drawn when probs is given: "iid" (each child an independent sample of q,
            SpecInfer) or "topk" (distinct top-k children, EAGLE): the verifier treats them differently.
    sources [N] str or None: which proposer each node came from ("head", "ngram", "head+ngram" for a node
            both proposed; eval.drafters.HybridDrafter); None = the drafter itself. Only statistics and
            the decoder's policy read it, never the verifier.
    A chain of k tokens is tokens [k], parents [-1, 0, 1, ..., k-2].
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    probs: torch.Tensor | None = None
    sampling: str = "iid"
    sources: list[str] | None = None

    @staticmethod
    def chain(tokens: torch.Tensor, probs: torch.Tensor | None = None) -> DraftTree:
        n = tokens.numel()
        return DraftTree(tokens.reshape(-1), torch.arange(-1, n - 1, device=tokens.device), probs)

    def __len__(self) -> int:
        return int(self.tokens.numel())


class Drafter(Protocol):
    """What the speculative decoder (eval.decoder) asks of any drafter.

    Timeline for one generation (batch 1). Positions are absolute token indices.
      begin(prompt_ids, features, next_token): the target has run over prompt_ids (length n) and
          produced features for positions 0..n-1 (None if capture_layers is None); next_token (position n)
          was sampled from its last distribution and is the root of the first draft.
      draft(k, temperature) -> DraftTree: propose up to k tokens (chain length or tree depth).
      commit(accepted, features, next_token): the target verified the tree; `accepted` are the node
          indices on the accepted path (possibly empty); `features` has len(accepted)+1 positions: the
          root's and each accepted node's, in path order; next_token is the corrected or bonus token,
          the new root. The drafter must roll its own state (caches) back to the accepted path.
      commit_tokens(tokens, features, next_token): the same with the accepted path given by its TOKENS,
          which need not be a path of this drafter's last draft (or there was no draft at all). The
          hybrid drafter (eval.drafters.HybridDrafter) uses it when the accepted path left this drafter's
          own nodes for another proposer's. Every drafter in this project implements it; the decoder alone
          only ever calls commit.
    """

    # hidden_states indices the drafter needs from every target pass (`aux`); None = no features at all,
    # () = only `last`.
    capture_layers: tuple[int, ...] | None

    def begin(self, prompt_ids: torch.Tensor, features: Features | None, next_token: int) -> None: ...

    def draft(self, k: int, temperature: float) -> DraftTree: ...

    def commit(self, accepted: list[int], features: Features | None, next_token: int) -> None: ...

    def commit_tokens(self, tokens: list[int], features: Features | None, next_token: int) -> None: ...


# ----------------------------------------------------------------------------------------------- folders
@dataclass
class HeadMeta:
    """What config.json records next to the head's own config."""

    family: str
    target_name: str
    target_fingerprint: str
    hidden_size: int
    vocab_size: int
    num_layers: int
    layer_ids: list[int] = field(default_factory=list)
    dtype: str = "float32"
    extra: dict = field(default_factory=dict)  # training data, steps, etc.


def sha256_file(path: str | Path, chunk: int = 1 << 23) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def check_finite(state: dict[str, torch.Tensor], where: str) -> None:
    """HeadError naming the first float tensor holding NaN or inf (a diverged run or a damaged file)."""
    for k, v in state.items():
        if v.is_floating_point() and not bool(torch.isfinite(v).all()):
            n = int((~torch.isfinite(v)).sum())
            raise HeadError(f"{where}: weight '{k}' holds {n} non-finite values (NaN/inf): a diverged run or a "
                            f"damaged file; nothing is trusted from it")


def _fsync_replace(tmp: Path, final: Path) -> None:
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    tmp.replace(final)


def save_head(path: str | Path, head: nn.Module, cfg: HeadConfig, target: TargetIO, extra: dict | None = None) -> Path:
    """Write `path/config.json` and `path/model.safetensors` (temp names, fsync, rename; weights first).

    config.json records the sha256 of model.safetensors (`files`), checked by load_head; non-finite
    weights are refused (HeadError) before anything is written."""
    out = Path(path)
    mod = family_module(cfg.family)
    layer_ids = list(mod.feature_layers(cfg, target.config))
    state = {k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()}
    check_finite(state, str(out))
    out.mkdir(parents=True, exist_ok=True)
    floats = [v for v in state.values() if v.is_floating_point()]  # skip index buffers such as d2t
    dtype = str(floats[0].dtype).replace("torch.", "") if floats else "float32"
    meta = {
        "format": "draftheads",
        "format_version": FORMAT_VERSION,
        "family": cfg.family,
        "head_config": dataclasses.asdict(cfg),
        "target": target.record(),
        "layer_ids": layer_ids,
        "dtype": dtype,
        "extra": extra or {},
    }
    tmp = out / "model.safetensors.tmp"
    save_file(state, str(tmp), metadata={"format": "pt", "family": cfg.family})
    meta["files"] = {"model.safetensors": sha256_file(tmp)}
    _fsync_replace(tmp, out / "model.safetensors")
    (out / "config.json.tmp").write_text(json.dumps(meta, indent=2))
    _fsync_replace(out / "config.json.tmp", out / "config.json")
    return out


def read_head_config(path: str | Path) -> tuple[HeadConfig, dict]:
    """Read a head folder's config.json: (the family's config dataclass, the whole json)."""
    folder = Path(path)
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise HeadError(f"{folder}: not a head folder (no config.json)")
    try:
        meta = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HeadError(f"{cfg_path}: invalid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != "draftheads":
        raise HeadError(f"{cfg_path}: not a draftheads head folder (use scripts/export.py --import for other layouts)")
    family = meta.get("family")
    if family not in FAMILIES:
        raise HeadError(f"{cfg_path}: key 'family' is {family!r}, not one of {', '.join(sorted(FAMILIES))}")
    raw = meta.get("head_config")
    if not isinstance(raw, dict) or raw.get("family", family) != family:
        raise HeadError(f"{cfg_path}: key 'head_config' is missing or names another family than 'family' ({family})")
    for key in ("target", "layer_ids"):
        if not isinstance(meta.get(key), dict if key == "target" else list):
            raise HeadError(f"{cfg_path}: key '{key}' is missing or malformed")
    cls = family_module(family).CONFIGS[family]
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise HeadError(f"{cfg_path}: unknown head_config key '{unknown[0]}' for family {family}")
    kwargs = {k: tuple(v) if isinstance(getattr(cls, k, None), tuple) else v for k, v in raw.items()}
    try:
        return cls(**kwargs), meta
    except (TypeError, ValueError) as e:
        raise HeadError(f"{cfg_path}: key 'head_config': {e}") from None


def check_target(recorded: dict, target: TargetIO | dict, where: str, strict_fingerprint: bool = True,
                 error: type[HeadMismatchError] | None = None) -> None:
    """The one target check (extraction, training offline and on resume, eval, export): refuse what
    `recorded` (a head folder's or store manifest's `target`) says against `target` (a TargetIO or a
    record), naming the first mismatch and both sides. A missing field (a record read from the config
    alone has no fingerprint) is not compared."""
    err = error or HeadMismatchError
    if not isinstance(recorded, dict):
        raise err(f"{where}: no target record")
    t, have = recorded, target if isinstance(target, dict) else target.record()
    for key in ("hidden_size", "vocab_size", "num_hidden_layers"):
        if t.get(key) is not None and have.get(key) is not None and int(t[key]) != int(have[key]):
            raise err(f"{where}: {key} is {t[key]} but the target has {have[key]}")
    if strict_fingerprint and t.get("fingerprint") and have.get("fingerprint") and t["fingerprint"] != have["fingerprint"]:
        raise err(
            f"{where}: made for target '{t.get('name_or_path')}' (fingerprint {t['fingerprint']}), "
            f"but the target is '{have.get('name_or_path')}' (fingerprint {have['fingerprint']})"
        )


def load_head(path: str | Path, target: TargetIO, strict_fingerprint: bool = True) -> tuple[nn.Module, HeadConfig, dict]:
    """Rebuild a head from its folder for `target`; refuses a mismatch (hidden, vocab, layers, ids)."""
    folder = Path(path)
    cfg, meta = read_head_config(folder)
    check_target(meta["target"], target, str(folder), strict_fingerprint)
    mod = family_module(cfg.family)
    want_layers = list(mod.feature_layers(cfg, target.config))
    if list(meta.get("layer_ids", [])) != want_layers:
        raise HeadMismatchError(
            f"{folder}: layer_ids {meta.get('layer_ids')} do not match {want_layers} for this target"
        )
    weights = folder / "model.safetensors"
    if not weights.is_file():
        raise HeadError(f"{weights}: missing")
    want_sha = meta.get("files", {}).get("model.safetensors") if isinstance(meta.get("files"), dict) else None
    if want_sha is not None and sha256_file(weights) != want_sha:
        raise HeadError(f"{weights}: corrupted or changed (sha256 differs from {folder / 'config.json'})")
    try:
        state = load_file(str(weights))
    except Exception as e:  # safetensors raises its own error types for truncated files
        raise HeadError(f"{weights}: unreadable or truncated ({' '.join(str(e).split())})") from None
    check_finite(state, str(weights))
    try:
        head = mod.build(cfg, target)
    except ValueError as e:
        raise HeadMismatchError(f"{folder / 'config.json'}: head_config does not fit this target ({e})") from None
    own = head.state_dict()
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or unexpected:
        raise HeadMismatchError(f"{weights}: missing keys {missing[:3]} / unexpected keys {unexpected[:3]}")
    for k, v in own.items():  # before load_state_dict, which would raise a bare RuntimeError
        if v.shape != state[k].shape:
            raise HeadMismatchError(f"{weights}: {k} has shape {tuple(state[k].shape)}, expected {tuple(v.shape)}")
    head.load_state_dict(state)
    head.eval()
    return head, cfg, meta
