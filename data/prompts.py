"""Self-written training prompts: the target writes its own user turns, so no dataset needs a license.

    python -m data.prompts --config configs/smollm2-135m.yaml --out runs/quickstart
    python -m data.regenerate --config configs/smollm2-135m.yaml --out runs/quickstart \
        --regenerate.prompts=runs/quickstart/prompts.jsonl

How a prompt is made (settings in the `prompts` config section, data/config.py):
- the chat template is rendered up to the start of a user turn. The prefix is found generically: a
  conversation whose user turn is a sentinel is rendered, and everything before the sentinel is the
  prefix, everything after it the end-of-turn text (ChatML `<|im_end|>\\n`, Llama-3 `<|eot_id|>`); no
  per-model strings. A domain (coding, math, writing, ...) may add a short system hint to that render and
  a few opening words ("openers") the target continues; both steer a small target towards the domain.
- a context-carrying domain (one with `requests`) makes prompts that hold a passage: the sampled text (or a
  passage drawn from the domain's `passages` file) is the passage, and the user turn is the passage, a blank
  line and one request drawn per item ("Summarise the text above."); a request holding `{passage}` places the
  passage there instead ("Complete this function:\\n\\n{passage}"). A sampled passage cut off at
  max_new_tokens is trimmed to its last finished sentence instead of being dropped as unfinished. Answers
  to such prompts copy from their context, which is what drafting on summarisation and retrieval needs.
- item i draws its domain (by weight), opener and sampling seed from a generator seeded by (seed, i), and
  its text is sampled until the end-of-turn token, any other special token or EOS. Items are generated
  in fixed chunks of `batch_size` (left padded, one generator per row), so which items share a batch
  changes nothing.
- each text is cleaned (whitespace, cut at a rendered end-of-turn marker) and filtered, in item order:
  too short, cut off at max_new_tokens (an unfinished question), a near-duplicate of an earlier kept prompt
  (same normalized text, or >= `max_dup_overlap` of its word n-grams in one kept prompt), or overlapping
  a bundled benchmark prompt (MT-bench, HumanEval, GSM8K test: >= `max_bench_overlap` of the n-grams of
  either side shared). Generation stops once `num_prompts` minus the mixed share are kept.
- the output OUT/<prompts.output> (prompt JSONL: `id`, `prompt`, `category` = domain, read by
  data.regenerate) holds the kept prompts plus `mix_share` of bundled GSM8K train prompts, in a seeded
  order; OUT/<stem>.summary.json counts per domain (generated, kept, dropped by reason, mean length).

Resumable like regeneration: every candidate (kept or not) is appended to OUT/<stem>.candidates.jsonl
with flush + fsync per chunk; a killed run rerun with the same command replays that journal through the
filters and continues at the next item, so its output equals an uninterrupted run's. Settings that change
the prompts are stored in OUT/<stem>.meta.json; resuming with other ones is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from data.cli import cli_main
from data.config import PromptsConfig, RunConfig, save_config, to_dict
from data.readers import DataError, read_records
from data.regenerate import check_settings, generate_texts, read_done, run_cli
from data.target import load_model, load_tokenizer
from data.tokenize import render_chat

_BUNDLED = Path(__file__).resolve().parent / "bundled"
# The eval stage's bundled benchmark prompts (eval/bench.py reads the same files): never train on them.
BENCHMARK_FILES = (_BUNDLED / "mt_bench.jsonl", _BUNDLED / "HumanEval.jsonl.gz", _BUNDLED / "gsm8k_test.jsonl")
_SENTINELS = ("QqSENTINELqQ", "ZzMARKERzZ")  # two, to check that the prefix does not depend on the content


# ----------------------------------------------------------------------------------------------- template
def user_turn_prefix(tokenizer: Any, system: str | None = None, template: str | None = None) -> tuple[str, str]:
    """(prefix, end_of_turn) of the chat template: the text before a user turn's content and after it.

    Found by rendering a one-user-turn conversation (with `system` as a system message if given) whose
    content is a sentinel. Raises DataError when the template refuses the conversation or when the prefix
    depends on the content (then no fixed prefix exists to sample from).
    """
    parts = []
    for s in _SENTINELS:
        msgs = ([{"role": "system", "content": system}] if system is not None else []) + [{"role": "user", "content": s}]
        try:
            text = render_chat(tokenizer, msgs, template)
        except Exception as e:  # jinja raises whatever the template author chose (e.g. "system role not supported")
            raise DataError(f"chat template cannot render a user turn{' after a system hint' if system else ''}: "
                            f"{' '.join(str(e).split())}") from None
        if text.count(s) != 1:
            raise DataError("chat template does not render a user turn's content verbatim; cannot find its prefix")
        at = text.index(s)
        parts.append((text[:at], text[at + len(s):]))
    if parts[0] != parts[1]:
        raise DataError("chat template renders a user turn's surroundings differently for different contents; "
                        "cannot find a fixed user-turn prefix")
    return parts[0]


def stop_token_ids(tokenizer: Any, end_of_turn: str) -> list[int]:
    """Token ids that end a sampled user turn: every special token, and the end-of-turn marker's first
    token when the marker starts with one (a user's text never contains a special token)."""
    ids = set(tokenizer.all_special_ids)
    marker = end_of_turn.strip()
    if marker:
        first = tokenizer(marker, add_special_tokens=False)["input_ids"][:1]
        added = {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()}
        if first and tokenizer.convert_ids_to_tokens(first[0]) in added:
            ids.add(first[0])
    return sorted(ids)


# ----------------------------------------------------------------------------------------------- filters
_WORD = re.compile(r"\w+", re.UNICODE)


def normalize(text: str) -> str:
    """Lower-case words joined by single spaces (punctuation and layout ignored): the dedup key."""
    return " ".join(_WORD.findall(text.lower()))


def ngrams(text: str, n: int) -> set[str]:
    """Word n-grams of the normalized text; a text shorter than n words is one gram (itself)."""
    words = normalize(text).split()
    if len(words) < n:
        return {" ".join(words)} if words else set()
    return {" ".join(words[i: i + n]) for i in range(len(words) - n + 1)}


class OverlapIndex:
    """Texts indexed by word n-grams, answering: what share of a query's n-grams does one indexed text hold?"""

    def __init__(self, n: int):
        self.n = n
        self.grams: list[set[str]] = []
        self.by_gram: dict[str, list[int]] = {}

    def add(self, text: str) -> None:
        g = ngrams(text, self.n)
        for gram in g:
            self.by_gram.setdefault(gram, []).append(len(self.grams))
        self.grams.append(g)

    def max_overlap(self, text: str, both_ways: bool = False) -> float:
        """max over indexed texts t of |G(q) & G(t)| / |G(q)| (and / |G(t)| too when `both_ways`: a query
        that contains a whole indexed text overlaps it fully)."""
        q = ngrams(text, self.n)
        if not q:
            return 0.0
        shared = Counter(i for gram in q for i in self.by_gram.get(gram, ()))
        best = 0.0
        for i, c in shared.items():
            best = max(best, c / len(q), c / len(self.grams[i]) if both_ways else 0.0)
        return best


def benchmark_index(n: int, files: tuple[Path, ...] = BENCHMARK_FILES) -> OverlapIndex:
    """Every user turn of the bundled benchmarks, indexed by word n-grams."""
    index = OverlapIndex(n)
    for path in files:
        records, _ = read_records(path)
        for rec in records:
            for m in rec.messages:
                if m["role"] == "user":
                    index.add(m["content"])
    return index


def clean(text: str, end_of_turn: str) -> str:
    """A sampled user turn made tidy: cut at a rendered end-of-turn marker, trailing spaces per line
    removed, runs of blank lines collapsed, outer whitespace stripped (inner layout such as code kept)."""
    marker = end_of_turn.strip()
    if marker and marker in text:
        text = text[: text.index(marker)]
    lines = [line.rstrip() for line in text.strip().splitlines()]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def join_opener(opener: str, text: str) -> str:
    """Opener + sampled continuation. The continuation comes back stripped, so the space its first token
    carried is restored unless it starts with punctuation ("How can I" + "fix it?" -> "How can I fix it?")."""
    if not opener or not text:
        return opener + text
    return opener + ("" if text[0] in ",.;:!?)'\"" else " ") + text


class PromptFilter:
    """The keep/drop decision, replayed in item order (so a resumed run decides exactly as before)."""

    def __init__(self, pcfg: PromptsConfig, bench: OverlapIndex):
        self.cfg = pcfg
        self.bench = bench
        self.kept = OverlapIndex(pcfg.ngram)
        self.seen: set[str] = set()

    def verdict(self, text: str, finished: bool) -> str:
        """'kept', or why not: 'short', 'unfinished', 'duplicate', 'benchmark'. A kept text is indexed."""
        key = normalize(text)
        if len(text) < self.cfg.min_chars or len(key.split()) < self.cfg.min_words:
            return "short"
        if not finished:
            return "unfinished"
        if key in self.seen or self.kept.max_overlap(text) >= self.cfg.max_dup_overlap:
            return "duplicate"
        if self.bench.max_overlap(text, both_ways=True) >= self.cfg.max_bench_overlap:
            return "benchmark"
        self.seen.add(key)
        self.kept.add(text)
        return "kept"


# ----------------------------------------------------------------------------------------------- generation
@dataclass
class Item:
    """One candidate prompt to sample: its index, domain, opener and sampling seed."""

    index: int
    domain: str
    opener: str
    seed: int
    request: str = ""  # context-carrying domains: the request that follows the passage
    passage: str | None = None  # a passage from the domain's file (None: the target samples one)


def make_item(pcfg: PromptsConfig, seed: int, index: int, passages: dict[str, list[str]] | None = None) -> Item:
    """Item `index`, drawn from a generator seeded by (seed, index) only: independent of chunking and resumes.

    `passages` maps a domain with a passages file to its passages (read_passages)."""
    digest = hashlib.sha256(f"prompts/{seed}/{index}".encode()).digest()
    rng = random.Random(digest)
    domain = rng.choices(pcfg.domains, weights=[d.weight for d in pcfg.domains])[0]
    opener = rng.choice(domain.openers) if domain.openers else ""
    item = Item(index, domain.name, opener, int.from_bytes(digest[8:16], "little") & (2**63 - 1))
    # drawn after the draws above, so domains without requests give the same items as before they existed
    if domain.requests:
        item.request = rng.choice(domain.requests)
        own = (passages or {}).get(domain.name)
        if own:
            item.passage = own[rng.randrange(len(own))]
    return item


def read_passages(pcfg: PromptsConfig) -> tuple[dict[str, list[str]], dict[int, str]]:
    """The passages of every domain that names a file (JSONL with a "text" per line, or plain text whose
    passages are separated by blank lines) by domain name, and the sha256 of the bytes they were read from by
    domain index (one read serves both, so the recorded digest is of what was used). DataError naming the key
    for a missing, unreadable or empty file."""
    out: dict[str, list[str]] = {}
    digests: dict[int, str] = {}
    for i, d in enumerate(pcfg.domains):
        if d.passages is None:
            continue
        key = f"prompts.domains[{i}].passages"
        path = Path(d.passages)
        try:
            data = path.read_bytes()
            raw = data.decode("utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise DataError(f"{key}: cannot read {path} ({type(e).__name__}: {e})") from None
        if path.suffix == ".jsonl":
            texts = []
            for lineno, line in enumerate(raw.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    texts.append(row["text"] if isinstance(row["text"], str) else None)
                except (json.JSONDecodeError, KeyError, TypeError):
                    texts.append(None)
                if texts[-1] is None:
                    raise DataError(f"{path}:{lineno}: not a passage (a JSON object with a string \"text\"), "
                                    f"read for {key}")
        else:
            texts = re.split(r"\n\s*\n", raw)
        texts = [t.strip() for t in texts if t.strip()]
        if not texts:
            raise DataError(f"{key}: {path} holds no passage")
        out[d.name] = texts
        digests[i] = hashlib.sha256(data).hexdigest()
    return out, digests


def trim_passage(text: str) -> str:
    """A passage cut off mid-sentence, trimmed after its last sentence end or line break ("" if none)."""
    ends = [text.rfind(c) for c in ".!?\n"]
    return text[: max(ends) + 1].strip() if max(ends) >= 0 else ""


def context_prompt(passage: str, request: str) -> str:
    """The user turn of a context-carrying domain: the passage, a blank line, the request; or, where the request
    holds `{passage}`, the request with the passage in its place ("Complete this function:\\n\\n{passage}")."""
    return request.replace("{passage}", passage) if "{passage}" in request else f"{passage}\n\n{request}"


def check_prompts_config(pcfg: PromptsConfig) -> None:
    """Refuse out-of-range prompts settings, naming the key."""
    checks = [
        (pcfg.num_prompts >= 1, "num_prompts must be >= 1"),
        (0.0 <= pcfg.mix_share < 1.0, "mix_share must be in [0, 1)"),
        (pcfg.batch_size >= 1 and pcfg.max_new_tokens >= 1, "batch_size and max_new_tokens must be >= 1"),
        (pcfg.temperature > 0, "temperature must be > 0 (greedy sampling writes the same prompt every time)"),
        (0 < pcfg.top_p <= 1, "top_p must be in (0, 1]"),
        (pcfg.ngram >= 1 and pcfg.min_chars >= 0 and pcfg.min_words >= 0, "ngram must be >= 1, min_chars and "
         "min_words >= 0"),
        (0 < pcfg.max_dup_overlap <= 1 and 0 < pcfg.max_bench_overlap <= 1,
         "max_dup_overlap and max_bench_overlap must be in (0, 1]"),
        (pcfg.max_candidates_factor >= 1, "max_candidates_factor must be >= 1"),
        (len(pcfg.domains) >= 1, "domains must list at least one domain"),
    ]
    for ok, msg in checks:
        if not ok:
            raise DataError(f"prompts.{msg}")
    names = [d.name for d in pcfg.domains]
    for i, d in enumerate(pcfg.domains):
        if not d.name or d.name in names[:i]:
            raise DataError(f"prompts.domains[{i}].name must be non-empty and unique, got {d.name!r}")
        if d.weight <= 0:
            raise DataError(f"prompts.domains[{i}].weight must be > 0, got {d.weight}")
        if d.passages is not None and not d.requests:
            raise DataError(f"prompts.domains[{i}].passages needs prompts.domains[{i}].requests (what to ask "
                            "about each passage)")
        if any(not r.strip() for r in d.requests):
            raise DataError(f"prompts.domains[{i}].requests must not hold an empty request")


@dataclass
class Tally:
    """Per-domain counts for the summary."""

    generated: int = 0
    dropped: Counter = field(default_factory=Counter)
    kept_chars: list[int] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        return {"generated": self.generated, "kept": len(self.kept_chars), "dropped": dict(self.dropped),
                "mean_chars": sum(self.kept_chars) / len(self.kept_chars) if self.kept_chars else 0.0}


def _settings(cfg: RunConfig, passage_digests: dict[int, str]) -> dict[str, Any]:
    """What decides the prompts (not batch_size: batching changes no sample; not num_prompts: a larger one
    extends the journal); passage_digests from read_passages."""
    p = to_dict(cfg.prompts)
    for k in ("batch_size", "num_prompts", "output"):
        p.pop(k)
    for i, d in enumerate(p["domains"]):
        # absent unless used, so a run written before context domains existed resumes; a passages file is
        # recorded by its bytes, so an edited file is not mixed into a resumed run
        if not d["requests"]:
            d.pop("requests")
        if d["passages"] is None:
            d.pop("passages")
        else:
            d["passages_sha256"] = passage_digests[i]
    return {"target": to_dict(cfg.target) | {"device": None}, "prompts": p, "seed": cfg.seed}


def _read_journal(path: Path) -> list[dict]:
    read_done(path)  # cuts a partial last line left by a kill
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()] if path.is_file() else []


def read_mix(pcfg: PromptsConfig, n_mix: int) -> list[dict]:
    """The first `n_mix` prompts (with a user turn) of prompts.mix_prompts, as prompt rows."""
    if not n_mix:
        return []
    if not pcfg.mix_prompts:
        raise DataError("prompts.mix_share > 0 needs prompts.mix_prompts (a prompt file)")
    records, _ = read_records(pcfg.mix_prompts, "auto", "train", n_mix)
    mix = [{"id": f"mix-{r.id}", "prompt": next(m["content"] for m in r.messages if m["role"] == "user"),
            "category": "mix"} for r in records if any(m["role"] == "user" for m in r.messages)]
    if len(mix) < n_mix:
        raise DataError(f"{pcfg.mix_prompts}: {len(mix)} prompts with a user turn, mix needs {n_mix}")
    return mix


def write_prompts(cfg: RunConfig, model: Any = None, tokenizer: Any = None) -> dict[str, Any]:
    """Run (or resume) prompt writing for `cfg`; returns the summary. Loads the target unless given one."""
    pcfg = cfg.prompts
    check_prompts_config(pcfg)
    n_mix = round(pcfg.num_prompts * pcfg.mix_share)
    n_self = pcfg.num_prompts - n_mix
    mix = read_mix(pcfg, n_mix)
    passages, passage_digests = read_passages(pcfg)
    if model is None or tokenizer is None:
        model, tokenizer = load_model(cfg.target, decode=True), load_tokenizer(cfg.target)
    template = cfg.data.chat_template
    heads = {d.name: user_turn_prefix(tokenizer, d.system, template) for d in pcfg.domains}
    end_of_turn = user_turn_prefix(tokenizer, None, template)[1]
    stops = stop_token_ids(tokenizer, end_of_turn)

    out_dir = Path(cfg.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out_dir)
    out_path = Path(pcfg.output) if Path(pcfg.output).is_absolute() else out_dir / pcfg.output
    out_path.parent.mkdir(parents=True, exist_ok=True)
    journal = out_path.with_suffix(".candidates.jsonl")
    done = _read_journal(journal)
    check_settings(out_path.with_suffix(".meta.json"), journal, _settings(cfg, passage_digests), journal.exists(), "prompts")

    filt = PromptFilter(pcfg, benchmark_index(pcfg.ngram))
    tally = {d.name: Tally() for d in pcfg.domains}
    kept: list[dict] = []

    def judge(rec: dict) -> None:
        t = tally[rec["domain"]]
        t.generated += 1
        why = filt.verdict(rec["text"], rec["finished"])
        if why == "kept":
            if len(kept) < n_self:
                kept.append({"id": rec["id"], "prompt": rec["text"], "category": rec["domain"]})
                t.kept_chars.append(len(rec["text"]))
        else:
            t.dropped[why] += 1

    for rec in done:
        judge(rec)
    resumed = len(done)
    limit = n_self * pcfg.max_candidates_factor
    index, tokens, start = len(done), 0, time.perf_counter()
    bar = tqdm(total=n_self, initial=len(kept), unit="prompt", desc="prompts", dynamic_ncols=True)
    with journal.open("a", encoding="utf-8") as f:
        while len(kept) < n_self and index < limit:
            # Chunks are fixed slices of the item order, so a resumed run samples the same rows together.
            end = min((index // pcfg.batch_size + 1) * pcfg.batch_size, limit)
            items = [make_item(pcfg, cfg.seed, i, passages) for i in range(index, end)]
            recs, n_tokens = _candidates(items, model, tokenizer, pcfg, heads, stops, end_of_turn)
            f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs))
            f.flush()
            os.fsync(f.fileno())
            before = len(kept)
            for rec in recs:
                judge(rec)
            bar.update(len(kept) - before)
            tokens += n_tokens
            index = end
    bar.close()
    seconds = time.perf_counter() - start
    if len(kept) < n_self:
        print(f"prompts: only {len(kept)} of {n_self} prompts kept after {limit} candidates "
              "(prompts.max_candidates_factor); writing those", file=sys.stderr)
    rows = kept + mix
    random.Random(f"prompts-order/{cfg.seed}").shuffle(rows)
    tmp = out_path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    tmp.replace(out_path)
    summary = {
        "output": str(out_path),
        "prompts": len(rows),
        "self_written": len(kept),
        "mixed": len(mix),
        "mix_prompts": pcfg.mix_prompts if mix else None,
        "candidates": index,
        "candidates_resumed": resumed,
        "generated_tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
        "domains": {name: t.summary() for name, t in tally.items()},
    }
    out_path.with_suffix(".summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _candidates(items: list[Item], model: Any, tokenizer: Any, pcfg: PromptsConfig, heads: dict[str, tuple[str, str]],
                stops: list[int], end_of_turn: str) -> tuple[list[dict], int]:
    """The journal records of one chunk of items (sampling the texts of those without a supplied passage)
    and the number of tokens sampled."""
    sampled = [it for it in items if it.passage is None]
    answers = generate_texts(model, tokenizer, [heads[it.domain][0] + it.opener for it in sampled],
                             pcfg.max_new_tokens, pcfg.temperature, pcfg.top_p, [it.seed for it in sampled],
                             stops) if sampled else []
    by_index = {it.index: a for it, a in zip(sampled, answers)}
    recs = []
    for it in items:
        if it.passage is not None:
            text, finished = it.passage, True
        else:
            a = by_index[it.index]
            text, finished = clean(join_opener(it.opener, a.text), end_of_turn), a.stopped
        if it.request:
            if not finished:  # a passage cut off at max_new_tokens is still a passage, once trimmed
                text = trim_passage(text)
                finished = bool(text)
            text = context_prompt(text, it.request) if text else ""
        recs.append({"id": f"p{it.index:06d}", "domain": it.domain, "finished": finished, "text": text})
    return recs, sum(a.tokens for a in answers)


def format_summary(s: dict[str, Any]) -> str:
    """The summary as a small table: one row per domain, then the mix and the totals."""
    lines = [f"{'domain':<14} {'generated':>9} {'kept':>5} {'dup':>4} {'bench':>5} {'short':>5} {'unfin':>5} "
             f"{'mean chars':>10}"]
    for name, d in s["domains"].items():
        dr = d["dropped"]
        lines.append(f"{name:<14} {d['generated']:>9} {d['kept']:>5} {dr.get('duplicate', 0):>4} "
                     f"{dr.get('benchmark', 0):>5} {dr.get('short', 0):>5} {dr.get('unfinished', 0):>5} "
                     f"{d['mean_chars']:>10.0f}")
    lines.append(f"prompts: {s['prompts']} in {s['output']} ({s['self_written']} self-written, {s['mixed']} from "
                 f"{s['mix_prompts'] or 'no mix'}) | {s['candidates']} candidates ({s['candidates_resumed']} from "
                 f"an earlier run) | {s['tokens_per_s']:.1f} tokens/s, {s['seconds']:.1f} s")
    return "\n".join(lines)


@cli_main
def main(argv: list[str] | None = None) -> None:
    run_cli("The target writes its own training prompts (user turns); writes a prompt JSONL.", write_prompts,
            format_summary, "prompts", "written candidates are saved", argv)


if __name__ == "__main__":
    main()
