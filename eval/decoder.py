"""The exact speculative decoder: draft, verify in one target pass, accept by the exact rule, roll back caches.

    from eval.decoder import speculative_generate, plain_generate
    from eval.drafters import NgramDrafter
    new_ids, stats = speculative_generate(model, input_ids, NgramDrafter(), k=6, max_new_tokens=128)
    print(stats.tau, stats.acceptance_rates)

Batch 1. One generation:
  prefill   the target reads the prompt (positions 0..n-1); the first new token x0 is taken from its last
            distribution and becomes the ROOT; drafter.begin(prompt, features, x0).
  each pass the drafter proposes a DraftTree below the root (a chain is a tree). The target reads
            [root, node 0, ..., node N-1] in ONE forward: row 0 is the root at position L (L = committed
            length of the target cache), node i is row i+1 at position L + depth(i). Chains use the ordinary
            causal mask; other trees a 4D mask where a row sees the cache, the root and its ancestors.
            Row 0's distribution judges the root's children, row i+1's judges node i's children (or gives
            the bonus token when node i is an accepted leaf).
  accept    `verify_tree` walks down from the root by the exact rule and returns the accepted path and the
            next token (the correction after a rejection, or the bonus after an accepted leaf).
  rollback  the target cache keeps the root plus the accepted nodes, moved into consecutive slots (accepted
            nodes of a tree need not be consecutive in the cache); drafter.commit(accepted, features of
            [root, accepted...], next) rolls the drafter back likewise; the next token is the new root.

Verification rules (all exact: the output is distributed as plain sampling from the processed target p):
  greedy (temperature 0)  accept a child iff it equals the target's argmax; else output the argmax.
  deterministic children  (DraftTree.probs None, or sampling "topk"; EAGLE) q is one-hot per child: accept
                          child x with probability p(x); on rejection p(x) <- 0, renormalise, try the next
                          sibling; if none is accepted sample from what is left of p.
  i.i.d. children         (probs given, sampling "iid"; chains of sampled drafts, SpecInfer trees) accept
                          child x with min(1, p(x)/q(x)); on rejection p <- normalize(max(p - q, 0)).
Both rejection updates go through `residual_distribution`, so a test can swap in a biased variant.
Temperature, top-k and top-p shape the TARGET distribution (`target_distribution`, data.sampling: transformers'
own warpers) exactly as in `plain_generate` and `model.generate`. Every draw takes its uniform on the
generator's own device (`data.sampling.uniform`), so a CPU generator works for CUDA logits and vice versa.

Drafting policy: with `policy` (eval.policy) the draft length of every pass is the policy's choice from
what this request has accepted so far (0 = a plain one-token pass; the drafter still commits every pass,
so it stays in sync and can draft again later). The policy only decides WHAT is drafted, never how it is
judged, so the output is the same whatever it chooses (tests/test_policy.py, down to a random policy).

Several generations side by side: `plain_steps` and `speculative_steps` are the same loops a pass at a time,
and `interleave` runs them one pass each in turn, each timed over its own passes (the eval's turns: plain and
every method on one turn, so that a slow spell of the machine falls on all of them alike).

KV cache (`cache=`): "dynamic" is transformers' DynamicCache; "static" preallocates every layer and, on CUDA,
replays each verify size as a captured CUDA graph (data.kvcache, which also owns the rollback). Both give the
same tokens; the exactness tests run on both.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from data.kvcache import KVCache, new_kv
from data.sampling import sample_token, target_distribution, uniform
from heads.base import Drafter, DraftTree
from heads.tree import check_parents, is_chain, tree_depth

__all__ = [
    "EMPTY",
    "DraftPolicy",
    "GenerationStats",
    "Verdict",
    "cycle_orders",
    "draft_pass",
    "interleave",
    "judge",
    "plain_generate",
    "plain_steps",
    "record_verdict",
    "residual_distribution",
    "sample_token",
    "speculative_generate",
    "speculative_steps",
    "target_distribution",
    "verify_tree",
]


# ----------------------------------------------------------------------------------------------- stats
@dataclass
class GenerationStats:
    """What one (or, after `merge`, several) generations did.

    tau counts, per verify pass, the accepted draft tokens plus the corrected or bonus token (so plain
    decoding has tau 1 and a k-chain at most k+1); the prefill pass and its token are not in it.
    Per depth d+1 (index d): drafted_per_position = passes whose draft reached that depth,
    judged_per_position = passes that tested a node there (the draft reached it AND depth d was accepted),
    accepted_per_position = passes that accepted a node there. acceptance_rates = accepted / judged.
    Example: chain of 3, first two accepted -> drafted +1 at depths 1-3, judged +1 at 1-3, accepted +1 at 1-2.
    """

    new_tokens: int = 0
    target_passes: int = 0  # verify passes (prefill excluded)
    accepted_tokens: int = 0  # accepted draft tokens over all passes (before truncation at eos/max)
    drafted_tokens: int = 0  # draft nodes sent to the target
    accepted_per_position: list[int] = field(default_factory=list)
    judged_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    nodes_per_pass: list[int] = field(default_factory=list)  # draft nodes verified in each pass
    # Passes per chosen draft length, per proposer ("draft" for a single drafter; "head" and "ngram" for a
    # hybrid under a policy); 0 = a plain one-token pass. Keys are str in JSON.
    chosen_k: dict[str, dict[int, int]] = field(default_factory=dict)
    # Accepted draft tokens per proposer of their node (DraftTree.sources; "draft" when untagged).
    accepted_by_source: dict[str, int] = field(default_factory=dict)
    prefill_time_s: float = 0.0
    draft_time_s: float = 0.0  # drafter.begin/draft/commit
    verify_time_s: float = 0.0  # target forward + acceptance + cache rollback
    # The verify forwards alone (kv.run; on a GPU their launch, the wait lands in what reads the logits): the
    # rest of decode_time_s is the loop's own drafting, judging and bookkeeping (scripts/bench_batch.py).
    forward_time_s: float = 0.0
    total_time_s: float = 0.0
    generations: int = 0

    @property
    def tau(self) -> float:
        return (self.accepted_tokens + self.target_passes) / self.target_passes if self.target_passes else 1.0

    @property
    def acceptance_rates(self) -> list[float]:
        """Conditional acceptance per depth: P(a node at depth d+1 is accepted | one was tested there)."""
        return [a / j if j else 0.0 for a, j in zip(self.accepted_per_position, self.judged_per_position)]

    @property
    def draft_rate(self) -> float:
        """Fraction of passes that verified at least one draft node (below 1 for n-gram lookup)."""
        return self.drafted_per_position[0] / self.target_passes if self.drafted_per_position else 0.0

    @property
    def decode_time_s(self) -> float:
        return self.total_time_s - self.prefill_time_s

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_time_s if self.total_time_s > 0 else 0.0

    def record_pass(self, n_nodes: int, depth: int, accepted_depth: int, judged_depth: int) -> None:
        """One verify pass: n_nodes drafted down to `depth`, tested down to judged_depth, accepted_depth kept."""
        self.target_passes += 1
        self.drafted_tokens += n_nodes
        self.accepted_tokens += accepted_depth
        self.nodes_per_pass.append(n_nodes)
        grow = depth - len(self.drafted_per_position)
        if grow > 0:
            for counts in (self.drafted_per_position, self.judged_per_position, self.accepted_per_position):
                counts.extend([0] * grow)
        for d in range(depth):
            self.drafted_per_position[d] += 1
        for d in range(judged_depth):
            self.judged_per_position[d] += 1
        for d in range(accepted_depth):
            self.accepted_per_position[d] += 1

    def merge(self, other: GenerationStats) -> GenerationStats:
        """A new GenerationStats summing self and other (for per-benchmark totals)."""
        out = GenerationStats(**{k: v for k, v in asdict(self).items()})
        for name in ("new_tokens", "target_passes", "accepted_tokens", "drafted_tokens", "prefill_time_s",
                     "draft_time_s", "verify_time_s", "forward_time_s", "total_time_s", "generations"):
            setattr(out, name, getattr(self, name) + getattr(other, name))
        for name in ("accepted_per_position", "judged_per_position", "drafted_per_position"):
            a, b = getattr(self, name), getattr(other, name)
            n = max(len(a), len(b))
            setattr(out, name, [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)])
        out.nodes_per_pass = self.nodes_per_pass + other.nodes_per_pass
        out.chosen_k = {src: _add_counts(self.chosen_k.get(src, {}), other.chosen_k.get(src, {}))
                        for src in {**self.chosen_k, **other.chosen_k}}
        out.accepted_by_source = _add_counts(self.accepted_by_source, other.accepted_by_source)
        return out

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("nodes_per_pass")
        d.update(tau=self.tau, acceptance_rates=self.acceptance_rates, draft_rate=self.draft_rate,
                 tokens_per_s=self.tokens_per_s, decode_time_s=self.decode_time_s)
        return d


# The draft of a pass that drafts nothing: one shared tree (never modified), not new tensors per pass and row.
EMPTY = DraftTree.chain(torch.empty(0, dtype=torch.long))

# A generation a pass at a time: yields after the prefill and each pass, returns (new ids, stats) (`interleave`).
Steps = Generator[None, None, tuple[torch.Tensor, GenerationStats]]


def _add_counts(a: dict, b: dict) -> dict:
    return {key: a.get(key, 0) + b.get(key, 0) for key in sorted({*a, *b})}


class DraftPolicy(Protocol):
    """Chooses each pass's draft length for one request at a time (eval.policy.AdaptivePolicy).

    reset(k): a new request starts; k is the calibrated draft length (speculative_generate's k).
    choose(drafter, budget) -> {proposer: length}: this pass's draft length per proposer, each <= budget
        (0 = that proposer drafts nothing); the decoder passes the largest to drafter.draft (none > 0: a
        plain pass), and to a drafter of several proposers (SOURCES) the whole choice as draft's `budgets`
        (HybridDrafter). The policy never changes the drafter itself.
    observe(tree, accepted, seconds): what the target accepted of the tree it verified, and how long that
        verify pass took (the root plus len(tree) tokens through the target, and the accept/reject step;
        None when not timed).
    observe_drafting(seconds), optional: after a pass that drafted, the seconds the drafter's own calls took
        in it (its draft and its commit of the verdict), less what a deferred sync first spent catching up
        (`take_catch_up`: the prompt's begin, the skipped passes' commits, each paid once, not by every later
        draft); the single-stream decoder calls it when the policy has it.
    """

    def reset(self, k: int) -> None: ...

    def choose(self, drafter: Drafter, budget: int) -> dict[str, int]: ...

    def observe(self, tree: DraftTree, accepted: list[int], seconds: float | None = None) -> None: ...


# ----------------------------------------------------------------------------------------------- sampling
def _next_token(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                generator: torch.Generator | None) -> int:
    """The token following a distribution row [V]: argmax when greedy, else a processed sample."""
    if temperature <= 0:
        return int(logits.argmax())
    return sample_token(target_distribution(logits, temperature, top_k, top_p), generator)


def residual_distribution(p: torch.Tensor, q: torch.Tensor | None, token: int) -> torch.Tensor:
    """What is left of p [V] after the draft `token` drawn from q [V] was rejected: normalize(max(p - q, 0)).

    q None means the draft was deterministic (q one-hot on `token`): the residual is p with p(token) zeroed.
    If nothing is left (p <= q everywhere, a rejection of probability 0 up to rounding), p is returned.
    """
    if q is None:
        r = p.clone()
        r[token] = 0.0
    else:
        r = (p - q).clamp_min_(0.0)
    s = r.sum()
    return r / s if s > 0 else p


def verify_tree(
    tree: DraftTree, target_probs: torch.Tensor, temperature: float, generator: torch.Generator | None = None
) -> tuple[list[int], int]:
    """Walk the draft tree from the root by the exact acceptance rule (see the module docstring).

    target_probs [N+1, V]: row 0 the target's processed distribution at the root, row i+1 at node i.
    With temperature 0 only the argmax of each row is used (raw logits are fine).
    Returns (accepted node indices along the path, root side first; the next token).
    Example: chain tokens [5, 7, 9], greedy argmax rows [5, 7, 2, 4] -> ([0, 1], 2): nodes 0 and 1 match,
    node 2 (token 9) is not row 2's argmax 2, so 2 is the correction.
    """
    tokens = tree.tokens.tolist()
    children: list[list[int]] = [[] for _ in range(len(tokens) + 1)]  # index 0 = root, i+1 = node i
    for i, par in enumerate(tree.parents.tolist()):
        children[par + 1].append(i)
    accepted: list[int] = []
    row = 0
    if temperature <= 0:
        best = target_probs.argmax(dim=-1).tolist()
        while True:
            want = best[row]
            nxt = next((c for c in children[row] if tokens[c] == want), None)
            if nxt is None:
                return accepted, want
            accepted.append(nxt)
            row = nxt + 1
    deterministic = tree.probs is None or tree.sampling == "topk"
    if not deterministic and tree.sampling != "iid":
        raise ValueError(f"verify_tree: DraftTree.sampling must be 'iid' or 'topk', got {tree.sampling!r}")
    while True:
        p = target_probs[row]
        for c in children[row]:
            x = tokens[c]
            q = None if deterministic else tree.probs[c]
            # Accept with min(1, p(x)/q(x)); u*q(x) < p(x) avoids dividing (q one-hot: q(x) = 1).
            u = uniform(generator, p.device)
            if u * (1.0 if q is None else float(q[x])) < float(p[x]):
                accepted.append(c)
                row = c + 1
                break
            p = residual_distribution(p, q, x)
        else:
            return accepted, sample_token(p, generator)


# ----------------------------------------------------------------------------------------------- loops
def _eos_set(eos_token_id: int | Sequence[int] | None) -> frozenset[int]:
    if eos_token_id is None:
        return frozenset()
    return frozenset([int(eos_token_id)] if isinstance(eos_token_id, int) else [int(e) for e in eos_token_id])


def _check_inputs(input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    ids = input_ids[None] if input_ids.dim() == 1 else input_ids
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
        raise ValueError(f"input_ids must be [1, T] with T >= 1 (batch 1), got {tuple(input_ids.shape)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    return ids


def _truncate_at_eos(tokens: list[int], eos: frozenset[int]) -> tuple[list[int], bool]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1], True
    return tokens, False


@torch.no_grad()
def plain_steps(
    model: nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_token_id: int | Sequence[int] | None = None,
    generator: torch.Generator | None = None,
    cache: str | KVCache = "dynamic",
    observe: Callable[[int, float], None] | None = None,
) -> Steps:
    """`plain_generate` a pass at a time (see `interleave`): yields after the prefill and after every pass.

    observe(1, seconds), optional: called with every pass's timed forward (eval.turns feeds the run's learned
    verify curve with plain decoding's passes, timed beside the drafters': eval.policy.LearnedVerifyCost)."""
    ids = _check_inputs(input_ids, max_new_tokens)
    eos = _eos_set(eos_token_id)
    stats = GenerationStats(generations=1)
    t0 = time.perf_counter()
    kv = new_kv(model, cache, room=ids.shape[1] + max_new_tokens)
    logits, _ = kv.run(ids, logits_to_keep=1)
    kv.keep(range(ids.shape[1]))
    out = [_next_token(logits[0, -1], temperature, top_k, top_p, generator)]
    stats.prefill_time_s = time.perf_counter() - t0
    yield
    while len(out) < max_new_tokens and out[-1] not in eos:
        tv = time.perf_counter()
        logits, _ = kv.run(torch.tensor([[out[-1]]]), logits_to_keep=1)
        stats.forward_time_s += time.perf_counter() - tv
        kv.keep([0])
        out.append(_next_token(logits[0, -1], temperature, top_k, top_p, generator))
        seconds = time.perf_counter() - tv
        stats.verify_time_s += seconds
        stats.record_pass(0, 0, 0, 0)
        if observe is not None:
            observe(1, seconds)
        yield
    stats.new_tokens = len(out)
    return torch.tensor(out, dtype=torch.long), stats


def plain_generate(
    model: nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_token_id: int | Sequence[int] | None = None,
    generator: torch.Generator | None = None,
    cache: str | KVCache = "dynamic",
) -> tuple[torch.Tensor, GenerationStats]:
    """Token-by-token decoding with the same processors and cache as `speculative_generate` (the reference).

    Returns (new token ids [n] long, stats with tau 1). Stops after an eos token (kept) or max_new_tokens.
    """
    return interleave([plain_steps(model, input_ids, max_new_tokens, temperature, top_k, top_p, eos_token_id,
                                   generator, cache)])[0]


def cycle_orders(n: int, seed: int = 0) -> Iterator[list[int]]:
    """The order of n interleaved runs in each cycle (one step of each): a fresh seeded shuffle every cycle, so
    that no run's steps always follow the same other run's. A pass right after a heavier run's pass is slower
    on these CPUs: at batch 2 a drafting-off run read 1.012x plain when its passes followed a hybrid's and
    0.993x when they followed plain's (scripts/bench_batch.py's rows, 3 repeats each), and a fixed cycle
    charged that to the same run on every pass (the sweep's load-aware run always followed the hybrid)."""
    rng = random.Random(seed)
    order = list(range(n))
    while True:
        rng.shuffle(order)
        yield list(order)


def interleave(runs: Sequence[Steps]) -> list[tuple[torch.Tensor, GenerationStats]]:
    """Run generations (`plain_steps`, `speculative_steps`) one step each per cycle (`cycle_orders`) until all are
    done; their (new ids, stats) in order, each stats.total_time_s the seconds of its own steps. Methods
    compared on one turn (eval.turns) run this way so that a slow spell of the machine falls on all of their
    passes alike, not on whichever ran during it (tests/test_decoder.py plants a drift, and a slowdown after
    one run's steps); one run alone is the ordinary loop (`plain_generate`, `speculative_generate`)."""
    results: list[Any] = [None] * len(runs)
    spent = [0.0] * len(runs)
    live = set(range(len(runs)))
    orders = cycle_orders(len(runs))
    while live:
        for i in next(orders):
            if i not in live:
                continue
            t = time.perf_counter()
            try:
                next(runs[i])
            except StopIteration as stop:
                results[i] = stop.value
                live.remove(i)
            spent[i] += time.perf_counter() - t
    for (_, stats), seconds in zip(results, spent):
        stats.total_time_s = seconds
    return results


def draft_pass(drafter: Drafter, policy: DraftPolicy | None, k: int, budget: int, temperature: float,
               stats: GenerationStats, chosen: dict[str, int] | None = None) -> DraftTree:
    """This pass's draft: the policy's lengths per proposer (or k), handed to a multi-proposer drafter as its
    `budgets` (HybridDrafter); an empty chain when nothing is drafted (the drafter is then not called). The
    tree's shape is checked. Shared by speculative_generate and the batched loop (eval.batch), per row;
    `chosen` (eval.policy.LoadAware's gated choice) replaces the policy's own choice for this pass."""
    if chosen is None:
        chosen = {"draft": min(k, budget)} if policy is None else policy.choose(drafter, budget)
    kk = max(chosen.values(), default=0)
    if kk > budget:
        raise ValueError(f"policy chose draft lengths {chosen} with only {budget} tokens left to make")
    for src, n_src in chosen.items():
        counts = stats.chosen_k.setdefault(src, {})
        counts[n_src] = counts.get(n_src, 0) + 1
    if kk <= 0:
        return EMPTY
    multi = policy is not None and hasattr(drafter, "SOURCES")
    tree = drafter.draft(kk, temperature, budgets=chosen) if multi else drafter.draft(kk, temperature)
    if tree.parents.numel() != len(tree):
        raise ValueError(f"DraftTree: {len(tree)} tokens but {tree.parents.numel()} parents")
    if not is_chain(tree.parents):
        check_parents(tree.parents.tolist())
    return tree


@dataclass
class Verdict:
    """What the target made of one verified tree: the accepted node indices (root side first), the next token
    (correction or bonus), the cache rows to keep ([0] = the root, then a + 1 per accepted node) and the
    tokens the pass emits (the accepted drafts, then the next token; before any eos truncation)."""

    accepted: list[int]
    next_token: int
    path: list[int]
    tokens: list[int]

    def columns(self, device: torch.device) -> slice | torch.Tensor:
        """The pass's columns of [root, accepted...], whose features the drafter commits: a chain's path is a
        prefix of them, taken as a slice (a view: no index tensor, no copy; most passes are chains), a tree's
        an index tensor. Paths ascend (parents precede children), so the last entry tells which."""
        n = len(self.path)
        return slice(0, n) if self.path[-1] == n - 1 else torch.tensor(self.path, device=device)


def judge(tree: DraftTree, logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
          generator: torch.Generator | None) -> Verdict:
    """One verify pass's decision: logits [len(tree) + 1, V] of [root, nodes...] through the target's processors
    and `verify_tree`. The single-stream decoder and every row of the batched loop (eval.batch) call this.

    An empty tree (a pass that drafted nothing) takes the next token as plain decoding does (`_next_token`: the
    same rule, the same draws from `generator`), without the walk's lists: about 0.01 ms of a drafting-off pass,
    paid per row in a batch (scripts/bench_batch.py)."""
    if not len(tree):
        nxt = _next_token(logits[-1], temperature, top_k, top_p, generator)
        return Verdict([], nxt, [0], [nxt])
    rows = logits if temperature <= 0 else target_distribution(logits, temperature, top_k, top_p)
    accepted, nxt = verify_tree(tree, rows, temperature, generator)
    draft_tokens = tree.tokens.tolist()
    return Verdict(accepted, nxt, [0] + [a + 1 for a in accepted], [draft_tokens[a] for a in accepted] + [nxt])


def record_verdict(stats: GenerationStats, policy: DraftPolicy | None, tree: DraftTree, verdict: Verdict,
                   seconds: float | None) -> None:
    """The pass into the stats and the policy (seconds: the timed verify, None when the caller times it)."""
    _record(stats, tree, verdict.accepted)
    if policy is not None:
        policy.observe(tree, verdict.accepted, seconds)


def _record(stats: GenerationStats, tree: DraftTree, accepted: list[int]) -> None:
    """One verify pass into the stats: depths drafted, tested and accepted, and accepted tokens per proposer."""
    n = len(tree)
    # The level below the last accepted node (or the root) was tested iff that node has children.
    last = accepted[-1] if accepted else -1
    tested = len(accepted) + int(len(accepted) < n and bool((tree.parents == last).any()))
    stats.record_pass(n, tree_depth(tree.parents), len(accepted), tested)
    for a in accepted:
        src = tree.sources[a] if tree.sources is not None else "draft"
        stats.accepted_by_source[src] = stats.accepted_by_source.get(src, 0) + 1


@torch.no_grad()
def speculative_steps(
    model: nn.Module,
    input_ids: torch.Tensor,
    drafter: Drafter,
    k: int,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_token_id: int | Sequence[int] | None = None,
    generator: torch.Generator | None = None,
    cache: str | KVCache = "dynamic",
    policy: DraftPolicy | None = None,
) -> Steps:
    """`speculative_generate` a pass at a time (see `interleave`): yields after the prefill and every pass."""
    ids = _check_inputs(input_ids, max_new_tokens)
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if policy is not None:
        policy.reset(k)
    uses_drafter = k > 0 or policy is not None
    eos = _eos_set(eos_token_id)
    stats = GenerationStats(generations=1)
    perf = time.perf_counter
    t0 = perf()
    kv = new_kv(model, cache, drafter.capture_layers, room=ids.shape[1] + max_new_tokens + k + 64)
    logits, feats = kv.run(ids, logits_to_keep=1)
    kv.keep(range(ids.shape[1]))
    out = [_next_token(logits[0, -1], temperature, top_k, top_p, generator)]
    stats.prefill_time_s = perf() - t0
    done = out[-1] in eos or len(out) >= max_new_tokens
    if uses_drafter and not done:  # k = 0 without a policy is plain decoding: the drafter is never asked
        td = perf()
        drafter.begin(ids, feats, out[-1])
        stats.draft_time_s += perf() - td
    yield
    while not done:
        td = perf()
        # Never draft past max_new_tokens: the pass itself always adds one token.
        budget = max_new_tokens - len(out) - 1
        chosen = None if policy is None else policy.choose(drafter, budget)
        tq = perf()  # the drafter's own time starts here (observe_drafting): the policy's choice is not drafting
        tree = draft_pass(drafter, policy, k, budget, temperature, stats, chosen)
        tv = perf()
        stats.draft_time_s += tv - td
        # Built where the drafter left its tokens; the cache moves them (a static one without a host sync).
        logits, feats = kv.run(torch.cat([tree.tokens.new_tensor([out[-1]]), tree.tokens])[None], tree.parents)
        stats.forward_time_s += perf() - tv
        verdict = judge(tree, logits[0], temperature, top_k, top_p, generator)
        accepted, nxt, path = verdict.accepted, verdict.next_token, verdict.path
        # The pass added the root (kept) and the nodes (keep the accepted ones, packed after the root).
        kv.keep(path)
        verify_s = perf() - tv
        stats.verify_time_s += verify_s
        record_verdict(stats, policy, tree, verdict, verify_s)
        new, done = _truncate_at_eos(verdict.tokens, eos)
        out.extend(new)
        if len(out) >= max_new_tokens:
            del out[max_new_tokens:]
            done = True
        drafting = tv - tq
        if not done and uses_drafter:
            tc = perf()
            # Features of [root, accepted...] in path order: rows 0 and a+1 of this pass
            drafter.commit(accepted, None if feats is None else feats.index(verdict.columns(ids.device)), nxt)
            commit_s = perf() - tc
            stats.draft_time_s += commit_s
            drafting += commit_s
        if hasattr(drafter, "take_catch_up"):
            # A one-time cost, already paid: priced into every later draft it once made one request of four
            # in a quickstart gsm8k run draft on 6 of 127 passes (its two re-probes each caught up on 8 and
            # 16 skipped passes, raising the price that kept it off), where drafting every pass paid 1.38x.
            drafting -= drafter.take_catch_up()
        if len(tree) and hasattr(policy, "observe_drafting"):
            policy.observe_drafting(drafting)
        yield
    stats.new_tokens = len(out)
    return torch.tensor(out, dtype=torch.long), stats


def speculative_generate(
    model: nn.Module,
    input_ids: torch.Tensor,
    drafter: Drafter,
    k: int,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_token_id: int | Sequence[int] | None = None,
    generator: torch.Generator | None = None,
    cache: str | KVCache = "dynamic",
    policy: DraftPolicy | None = None,
) -> tuple[torch.Tensor, GenerationStats]:
    """Exact speculative decoding of one prompt (see the module docstring for the loop and the rules).

    input_ids [1, T] (or [T]); k is the draft length (chain length or tree depth) passed to drafter.draft,
    0 = plain decoding through the same loop (the drafter is not called at all). With a `policy`, k is its
    starting point and the policy picks every pass's length (the drafter is begun and committed every pass).
    Sampling uses `generator` for every target-side draw (the drafter keeps its own). Returns (new token
    ids [n] long, GenerationStats); stops after an eos token (kept) or max_new_tokens, exactly like
    plain_generate with the same arguments. cache: "dynamic", "static" (data.kvcache; static forwards are
    CUDA graphs on CUDA) or a cache object to reuse (see `new_kv`).
    """
    return interleave([speculative_steps(model, input_ids, drafter, k, max_new_tokens, temperature, top_k, top_p,
                                         eos_token_id, generator, cache, policy)])[0]
