"""Drafters that are not trained heads: n-gram prompt lookup, a separate draft model, self-speculative layers.

All three implement heads.base.Drafter (begin / draft / commit) and draft chains:

    NgramDrafter(n_max=3, n_min=1)          copy the continuation of the latest earlier match of the last
                                            n tokens (n = n_max down to n_min); no model, proposes nothing
                                            when nothing matches (the pass is then a plain decoding step)
    ModelDrafter(draft_model)               a smaller causal LM sharing the target's tokenizer, with its own
                                            KV cache rolled back to the accepted path on every commit
    self_speculative_drafter(target, n)     a ModelDrafter over the target's own first n decoder layers,
                                            final norm and lm_head (weights shared, no training, own cache)
    HybridDrafter(head_drafter)             any drafter's tree with the n-gram proposal merged in as extra
                                            branches (prefix-merged, verified in the same single pass)
    DeferredSync(drafter)                   the drafter with its commits held back while a policy keeps it
                                            from drafting, then handed over as one (same state, less work)

    from eval.decoder import speculative_generate
    ids, stats = speculative_generate(target, prompt, self_speculative_drafter(target, 8), k=3, max_new_tokens=64)
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from data.kvcache import KVCache, new_kv
from data.target import text_config
from heads.base import DraftTree, Features
from heads.sampling import draft_token

__all__ = ["DeferredSync", "HybridDrafter", "ModelDrafter", "deterministic_q", "NgramDrafter", "layer_prefix_model", "self_speculative_drafter"]


def _empty_tree(device: torch.device | str = "cpu") -> DraftTree:
    return DraftTree.chain(torch.empty(0, dtype=torch.long, device=device))


class NgramDrafter:
    """Prompt lookup: propose what followed the most recent earlier occurrence of the context's last n tokens.

    An index per n maps each n-gram to where its latest continuation starts, updated as tokens are committed,
    so a lookup is a dict access whatever the context length. Example (n = 2): context [a b c d a b], the
    suffix (a b) last occurred at 0 with continuation starting at 2, so draft(3) proposes [c d a].
    Drafts are deterministic (probs None).
    """

    capture_layers = None

    def __init__(self, n_max: int = 3, n_min: int = 1):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"NgramDrafter: need 1 <= n_min <= n_max, got n_min={n_min}, n_max={n_max}")
        self.n_max, self.n_min = n_max, n_min
        self.tokens: list[int] = []
        self.index: dict[int, dict[tuple[int, ...], int]] = {}
        self._draft: list[int] = []
        self.device: torch.device = torch.device("cpu")  # where its drafts go (the prompt's device)

    def _append(self, token: int) -> None:
        t = len(self.tokens)
        self.tokens.append(token)
        # The n-gram ending just before position t now has a continuation starting at t.
        for n in range(self.n_min, self.n_max + 1):
            if t >= n:
                self.index[n][tuple(self.tokens[t - n:t])] = t

    def begin(self, prompt_ids: torch.Tensor, features: Features | None, next_token: int) -> None:
        self.device = prompt_ids.device
        self.tokens, self.index = [], {n: {} for n in range(self.n_min, self.n_max + 1)}
        for t in prompt_ids.reshape(-1).tolist() + [next_token]:
            self._append(t)

    def match(self, k: int) -> tuple[list[int], int]:
        """(the up to k tokens that followed the latest earlier match of the longest matching suffix, that
        suffix's length n, the match order); ([], 0) if none."""
        for n in range(self.n_max, self.n_min - 1, -1):
            if len(self.tokens) > n:
                start = self.index[n].get(tuple(self.tokens[-n:]))
                if start is not None:
                    return self.tokens[start:start + k], n
        return [], 0

    def lookup(self, k: int) -> list[int]:
        """The up to k tokens that followed the latest earlier match of the longest matching suffix ([] if none)."""
        return self.match(k)[0]

    def draft(self, k: int, temperature: float) -> DraftTree:
        self._draft = self.lookup(k) if k > 0 else []
        if not self._draft:
            return _empty_tree(self.device)
        return DraftTree.chain(torch.tensor(self._draft, dtype=torch.long, device=self.device))

    def commit(self, accepted: list[int], features: Features | None, next_token: int) -> None:
        self.commit_tokens([self._draft[a] for a in accepted], features, next_token)

    def commit_tokens(self, tokens: list[int], features: Features | None, next_token: int) -> None:
        for t in list(tokens) + [next_token]:
            self._append(int(t))


class ModelDrafter:
    """A causal LM drafting chains with its own KV cache (a separate draft model, or a layer prefix).

    Cache contract: after begin, the cache holds the prompt; `pending` are committed tokens it has not read.
    draft(k) feeds pending, then samples d1..dk feeding d1..d(k-1), so the cache grows by len(pending) + k-1.
    commit keeps the accepted prefix of d1..d(k-1) (crop), and pending becomes [dk] if all k were accepted,
    plus the next token. Example: pending [r], k 3, accepted 2 -> cache keeps r d1 d2, pending [next].
    At temperature 0 drafts are argmax (probs None); otherwise sampled from q = softmax(logits / T) with the
    drafter's own generator, and q is returned (over the TARGET vocab) for the exact acceptance rule.
    cache "dynamic" or "static" (data.kvcache: preallocated, CUDA graphs on CUDA).
    """

    capture_layers = None

    def __init__(self, model: nn.Module, vocab_size: int | None = None, generator: torch.Generator | None = None,
                 cache: str = "dynamic"):
        self.model = model
        self.vocab_size = int(vocab_size or text_config(model.config).vocab_size)
        self.generator = generator
        self.cache_kind = cache
        self.kv: KVCache | None = None  # built by begin
        self.pending: list[int] = []
        self._draft: list[int] = []
        self._device = next(model.parameters()).device

    def _logits(self, tokens: list[int]) -> torch.Tensor:
        logits = self.kv.run(torch.tensor([tokens], dtype=torch.long), logits_to_keep=1)[0][0, -1]
        self.kv.keep(range(len(tokens)))
        v = self.vocab_size
        if logits.shape[-1] >= v:
            return logits[:v]
        # A draft vocab smaller than the target's: the missing tokens are never proposed.
        return torch.cat([logits, logits.new_full((v - logits.shape[-1],), float("-inf"))])

    @torch.no_grad()
    def begin(self, prompt_ids: torch.Tensor, features: Features | None, next_token: int) -> None:
        self.kv = new_kv(self.model, self.cache_kind, room=prompt_ids.shape[-1] + 256)
        self.kv.run(prompt_ids.reshape(1, -1), logits_to_keep=1)
        self.kv.keep(range(prompt_ids.shape[-1]))
        self.pending = [next_token]
        self._draft = []

    @torch.no_grad()
    def draft(self, k: int, temperature: float) -> DraftTree:
        self._draft = []
        if k <= 0:
            return _empty_tree(self._device)
        logits = self._logits(self.pending)
        self.pending = []
        probs = []
        for step in range(k):
            tok, q = draft_token(logits, temperature, self.generator)
            if q is not None:
                probs.append(q)
            self._draft.append(tok)
            if step < k - 1:
                logits = self._logits([tok])
        tokens = torch.tensor(self._draft, dtype=torch.long, device=self._device)
        return DraftTree.chain(tokens, torch.stack(probs) if probs else None)

    def commit(self, accepted: list[int], features: Features | None, next_token: int) -> None:
        self.commit_tokens([self._draft[a] for a in accepted], features, next_token)

    def commit_tokens(self, tokens: list[int], features: Features | None, next_token: int) -> None:
        tokens = [int(t) for t in tokens]
        if not self._draft:  # nothing drafted since the last commit: the cache has not moved
            self.pending += tokens + [int(next_token)]
            return
        fed = len(self._draft) - 1  # d1..d(k-1) are in the cache; dk was only sampled
        same = 0  # the cache rows of the drafted tokens the path agrees with are kept
        while same < min(fed, len(tokens)) and tokens[same] == self._draft[same]:
            same += 1
        if same < fed:
            self.kv.truncate(self.kv.length - (fed - same))
        self.pending = tokens[same:] + [int(next_token)]
        self._draft = []


def layer_prefix_model(model: nn.Module, num_layers: int) -> nn.Module:
    """A view of a causal LM that runs only its first `num_layers` decoder layers, then its final norm and head.

    No weight is copied: the returned module is a shallow copy of `model` (and of its decoder) holding the
    same layer, norm, embedding and head modules, with a copied config whose num_hidden_layers (and
    layer_types) are cut, so transformers' own forward stops early and sizes its cache to the prefix.
    The target itself is left untouched.
    """
    cfg = text_config(model.config)
    total = int(cfg.num_hidden_layers)
    if not 1 <= num_layers <= total:
        raise ValueError(f"layer_prefix_model: num_layers must be in 1..{total}, got {num_layers}")
    base = model.get_decoder()
    new_cfg = copy.deepcopy(cfg)
    new_cfg.num_hidden_layers = num_layers
    if getattr(new_cfg, "layer_types", None):
        new_cfg.layer_types = list(new_cfg.layer_types)[:num_layers]
    new_base = copy.copy(base)
    new_base.config = new_cfg
    new_model = copy.copy(model)
    new_model.config = new_cfg
    # copy.copy shares the child-module dict; give the wrapper its own before swapping the decoder in.
    new_model._modules = dict(model._modules)
    names = [name for name, child in model.named_children() if child is base]
    if not names:
        raise ValueError(f"layer_prefix_model: the decoder of {type(model).__name__} is not a direct child")
    new_model._modules[names[0]] = new_base
    return new_model


def self_speculative_drafter(model: nn.Module, num_layers: int, generator: torch.Generator | None = None,
                             cache: str = "dynamic") -> ModelDrafter:
    """Draft with the target's first `num_layers` layers + final norm + lm_head (no training, own cache)."""
    return ModelDrafter(layer_prefix_model(model, num_layers), text_config(model.config).vocab_size, generator, cache)


def deterministic_q(tokens: list[int], like: torch.Tensor) -> torch.Tensor:
    """q rows [len(tokens), V] (dtype and device of `like`) one-hot on each token: how a deterministic draft
    sits among sampled ones, since min(1, p/q) and max(p - q, 0) then reduce to the deterministic rule."""
    q = torch.zeros(len(tokens), like.shape[-1], dtype=like.dtype, device=like.device)
    q[torch.arange(len(tokens)), torch.tensor(tokens, device=like.device)] = 1.0
    return q


class _FeatureLog:
    """Features of consecutive positions, logged pass by pass and joined every CHUNK passes, so the number of
    tensors it holds grows 32 times slower than the passes. One small tensor pair kept per pass made
    Python's garbage collector rescan the process's objects ever more often: measured 254 us per deferred
    commit after 2,000 of them against 46 us with the collector off (7 us for the append itself), which
    kept a drafting-off pass above a plain one; copying into a preallocated buffer instead costs two torch
    slice copies per pass (66-155 us on the same loaded machine).

    Each pass's features are copied when logged (2.8 us a pass for the quickstart head's layers on one core):
    they may be views of buffers the next pass overwrites, as a static cache's CUDA graph replays into the same
    output tensors (data.kvcache.StaticKV), and a deferred commit reads them passes later."""

    CHUNK = 32

    def __init__(self) -> None:
        self.pending: list[Features] = []
        self.chunks: list[Features] = []

    @staticmethod
    def _join(feats: list[Features]) -> Features:
        if len(feats) == 1:
            return feats[0]
        aux = None if feats[0].aux is None else torch.cat([f.aux for f in feats], dim=1)
        return Features(last=torch.cat([f.last for f in feats], dim=1), aux=aux)

    def add(self, f: Features) -> None:
        self.pending.append(Features(last=f.last.clone(), aux=None if f.aux is None else f.aux.clone()))
        if len(self.pending) >= self.CHUNK:
            self.chunks.append(self._join(self.pending))
            self.pending = []

    def take(self) -> Features | None:
        """Everything logged, joined, and an empty log (None when nothing was)."""
        feats = self.chunks + self.pending
        self.pending, self.chunks = [], []
        return self._join(feats) if feats else None


class DeferredSync:
    """Wraps a drafter so that its begin and its commits wait while it does not draft (a policy gave it depth 0).

    Consecutive commits with no draft between them are one commit of the joined path (tokens t1 + [next1] +
    t2, features concatenated, next2): the drafter's state after it is the same. So the deferred commits are
    handed over as ONE `commit_tokens` right before the next draft, and one head forward over m rows costs
    less than m forwards of one row; a generation that never drafts again never pays for them. `begin` (a
    head forward over the whole prompt) waits the same way, for the first draft: it was 0.25% of a
    48-token generation that never drafted (scripts/bench_batch.py's single stream). A commit
    right after a draft goes through at once (the drafter rolls its own draft back). The deferred path is one
    token list and its features a chunked log (_FeatureLog), so a pass that drafts nothing costs a list
    extend and an append (scripts/bench_batch.py).

    `take_catch_up()` returns (and clears) the seconds the flushes took since it was last asked: what the
    decoder leaves out of the drafting cost it reports to a policy (eval.policy.AdaptivePolicy.draft_scale).
    """

    def __init__(self, inner: Any):
        self.inner = inner
        self.capture_layers = inner.capture_layers
        self.max_depth = getattr(inner, "max_depth", None)
        self.nodes = getattr(inner, "nodes", None)  # the inner drafter's node count per length, if it states one
        self._catch_up_s = 0.0
        self._drafted = False
        self._path: list[int] = []  # the joined deferred path: each commit's tokens, then its next token
        self._log = _FeatureLog()
        self._begin: tuple[torch.Tensor, Features | None, int] | None = None  # the deferred begin's arguments
        self._device = torch.device("cpu")

    def begin(self, prompt_ids: torch.Tensor, features: Features | None, next_token: int) -> None:
        self._drafted, self._path, self._log = False, [], _FeatureLog()
        self._begin, self._device = (prompt_ids, features, int(next_token)), prompt_ids.device

    def flush(self) -> None:
        """Hand the deferred begin and commits to the drafter: its begin, then one commit of the joined path."""
        start = time.perf_counter()
        if self._begin is not None:
            args, self._begin = self._begin, None
            self.inner.begin(*args)
        if self._path:
            path, self._path = self._path, []
            self.inner.commit_tokens(path[:-1], self._log.take(), path[-1])
        self._catch_up_s += time.perf_counter() - start

    def take_catch_up(self) -> float:
        """Seconds spent handing over deferred work (the prompt's begin, the skipped passes' commits) since the
        last call; cleared."""
        seconds, self._catch_up_s = self._catch_up_s, 0.0
        return seconds

    def draft(self, k: int, temperature: float) -> DraftTree:
        if k <= 0:
            return _empty_tree(self._device)
        self.flush()
        self._drafted = True
        return self.inner.draft(k, temperature)

    def commit(self, accepted: list[int], features: Features | None, next_token: int) -> None:
        if self._drafted:
            self._drafted = False
            self.inner.commit(accepted, features, next_token)
        else:  # nothing drafted since the last commit: nothing can have been accepted
            self.commit_tokens([], features, next_token)

    def commit_tokens(self, tokens: list[int], features: Features | None, next_token: int) -> None:
        if self._drafted:
            self._drafted = False
            self.inner.commit_tokens(tokens, features, next_token)
        else:
            self._path += [int(t) for t in tokens]
            self._path.append(int(next_token))
            if features is not None:
                self._log.add(features)


class HybridDrafter:
    """A drafter's tree (EAGLE chain or dynamic tree, Medusa static tree, MTP chain, ...) plus the n-gram's
    proposal as extra branches, verified in one target pass.

    The n-gram chain is prefix-merged into the head's tree: walking it from the root, a token that the
    current node already has as a child (from the head) reuses that node (tagged "head+ngram"), otherwise
    a new node is appended (tagged "ngram"), so no sibling is ever duplicated. Example: head chain [a b c],
    n-gram [a b d e] -> nodes a b c (head) and d e under b; a and b are tagged "head+ngram".

    Exactness: an n-gram node is a deterministic draft. In a tree without probs, or a "topk" tree, every node
    is already judged by the deterministic rule. In an "iid" tree (a sampled chain) the n-gram node gets the
    one-hot q on its token, for which min(1, p/q) and normalize(max(p - q, 0)) ARE the deterministic rule
    (accept with p(y), then p with y zeroed); each sibling step keeps the law of what is left, whatever
    decided that the sibling is there (tests/test_policy.py checks the law against a biased variant).

    Sync: both proposers commit the accepted path by its tokens (`commit_tokens`), so the head follows a path
    that came from an n-gram branch, reading the target's features of those positions as usual. The head is
    wrapped in DeferredSync: while a policy gives it depth 0 its commits wait for its next draft.
    `budgets` (draft's argument: eval.policy.AdaptivePolicy's choice, passed by the decoder every pass) caps
    each proposer's depth; None = both use k.
    """

    SOURCES = ("head", "ngram")

    def __init__(self, head: Any, ngram: NgramDrafter | None = None):
        self.head = head if isinstance(head, DeferredSync) else DeferredSync(head)
        self.ngram = ngram if ngram is not None else NgramDrafter()
        self.capture_layers = head.capture_layers
        self._tokens: list[int] = []
        self._order = 0  # the match order of the n-gram proposal last sized (`proposal`)

    def begin(self, prompt_ids: torch.Tensor, features: Features | None, next_token: int) -> None:
        self.head.begin(prompt_ids, features, next_token)
        self.ngram.begin(prompt_ids, None, next_token)
        self._tokens = []

    def proposal(self, source: str, k: int) -> int | None:
        """How deep `source` would draft with k allowed, if known before drafting (the n-gram's match), else None."""
        if source != "ngram":
            return None
        tokens, self._order = self.ngram.match(k)
        return len(tokens)

    def max_depth_of(self, source: str) -> int | None:
        """The deepest `source` can draft at all (heads.types.Drafter's max_depth): the head's; the n-gram has none."""
        return self.head.max_depth if source == "head" else None

    def nodes_of(self, source: str) -> Callable[[int], int] | None:
        """The head's own node count per length, where it states one (heads.types.Drafter's `nodes`); the
        n-gram's chain is learned (eval.policy.node_count)."""
        return getattr(self.head, "nodes", None) if source == "head" else None

    def proposal_key(self, source: str) -> str:
        """What the proposal `proposal` just sized is priced as (eval.policy.AdaptivePolicy keeps acceptance per
        key): the n-gram's by its match order, "ngram@3" for a 3-token suffix match, since a long match is
        accepted far more often than a 1-token one and one average would price both alike; the head's as "head"."""
        return f"ngram@{self._order}" if source == "ngram" else source

    def draft(self, k: int, temperature: float, budgets: Mapping[str, int] | None = None) -> DraftTree:
        budgets = budgets or {}
        kh, kn = min(k, budgets.get("head", k)), min(k, budgets.get("ngram", k))
        head = self.head.draft(kh, temperature) if kh > 0 else _empty_tree(self.ngram.device)
        tokens, parents = head.tokens.tolist(), head.parents.tolist()
        sources = ["head"] * len(tokens)
        child: dict[tuple[int, int], int] = {}
        for i, (par, tok) in enumerate(zip(parents, tokens)):
            child.setdefault((par, tok), i)
        node = -1
        for tok in self.ngram.lookup(kn) if kn > 0 else []:
            nxt = child.get((node, tok))
            if nxt is None:
                nxt = len(tokens)
                tokens.append(tok)
                parents.append(node)
                sources.append("ngram")
                child[(node, tok)] = nxt
            elif sources[nxt] == "head":
                sources[nxt] = "head+ngram"
            node = nxt
        self._tokens = tokens
        dev = head.tokens.device
        probs = head.probs
        extra = len(tokens) - len(head)
        if probs is not None and extra:
            probs = torch.cat([probs, deterministic_q(tokens[len(head):], probs)])
        return DraftTree(torch.tensor(tokens, dtype=torch.long, device=dev),
                         torch.tensor(parents, dtype=torch.long, device=dev), probs, head.sampling, sources)

    def commit(self, accepted: list[int], features: Features | None, next_token: int) -> None:
        self.commit_tokens([self._tokens[a] for a in accepted], features, next_token)

    def commit_tokens(self, tokens: list[int], features: Features | None, next_token: int) -> None:
        self.head.commit_tokens(tokens, features, next_token)
        self.ngram.commit_tokens(tokens, None, next_token)
        self._tokens = []

    def take_catch_up(self) -> float:
        """The head's deferred catch-up seconds (DeferredSync.take_catch_up); the n-gram defers nothing."""
        return self.head.take_catch_up()
