"""Mutation check: plant each listed small bug, run the tests meant to catch it, revert, report caught/missed.

    .venv/bin/python scripts/check_mutants.py            # every mutant (about 15 minutes on 2 cores)
    .venv/bin/python scripts/check_mutants.py --quick    # a handful (a few minutes; CI runs this)
    .venv/bin/python scripts/check_mutants.py --only eos_after_accepted,crop_one_too_many
    .venv/bin/python scripts/check_mutants.py --list

Each mutant replaces one exact snippet of one source file (the snippet must occur exactly once, so a mutant
that no longer applies after a refactor is reported as an error instead of silently testing nothing), runs
pytest on its tests in a fresh process group (killed whole on timeout; a hang counts as caught, since the
suite's per-test timeout would fail it too), and restores the file's original bytes in a `finally`, so
Ctrl-C or an exception never leaves a planted bug behind. First the same tests run unmutated (the baseline):
a failing baseline would make every mutant look caught. Exit status: 0 when every mutant was caught, 1 when
one survived or did not apply, 2 on a bad command line.

Adding a mutant: append `Mutant(name, path, old, new, tests)` to MUTANTS: `old` occurs exactly once in
`path`, `new` is the realistic bug, `tests` the pytest arguments that must fail (keep them narrow: a file
and a `-k`); mark it `quick=True` only if it is cheap. Then run `--only NAME`: a mutant that survives means
a missing test, not a bad mutant.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # relative to the repository root
    old: str  # exact snippet, must occur once in the file
    new: str
    tests: tuple[str, ...]  # pytest node ids / -k expressions (as pytest arguments)
    quick: bool = False  # part of --quick (CI)


MUTANTS: list[Mutant] = [
    # --- export (convert/): SGLang reads layer ids one layer later than vLLM and the native heads
    Mutant("sglang_layer_ids_unshifted", "convert/eagle3.py",
           "ids = [i - 1 for i in served_layer_ids(meta, target)]",
           "ids = served_layer_ids(meta, target)",
           ("tests/test_export.py", "-k", "layer_id_conventions")),
    # --- the rows of issue 14's table
    Mutant("ttt_labels_at_t_plus_s", "heads/eagle/losses.py",
           "p_s, in_s, arg_s = shift_left(label, 1 + s), shift_left(in_vocab, 1 + s), shift_left(t_arg, 1 + s)",
           "p_s, in_s, arg_s = shift_left(label, s), shift_left(in_vocab, s), shift_left(t_arg, s)",
           ("tests/test_alignment.py",), quick=True),
    # head.pointer: the copy tokens at index t reach one position further, so step 0's own label is always copyable
    Mutant("pointer_set_one_position_late", "heads/eagle/losses.py",
           "return first[:, None, :] <= torch.arange(t, device=first.device)[None, :, None]",
           "return first[:, None, :] <= torch.arange(1, t + 1, device=first.device)[None, :, None]",
           ("tests/test_alignment.py", "-k", "pointer")),
    # the pointer's scores scaled by 1/H instead of 1/sqrt(H): training and drafting share it, the direct mixture doesn't
    Mutant("pointer_scores_mis_scaled", "heads/eagle/model.py",
           ".float() * keys.shape[-1] ** -0.5",
           ".float() * keys.shape[-1] ** -1.0",
           ("tests/test_alignment.py", "-k", "pointer")),
    # the pointer sees its own position's successor: the causal mask one position wide
    Mutant("pointer_sees_the_next_position", "heads/eagle/losses.py",
           "causal = torch.ones(t, t, dtype=torch.bool, device=ids.device).tril()[None]",
           "causal = torch.ones(t, t, dtype=torch.bool, device=ids.device).tril(1)[None]",
           ("tests/test_alignment.py", "-k", "pointer")),
    Mutant("ttt_labels_from_the_first_vocab_rows", "heads/eagle/losses.py",
           "return F.linear(last.to(w.dtype), w[draft_ids], None if bias is None else bias[draft_ids]).float()",
           "return F.linear(last.to(w.dtype), w[: draft_ids.numel()]).float()",
           ("tests/test_eagle.py", "-k", "full_logits_reference")),
    Mutant("stored_argmax_in_padded_order", "data/extract.py",
           "return x[keep], greedy_ids(model, feats.last[keep])",
           "return x[keep], greedy_ids(model, feats.last).flatten()[: int(keep.sum())]",
           ("tests/test_extract.py", "-k", "online_equals_offline")),
    Mutant("finished_rows_drop_the_wrong_cache_rows", "data/regenerate.py",
           "                kv.select(keep)",
           "                kv.select(torch.arange(len(keep)))",
           ("tests/test_regenerate.py", "-k", "finish_early")),
    Mutant("ttt_rope_not_advanced", "heads/eagle/losses.py",
           "cos, sin = rotary(target, hidden, _positions(b, t, s, ids.device))",
           "cos, sin = rotary(target, hidden, _positions(b, t, 0, ids.device))",
           ("tests/test_alignment.py",)),
    Mutant("eagle_tree_rows_one_position_late", "heads/eagle/drafting.py",
           "pos = torch.tensor([self.n - 1 + c.depth for c in nodes])",
           "pos = torch.tensor([self.n + c.depth for c in nodes])",
           ("tests/test_eagle.py", "-k", "chain_row_for_row")),
    # the padding of requests drafted together (heads.cache.pad_requests: EAGLE, DFlash and MTP alike)
    Mutant("together_sees_padded_keys", "heads/cache.py",
           "keys[i, :, :n], vals[i, :, :n], seen[i, :n] = p[0][0], p[1][0], True",
           "keys[i, :, :n], vals[i, :, :n], seen[i, :] = p[0][0], p[1][0], True",
           ("tests/test_eagle.py", "tests/test_dflash.py", "tests/test_mtp.py", "-k",
            "settling_together or drafting_together")),
    # grouped-query attention inside SDPA for verify passes (data.attention): the mask must reach SDPA
    Mutant("grouped_attention_drops_the_mask", "data/attention.py",
           "attn_mask=attention_mask, dropout_p=dropout,",
           "attn_mask=None, dropout_p=dropout,",
           ("tests/test_attention.py",), quick=True),
    # the policy's prior per depth (eval.costs.shrunk_rates): a deep rate judged twice must not be taken as is
    Mutant("prior_trusts_few_judgments", "eval/costs.py",
           "        out.append(a / j if not out else (a + pseudo * out[-1]) / (j + pseudo))",
           "        out.append(a / j)",
           ("tests/test_policy.py", "-k", "deep_rate"), quick=True),
    # the calibration must not measure the head on prompts it trained on (the quickstart mixes GSM8K train in)
    Mutant("calibration_on_training_prompts", "eval/calibrate.py",
           '/ "data" / "bundled" / "calibration_prompts.jsonl"',
           '/ "data" / "bundled" / "tiny_conversations.jsonl"',
           ("tests/test_eval.py", "-k", "calibration_prompts")),
    # a benchmark's earlier turns are the next turn's prior (eval.turns.Turns.pool)
    Mutant("prior_never_pooled", "eval/turns.py",
           "                                 pooled=self.pooled.get(name))",
           "                                 pooled=None)",
           ("tests/test_eval.py", "-k", "earlier_turns")),
    Mutant("kv_fork_shares_the_prefill", "data/kvcache.py",
           "        twin.cache = copy.deepcopy(self.cache)",
           "        twin.cache = self.cache",
           ("tests/test_batch.py", "-k", "shared_prefill")),
    Mutant("eagle_chain_reports_untempered_q", "heads/eagle/drafting.py",
           "        return tok, None if q is None else self._to_probs(q)",
           "        return tok, None if q is None else self._to_probs(torch.softmax(logits, dim=-1))",
           ("tests/test_sampling_drafters.py", "-k", "reported_q and eagle_chain"), quick=True),
    Mutant("draft_model_reports_untempered_q", "eval/drafters.py",
           "                probs.append(q)",
           "                probs.append(torch.softmax(logits.float(), dim=-1))",
           ("tests/test_sampling_drafters.py", "-k", "reported_q and (draft_model or self_spec)")),
    Mutant("verify_rows_without_top_p", "eval/decoder.py",
           "rows = logits if temperature <= 0 else target_distribution(logits, temperature, top_k, top_p)",
           "rows = logits if temperature <= 0 else target_distribution(logits, temperature, top_k)",
           ("tests/test_sampling_drafters.py", "-k", "top_p")),
    Mutant("tokens_after_eos_in_accepted_draft", "eval/decoder.py",
           "            return tokens[: i + 1], True",
           "            return tokens, True",
           ("tests/test_decoder.py", "-k", "eos"), quick=True),
    Mutant("target_cache_crop_one_too_many", "data/kvcache.py",
           "        cache.crop(-(n_new - len(keep)))",
           "        cache.crop(-(n_new - len(keep) + 1))",
           ("tests/test_decoder.py", "-k", "identical")),
    Mutant("target_cache_crop_one_too_few", "data/kvcache.py",
           "    if n_new > len(keep):\n        cache.crop(-(n_new - len(keep)))",
           "    if n_new > len(keep) + 1:\n        cache.crop(-(n_new - len(keep) - 1))",
           ("tests/test_decoder.py", "-k", "identical"), quick=True),
    Mutant("rejected_sibling_not_zeroed", "eval/decoder.py",
           "        r[token] = 0.0",
           "        r[token] = r[token]",
           ("tests/test_sampling_drafters.py", "-k", "eagle_tree or medusa"), quick=True),
    Mutant("bonus_dropped_when_nothing_drafted", "eval/decoder.py",
           "[draft_tokens[a] for a in accepted] + [nxt])",
           "[draft_tokens[a] for a in accepted] + ([nxt] if len(tree) else []))",
           ("tests/test_decoder.py", "-k", "ngram_drafter or every_drafter", "--timeout=20")),
    # --- more of the same kind
    Mutant("resample_from_p_after_rejection", "eval/decoder.py",
           "    return r / s if s > 0 else p",
           "    return p",
           ("tests/test_sampling_drafters.py", "-k", "mtp")),
    Mutant("accept_ignoring_q", "eval/decoder.py",
           "if u * (1.0 if q is None else float(q[x])) < float(p[x]):",
           "if u < float(p[x]):",
           ("tests/test_sampling_drafters.py", "-k", "draft_model")),
    Mutant("mtp_reports_untempered_q", "heads/mtp.py",
           "                probs.append(q)",
           "                probs.append(torch.softmax(logits, dim=-1))",
           ("tests/test_sampling_drafters.py", "-k", "reported_q and mtp")),
    Mutant("top_p_keeps_boundary_token", "data/sampling.py",
           "        procs.append(TopPLogitsWarper(top_p))",
           "        procs.append(TopPLogitsWarper(min(1.0, top_p + 1e-3)))",
           ("tests/test_decoder.py", "-k", "top_p")),
    Mutant("regeneration_ignores_top_p", "data/regenerate.py",
           "target_distribution(scores, self.temperature, top_p=self.top_p)",
           "target_distribution(scores, self.temperature)",
           ("tests/test_regenerate.py", "-k", "top_p")),
    # --- the training loop (issue 17: DataLoader, library schedule, checkpoint module)
    Mutant("loader_draws_global_rng", "train/batches.py",
           "                      generator=torch.Generator())",
           "                      generator=None)",
           ("tests/test_loop.py", "-k", "loader")),
    Mutant("resume_restarts_the_sampler", "train/loop.py",
           "batches = iter(train_loader(run.train_fs, run.plan, run.accelerator.process_index, run.start,",
           "batches = iter(train_loader(run.train_fs, run.plan, run.accelerator.process_index, 0,",
           ("tests/test_loop.py", "-k", "sigterm")),
    Mutant("resume_restarts_the_schedule", "train/loop.py",
           "scheduler = make_scheduler(adamw, cfg, plan.total_steps, start)",
           "scheduler = make_scheduler(adamw, cfg, plan.total_steps)",
           ("tests/test_bad_inputs.py", "-k", "changed_lr")),
    Mutant("tree_rows_see_siblings", "heads/cache.py",
           "    allowed[:, past:past + q] = ancestors",
           "    allowed[:, past:past + q] = True",
           ("tests/test_decoder.py", "-k", "trees")),
    Mutant("static_cache_keeps_tree_rows_ungathered", "data/kvcache.py",
           "        _gather(self.cache.layers, self.length, rows)",
           "        pass",
           ("tests/test_decoder.py", "-k", "static and trees")),
    Mutant("ttt_reads_features_not_own_output", "heads/eagle/losses.py",
           "        hidden = o  # the next step reads this step's PRE-norm output",
           "        hidden = hidden",
           ("tests/test_alignment.py",)),
    # --- issue 28's levers: the TV loss's 0.5 and q's normalisation; norm_before_residual reaching the residual
    Mutant("tv_without_its_half", "heads/losses.py",
           "tv = (mask * 0.5 * (p - logits.softmax(-1)).abs().sum(-1)).sum() / denom",
           "tv = (mask * (p - logits.softmax(-1)).abs().sum(-1)).sum() / denom",
           ("tests/test_losses.py",), quick=True),
    Mutant("tv_q_not_normalised", "heads/losses.py",
           "tv = (mask * 0.5 * (p - logits.softmax(-1)).abs().sum(-1)).sum() / denom",
           "tv = (mask * 0.5 * (p - logits.exp()).abs().sum(-1)).sum() / denom",
           ("tests/test_losses.py",)),
    # the same two for token labels (Medusa, MTP): q_gold unnormalised
    Mutant("hard_tv_q_not_normalised", "heads/losses.py",
           "tv = (1.0 - logits.softmax(-1).gather(-1, gold[:, None]).squeeze(-1)).mean()",
           "tv = (1.0 - logits.exp().gather(-1, gold[:, None]).squeeze(-1)).mean()",
           ("tests/test_losses.py", "-k", "hard_token_loss or medusa_and_mtp")),
    Mutant("norm_before_residual_ignored", "heads/eagle/model.py",
           "return q, k, v, normed if self.norm_before_residual else hidden",
           "return q, k, v, hidden",
           ("tests/test_eagle.py", "-k", "norm_before_residual")),
    Mutant("medusa_head_offset_t_plus_1_plus_i", "heads/medusa.py",
           "shifted = [shift_targets(ids, valid, 2 + i) for i in range(cfg.num_heads)]",
           "shifted = [shift_targets(ids, valid, 1 + i) for i in range(cfg.num_heads)]",
           ("tests/test_alignment.py",)),
    Mutant("mtp_label_offset_t_plus_k", "heads/mtp.py",
           "labels, m = shift_targets(ids, valid, 1 + k)",
           "labels, m = shift_targets(ids, valid, k)",
           ("tests/test_alignment.py",)),
    # --- issue 29: the classes of planted bugs that passed every test
    Mutant("spec_pass_drafts_past_max_new_tokens", "eval/decoder.py",
           "        budget = max_new_tokens - len(out) - 1",
           "        budget = max_new_tokens - len(out)",
           ("tests/test_faults.py", "-k", "max_new_tokens_budget"), quick=True),
    Mutant("accepted_credit_by_path_position", "eval/decoder.py",
           'src = tree.sources[a] if tree.sources is not None else "draft"',
           'src = tree.sources[accepted.index(a)] if tree.sources is not None else "draft"',
           ("tests/test_faults.py", "-k", "credit")),
    Mutant("policy_credit_by_path_position", "eval/policy.py",
           "while got < len(accepted) and s in tags[accepted[got]]:",
           "while got < len(accepted) and s in tags[got]:",
           ("tests/test_faults.py", "-k", "credit"), quick=True),
    Mutant("hybrid_budgets_to_the_wrong_proposer", "eval/drafters.py",
           'kh, kn = min(k, budgets.get("head", k)), min(k, budgets.get("ngram", k))',
           'kh, kn = min(k, budgets.get("ngram", k)), min(k, budgets.get("head", k))',
           ("tests/test_faults.py", "-k", "budgets")),
    Mutant("ttt_steps_weighted_in_reverse", "heads/eagle/losses.py",
           "total = total + head.ttt_decay**s * step_loss",
           "total = total + head.ttt_decay**(head.ttt_length - 1 - s) * step_loss",
           ("tests/test_faults.py", "-k", "ttt_weighting"), quick=True),
    Mutant("temperature_after_top_p", "data/sampling.py",
           "    if temperature != 1.0:\n        procs.append(TemperatureLogitsWarper(temperature))\n"
           "    if top_k > 0:\n        procs.append(TopKLogitsWarper(top_k))\n"
           "    if top_p < 1.0:\n        procs.append(TopPLogitsWarper(top_p))\n",
           "    if top_k > 0:\n        procs.append(TopKLogitsWarper(top_k))\n"
           "    if top_p < 1.0:\n        procs.append(TopPLogitsWarper(top_p))\n"
           "    if temperature != 1.0:\n        procs.append(TemperatureLogitsWarper(temperature))\n",
           ("tests/test_faults.py", "-k", "warper_order"), quick=True),
    Mutant("row_sampler_keyed_by_batch_slot", "data/regenerate.py",
           "generator=self.generators[r]) for j, r in enumerate(rows)",
           "generator=self.generators[j]) for j, r in enumerate(rows)",
           ("tests/test_regenerate.py", "-k", "finish_early or own_generator")),
    # (a constant shift of a row's positions is invisible under RoPE: these give rows another row's positions)
    # generation (data.regenerate) and the batch sweep (eval.batch) place their left-padded rows through the
    # one dynamic cache (data.kvcache.DynamicKV): every row's positions count its own real tokens
    Mutant("padded_rows_take_row_0s_positions", "data/kvcache.py",
           "pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1]:]",
           "pos = (mask[:1].cumsum(-1) - 1).clamp(min=0).expand_as(mask)[:, -ids.shape[1]:]",
           ("tests/test_faults.py", "tests/test_regenerate.py", "-k", "per_row_positions or batched_greedy")),
    # --- batched speculative decoding (eval.batch): ragged acceptance, per-row trees
    # the old rule, still exact: every row advances by the batch's minimum accepted length
    Mutant("batch_rows_truncated_to_the_minimum", "eval/batch.py",
           "        self.kv.keep_rows([v.path for v in verdicts])",
           "        m = min(len(v.path) for v in verdicts)\n"
           "        verdicts = [type(v)(v.accepted[:m - 1], v.tokens[m - 1], v.path[:m], v.tokens[:m]) for v in verdicts]\n"
           "        self.kv.keep_rows([v.path for v in verdicts])",
           ("tests/test_batch.py", "-k", "own_accepted_length"), quick=True),
    # the load-aware gate trusts its cost model: drafting passes that deliver less than priced keep drafting
    Mutant("load_aware_ignores_realised_rate", "eval/policy.py",
           "            if realised * score > best * (1 + 1e-9):",
           "            if score > best * (1 + 1e-9):",
           ("tests/test_batch.py", "-k", "deliver_less or slower_than_priced or full_pricing")),
    # the gate prices the target at the run's load and the drafters at calibration's: dear drafts pass under load
    Mutant("load_aware_drafting_unscaled_by_load", "eval/policy.py",
           "            score = e / (curve.scale * at_surface)",
           "            score = e / (at_surface - curve.fit(1 + w) + curve(1 + w))",
           ("tests/test_batch.py", "-k", "at_the_load")),
    # the gate's token ratio decays as fast as its seconds: a smaller size's last unlucky passes shut a new size
    Mutant("tokens_decayed_per_pass_like_time", "eval/policy.py",
           "        self._tokens = (self.token_decay * emitted + tokens, self.token_decay * total + expected)",
           "        self._tokens = (self.decay * emitted + tokens, self.decay * total + expected)",
           ("tests/test_batch.py", "-k", "unlucky")),
    # the single-stream policy drafts on any predicted gain, however small: its margin is ignored
    Mutant("policy_margin_ignored", "eval/policy.py",
           "        best, arg = self.margin, (0, 0)",
           "        best, arg = 1.0, (0, 0)",
           ("tests/test_policy.py", "-k", "margin"), quick=True),
    # the gate's skip bound prices a depth by its best proposer, not their sum: it skips batches that would pay
    Mutant("gate_bound_max_not_sum", "eval/policy.py",
           "                    per_depth[d] += reach\n",
           "                    per_depth[d] = max(per_depth[d], reach)\n",
           ("tests/test_batch.py", "-k", "gate_bound"), quick=True),
    # the sweep runs plain and the methods back to back again: a machine's drift decides their ratio
    Mutant("sweep_runs_back_to_back", "eval/batch.py",
           "        results = interleave_batches([run for _, run, _, _ in started])",
           "        results = [interleave_batches([run])[0] for _, run, _, _ in started]",
           ("tests/test_batch.py", "-k", "plain_speed_under_drift")),
    # a turn's methods run back to back again: a machine's drift decides the eval's speedups
    Mutant("turn_methods_back_to_back", "eval/turns.py",
           "        results = dict(zip(ours, interleave([self.steps(n, ids, temp, seed) for n in ours])))",
           "        results = {n: interleave([self.steps(n, ids, temp, seed)])[0] for n in ours}",
           ("tests/test_policy.py", "-k", "pass_interleaved")),
    # the gate prices every pass again after pricings that ended plain (a percent of a batch-1 pass each)
    Mutant("gate_never_backs_off", "eval/policy.py",
           "        self._backoff[b] = (min(2 ** (streak + 1) - 1, MAX_BACKOFF), streak + 1)",
           "        self._backoff[b] = (0, 0)",
           ("tests/test_batch.py", "-k", "backs_off")),
    # a larger batch size starts trusting the cost model again although a smaller one's drafting lost
    Mutant("realised_ignores_smaller_batches", "eval/policy.py",
           "        below = [b for b in seen if b < batch]",
           "        below = []",
           ("tests/test_batch.py", "-k", "deliver_less")),
    # the hybrid's n-gram priced as one average over its match orders (a 1-token match like a 3-token one)
    Mutant("ngram_priced_as_one_average", "eval/policy.py",
           "            self.key[s] = drafter.proposal_key(s) if hasattr(drafter, \"proposal_key\") else s",
           "            self.key[s] = s",
           ("tests/test_policy.py", "-k", "priced_by_its_match_order")),
    # a block drafter of 3 slots priced as an 8-token chain (the policy ignores heads.types.Drafter's max_depth)
    Mutant("policy_ignores_max_depth", "eval/policy.py",
           "            if deepest is not None:",
           "            if False:",
           ("tests/test_policy.py", "-k", "deeper_than_the_drafter")),
    # a dynamic tree priced at its learned nodes per depth, not at the nodes its drafter says it drafts
    Mutant("policy_ignores_declared_nodes", "eval/policy.py",
           "        count = self.declared.get(source)",
           "        count = None",
           ("tests/test_policy.py", "-k", "nodes_its_drafter")),
    # eval.tree auto: the free nodes counted with the root's row left out (one node too many on a skinny curve),
    # a tree chosen whatever its calibration predicts, and the chosen tree never reaching the turns
    Mutant("free_nodes_count_the_root", "eval/calibrate.py",
           "    while n < cap and fit(n + 2) <= (1.0 + tolerance) * fit(1):",
           "    while n < cap and fit(n + 1) <= (1.0 + tolerance) * fit(1):",
           ("tests/test_eval.py", "-k", "free_nodes")),
    Mutant("auto_tree_ignores_its_calibration", "eval/calibrate.py",
           "    wins = best_k > 0 and whole > max(chain[2], 1.0)",
           "    wins = best_k > 0",
           ("tests/test_eval.py", "-k", "calibration_prices_above")),
    # the draft vocabulary's share of the plain answers counting every token as inside
    Mutant("vocab_coverage_counts_every_token", "eval/tally.py",
           "        counts[0] += int(vocab[plain_ids.cpu()].sum())",
           "        counts[0] += plain_ids.numel()",
           ("tests/test_eval.py", "-k", "draft_vocab")),
    # eval.tree auto sizing the tree by the free nodes alone: on a rising curve no tree of the chain's k is tried
    Mutant("auto_tree_ignores_the_chain_k", "eval/calibrate.py",
           "    w = max(free, min(chain[1], cfg_eval.tree_tokens))",
           "    w = free",
           ("tests/test_eval.py", "-k", "calibration_prices_above")),
    Mutant("auto_tree_never_drafted", "eval/run.py",
           "    costs, subject = measure_costs(target, subject, cfg_eval, questions, log)",
           "    costs, _ = measure_costs(target, subject, cfg_eval, questions, log)",
           ("tests/test_eval.py", "-k", "reaches_the_turns")),
    # EAGLE-2's tree leaves unexpanded a node that could still make the selection (the cutoff two nodes early)
    Mutant("dynamic_tree_prunes_live_nodes", "heads/tree.py",
           "        return sorted((c.score for c in self.nodes), reverse=True)[total - 1]",
           "        return sorted((c.score for c in self.nodes), reverse=True)[max(total - 3, 0)]",
           ("tests/test_eagle.py", "-k", "cannot_make_the_selection")),
    # a skinny layer pads its rows for a cheaper product and keeps the padding's rows instead of its own
    Mutant("skinny_keeps_padding_rows", "data/packed.py",
           "        y = _kernel(kernel, flat, self.weight, self._wt)[:rows].contiguous()",
           "        y = _kernel(kernel, flat, self.weight, self._wt)[-rows:].contiguous()",
           ("tests/test_packed.py", "-k", "every_skinny"), quick=True),
    # skinny's plan never pads: three rows through W x^T cost twice four on the AMD EPYC
    Mutant("skinny_plan_never_pads", "data/packed.py",
           "    return {m: min(((k, c) for c in range(m, rows + 1) for k in SKINNY_KERNELS), key=median.__getitem__)",
           "    return {m: min(((k, c) for c in (m,) for k in SKINNY_KERNELS), key=median.__getitem__)",
           ("tests/test_packed.py", "-k", "plan_rows")),
    # the chain of held-out hits started from the second step's positions instead of the first's
    Mutant("chain_started_at_step_one", "heads/eagle/losses.py",
           "    metrics.update(chain_metrics(hits, step_alignment(ids, lmask, 0)[1]))",
           "    metrics.update(chain_metrics(hits, step_alignment(ids, lmask, 1)[1]))",
           ("tests/test_alignment.py", "-k", "chain")),
    # a drafter kept from drafting still pays its begin (a head forward over the prompt)
    Mutant("deferred_sync_begins_at_once", "eval/drafters.py",
           "        self._begin, self._device = (prompt_ids, features, int(next_token)), prompt_ids.device",
           "        self._begin, self._device = None, prompt_ids.device\n        self.inner.begin(prompt_ids, features, next_token)",
           ("tests/test_batch.py", "-k", "never_calls_the_drafter")),
    # deferred commits keep views of the pass's output buffers, which a CUDA graph's next replay overwrites
    Mutant("deferred_log_keeps_views", "eval/drafters.py",
           "        self.pending.append(Features(last=f.last.clone(), aux=None if f.aux is None else f.aux.clone()))",
           "        self.pending.append(f)",
           ("tests/test_batch.py", "-k", "buffers_are_reused")),
    # the single-stream policy keeps pricing drafts at the calibration's cost whatever they are seen to take
    Mutant("drafting_cost_never_learned", "eval/policy.py",
           "        return self.costs[source](nodes) * self.draft_scale(source) * self.shared.get(source, 1.0) if nodes else 0.0",
           "        return self.costs[source](nodes) * self.shared.get(source, 1.0) if nodes else 0.0",
           ("tests/test_policy.py", "-k", "seen_to_cost")),
    # the block drafter's anchor feature trained from the anchor's own position, which drafting never has
    Mutant("dflash_anchor_feature_off_by_one", "heads/dflash/losses.py",
           "        before = c.gather(1, (anchors - 1)[..., None].expand(-1, -1, c.shape[-1]))\n",
           "        before = c.gather(1, anchors[..., None].expand(-1, -1, c.shape[-1]))\n",
           ("tests/test_dflash.py", "-k", "training_blocks_equal_drafting_blocks")),
    # a compact Markov table exported as is: DSpark's layout reads row t for target id t
    Mutant("dspark_compact_table_exported_as_is", "convert/dflash.py",
           "    state[key] = state[key][head.markov_row(torch.arange(target.vocab_size, device=head.t2d.device)).cpu()]"
           ".contiguous()\n",
           "",
           ("tests/test_dflash.py", "-k", "compact")),
    # a deferred catch-up (the prompt's begin, skipped passes' commits), paid once, priced into every later draft
    Mutant("catch_up_priced_as_drafting", "eval/decoder.py",
           "            drafting -= drafter.take_catch_up()\n",
           "            drafter.take_catch_up()\n",
           ("tests/test_policy.py", "-k", "deferred_catch_up")),
    # the forward time taken from the pass's start: the policy's choice and the draft counted as the target's
    Mutant("forward_time_from_the_pass_start", "eval/decoder.py",
           "        stats.forward_time_s += perf() - tv\n",
           "        stats.forward_time_s += perf() - td\n",
           ("tests/test_policy.py", "-k", "drafters_own_seconds")),
    # interleaved runs in one fixed cycle: a run always follows the same other run, and pays what that one leaves
    Mutant("interleave_in_a_fixed_cycle", "eval/decoder.py",
           "        rng.shuffle(order)\n",
           "",
           ("tests/test_decoder.py", "-k", "always_follows")),
    # a row's share of the batch pass carries the load factor its drafting seconds do not: a fast target
    # makes every draft look dearer than its pass
    Mutant("row_share_priced_at_the_load", "eval/policy.py",
           "        return self.learned.fit(n) / self.batch",
           "        return self.learned(n) / self.batch",
           ("tests/test_batch.py", "-k", "surface_level_whatever_the_load or drafts_on_a_flat_surface")),
    # a drafting pass timed against its price at the load factor it was priced at (1.0 before its size was
    # timed), which the learned factor then counts again: the size stops drafting for good
    Mutant("drafting_pass_timed_at_the_load_it_was_priced_at", "eval/policy.py",
           "        priced = surface_seconds * self.curve(batch).scale",
           "        priced = surface_seconds",
           ("tests/test_batch.py", "-k", "timed_against_its_price")),
    # a batch size not yet timed priced at the calibration's level, whatever load the other sizes show
    Mutant("untimed_size_priced_at_the_calibration_level", "eval/policy.py",
           "load=self.curves[near].scale if near is not None else None)",
           "load=None)",
           ("tests/test_batch.py", "-k", "nearest_timed_sizes_load")),
    # the load-aware policy's extra rounds are skipped: two rounds cannot resolve its 2% bound
    Mutant("load_aware_rounds_not_extended", "eval/batch.py",
           "    for rep in range(max(repeats, load_aware_repeats)):",
           "    for rep in range(repeats):",
           ("tests/test_batch.py", "-k", "extra_rounds")),
    Mutant("batch_runs_in_a_fixed_cycle", "eval/batch.py",
           "        for i in next(orders):\n            if not runs[i].done:",
           "        for i in range(len(runs)):\n            if not runs[i].done:",
           ("tests/test_batch.py", "-k", "always_follows")),
    Mutant("ragged_keep_leaks_a_rejected_slot", "data/kvcache.py",
           "            kept[r, :len(p)] = 1",
           "            kept[r, :len(p) + 1] = 1",
           ("tests/test_batch.py", "-k", "greedy_identical"), quick=True),
    Mutant("padded_tree_rows_at_depth_one", "data/kvcache.py",
           "            pos[r, 1:] += depths.to(self.device)",
           "            pos[r, 1:] += 1",
           ("tests/test_batch.py", "-k", "padded_trees"), quick=True),
    # --- DFlash (heads/dflash): the block mask and its alignment
    Mutant("dflash_block_sees_its_anchor_context", "heads/dflash/losses.py",
           "[None, None, :] < q_anchor[..., None]", "[None, None, :] <= q_anchor[..., None]",
           ("tests/test_dflash.py", "-k", "direct_computation or drafting_blocks"), quick=True),
    Mutant("dflash_block_causal_inside", "heads/dflash/model.py",
           "    t = ctx[0].shape[2]\n",
           "    s_blk = s_blk.masked_fill(torch.ones(block_size, block_size, dtype=torch.bool).triu(1), float('-inf'))\n"
           "    t = ctx[0].shape[2]\n",
           ("tests/test_dflash.py", "-k", "direct_computation or drafting_blocks")),
    Mutant("dflash_labels_shifted_by_one", "heads/dflash/losses.py",
           "return slots, slots - first", "return slots, slots - first + 1",
           ("tests/test_dflash.py", "-k", "direct_computation")),
    # --- DSpark's layout and Markov head (heads/dflash, sample_from_anchor / markov_rank)
    Mutant("dflash_anchor_slot_never_drafts", "heads/dflash/losses.py",
           "mask_tok[..., :first] = 0", "mask_tok[..., :1] = 0",
           ("tests/test_dflash.py", "-k", "direct_computation")),
    # (the Markov bias and head.prev_mlp read the same previous token: both variants are in the direct test)
    Mutant("dflash_markov_bias_reads_the_predicted_token", "heads/dflash/losses.py",
           "prev = ids.gather(1, labels.clamp(0, t - 1)", "prev = ids.gather(1, (labels + 1).clamp(0, t - 1)",
           ("tests/test_dflash.py", "-k", "direct_computation or drafting_blocks"), quick=True),
    Mutant("dflash_markov_chain_fed_a_stale_token", "heads/dflash/drafting.py",
           "                    prev[r] = tree.tokens[0]\n", "",
           ("tests/test_dflash.py", "-k", "sequential_chain")),
    # head.plain_first_slot: the first drafting slot's logits are its LM head's alone, in training and drafting alike
    Mutant("dflash_plain_first_slot_drafted_sequential", "heads/dflash/drafting.py",
           "            if head.plain(head.first_slot + i):\n", "            if False:\n",
           ("tests/test_dflash.py", "-k", "sequential_chain and shipped")),
    Mutant("dflash_plain_first_slot_trained_sequential", "heads/dflash/model.py",
           "        plain = [self.plain(s) for s in slots]\n", "        plain = [False for s in slots]\n",
           ("tests/test_dflash.py", "-k", "direct_computation and shipped")),
    # a trained draft-vocab LM head (head.train_lm_head) must be exported as trained, and trained at all
    Mutant("dflash_export_writes_the_targets_lm_head_rows", "convert/dflash.py",
           "    state = head_state(head)\n    # the layout's table",
           "    state = head_state(head) | {\"lm_head.weight\": target.lm_head.weight.detach()[head.draft_ids()].cpu()}\n"
           "    # the layout's table",
           ("tests/test_dflash.py", "-k", "round_trip_is_identical or reference_forward_on_the_exported")),
    Mutant("dflash_lm_head_never_trains", "heads/dflash/model.py",
           "requires_grad_(cfg.train_lm_head)", "requires_grad_(False)",
           ("tests/test_dflash.py", "-k", "overfit or prepare_takes")),
    Mutant("dflash_settle_at_the_first_requests_positions", "heads/dflash/drafting.py",
           "pos = torch.cat([torch.arange(d.n, d.n + m) for d, m in zip(rows, lens)])",
           "pos = torch.cat([torch.arange(first.n, first.n + m) for d, m in zip(rows, lens)])",
           ("tests/test_dflash.py", "-k", "settling_together")),
    Mutant("no_exploration", "eval/policy.py",
           "            if not any(choice.values()):\n                choice = self.explore(sources, limit, unknown)\n", "",
           ("tests/test_policy.py", "-k", "chance_rejections")),
    Mutant("ngram_explored_one_token", "eval/policy.py",
           "choice = self.explore(sources, limit, unknown)", "choice = self.explore(sources, limit, sources)",
           ("tests/test_policy.py", "-k", "not_explored_one_token")),
    Mutant("load_aware_prices_rows_drafting_alone", "eval/policy.py",
           "            policy.use_draft_share(drafts)\n", "",
           ("tests/test_batch.py", "-k", "draft_share")),
    Mutant("medusa_together_reads_the_first_row", "heads/medusa.py",
           "d._build(tree, logits[:tree.depth, r], temperature)",
           "d._build(tree, logits[:tree.depth, 0], temperature)",
           ("tests/test_batch.py", "-k", "mtp_heads_draft_together and medusa")),
    # --- eval.draft_dtype (eval.costs.place_head)
    # auto keeps bfloat16 whatever the timing says: a CPU without native bfloat16 would draft slower
    Mutant("auto_draft_dtype_ignores_the_timing", "eval/costs.py",
           "dtype = torch.bfloat16 if half < (1 - AUTO_DTYPE_MARGIN) * full else target_dtype",
           "dtype = torch.bfloat16",
           ("tests/test_eval.py", "-k", "place_head")),
    # neighbouring passes of two sizes never teach T(n) / T(1): the probe's shape stands whatever the run times
    Mutant("verify_shape_never_learned", "eval/policy.py",
           "if last is not None and last[0] != n and min(seconds, last[1]) > 0:", "if False:",
           ("tests/test_policy.py", "-k", "drifts or teach_the_verify_curve")),
    # a bfloat16 head's wide inputs (its begin over the prompt, catch-ups) through its bfloat16 weights after
    # all: 4x slower than float32 on a CPU without native bfloat16
    Mutant("wide_rows_run_in_bfloat16", "eval/costs.py",
           "if x.numel() >= self.wide_rows * x.shape[-1]:", "if False:",
           ("tests/test_eval.py", "-k", "wide_rows")),
    # EAGLE-1's logits through the target's lm_head in the head's dtype: a bfloat16 head cannot draft
    Mutant("eagle1_logits_in_the_heads_dtype", "heads/eagle/model.py",
           "return target.lm_head(o.to(target.lm_head.weight.dtype))", "return target.lm_head(o)",
           ("tests/test_heads.py", "-k", "bfloat16")),
    # the policy's plain bound under-counts E: a pass is left plain where a deeper draft pays
    Mutant("plain_bound_from_the_first_depth", "eval/policy.py",
           "e_max = 1.0 + sum(ra[:la_max])", "e_max = 1.0 + sum(ra[:1])",
           ("tests/test_policy.py", "-k", "plain_bound")),
]


def run_pytest(args: tuple[str, ...], timeout: float) -> tuple[str, float]:
    """Run pytest on `args` in its own process group: ('pass' | 'fail' | 'timeout' | 'error', seconds)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *args]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return "timeout", time.perf_counter() - t0
    except BaseException:  # Ctrl-C: the child group must not outlive us (the caller restores the file)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    dt = time.perf_counter() - t0
    # pytest: 0 all passed, 1 some failed; 2-5 mean interrupted / internal / usage error / nothing collected.
    if proc.returncode == 0:
        return "pass", dt
    if proc.returncode == 1:
        return "fail", dt
    tail = out.decode(errors="replace").strip().splitlines()[-3:]
    print(f"  pytest exit {proc.returncode}: {' | '.join(tail)}", file=sys.stderr)
    return "error", dt


def baseline_runs(mutants: list[Mutant]) -> list[tuple[str, ...]]:
    """One pytest run per test file covering what the mutants select there: the whole file if one of them
    takes it whole, else its -k expressions or-ed together."""
    by_file: dict[str, set[str] | None] = {}
    for m in mutants:
        path = m.tests[0]
        k = m.tests[m.tests.index("-k") + 1] if "-k" in m.tests else None
        if k is None or by_file.get(path, set()) is None:
            by_file[path] = None
        else:
            by_file.setdefault(path, set()).add(k)
    return [(path,) if ks is None else (path, "-k", " or ".join(f"({k})" for k in sorted(ks)))
            for path, ks in sorted(by_file.items())]


def snippet_count(m: Mutant) -> int:
    """How often `m`'s snippet occurs in its file: it is planted only when exactly once (tests/test_faults.py
    checks every mutant's in the default suite)."""
    return (ROOT / m.path).read_text().count(m.old)


def check(m: Mutant, timeout: float) -> tuple[str, float]:
    """Plant `m`, run its tests, restore the file: ('caught' | 'MISSED' | 'ERROR: ...', seconds)."""
    n = snippet_count(m)
    if n != 1:
        return f"ERROR: snippet found {n} times in {m.path}", 0.0
    path = ROOT / m.path
    original = path.read_bytes()
    text = original.decode()
    try:
        path.write_text(text.replace(m.old, m.new))
        outcome, dt = run_pytest(m.tests, timeout)
    finally:
        path.write_bytes(original)
    return {"fail": "caught", "timeout": "caught", "pass": "MISSED"}.get(outcome, "ERROR: tests did not run"), dt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="only the mutants marked quick (CI)")
    ap.add_argument("--only", default="", help="comma-separated mutant names")
    ap.add_argument("--list", action="store_true", help="print the mutants and exit")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per pytest run (default 300)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of the same tests")
    a = ap.parse_args(argv)
    chosen = [m for m in MUTANTS if m.quick] if a.quick else list(MUTANTS)
    if a.only:
        names = {m.name for m in MUTANTS}
        wanted = [w for w in a.only.split(",") if w]
        unknown = [w for w in wanted if w not in names]
        if unknown:
            print(f"error: --only: unknown mutant(s) {', '.join(unknown)} (see --list)", file=sys.stderr)
            return 2
        chosen = [m for m in MUTANTS if m.name in wanted]
    if a.list:
        for m in chosen:
            print(f"{m.name:38s} {m.path:20s} {' '.join(m.tests)}{'  [quick]' if m.quick else ''}")
        return 0
    if not a.no_baseline:
        for args in baseline_runs(chosen):
            outcome, dt = run_pytest(args, a.timeout * 2)
            print(f"baseline (unmutated) {' '.join(args)}: {outcome} ({dt:.0f} s)", flush=True)
            if outcome != "pass":
                print("error: the unmutated tests do not pass; fix them before judging mutants", file=sys.stderr)
                return 1
    rows = []
    for m in chosen:
        status, dt = check(m, a.timeout)
        rows.append((m, status, dt))
        print(f"  {m.name}: {status} ({dt:.0f} s)", flush=True)
    print(f"\n{'mutant':38s} {'file':20s} {'result':8s} {'s':>5s}  tests")
    for m, status, dt in rows:
        print(f"{m.name:38s} {m.path:20s} {status:8s} {dt:5.0f}  {' '.join(m.tests)}")
    bad = [m.name for m, status, _ in rows if status != "caught"]
    print(f"\n{len(rows) - len(bad)}/{len(rows)} caught" + (f"; not caught: {', '.join(bad)}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
