"""Where a speculative round's time goes, round by round, on fresh and then warm shapes.

    python bench/round_trace.py [--synthetic-target llama-8b] [--tau 6.5] [--prompt-lengths 1019,2801] [--adaptive]

Runs ``mlx-spec bench`` (benchmarks/core.py: the same target, drafter, cache policy, kernels,
compiled forwards, pre-warming and regimes) with its speculative methods' host plugin replaced by a
traced one: the plugin's hooks, whose decode step is the plugin's round (plugin/round.py) with the
device synchronised between phases (prepare: the drafter catching up on committed positions, the
first round's whole prompt included; draft; cache-transaction begin; graph build; target forward;
log-probabilities; accept; ahead: the drafter's next block from the device's outcome, where it drafts
ahead, which a round overlaps with its commit and the next verify's build; target commit; finish: the
drafter's commit and the stats; emit), so each phase's time is its own. Synchronising adds a little to
every round; use it to find costs, not to quote speed-ups.
Prints, per regime and prompt, the first round's phases (where the drafter builds the prompt's
context), the other rounds' per-phase medians and means (the bench's draft and verify per round are
means over every round) and the rounds far above the median; with ``--adaptive`` (block size and
pauses by the controller) every round, with the context positions the drafter caught up on and the
plain steps before it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_speculative.drafters.base import Proposal  # noqa: E402
from mlx_speculative.hooks.batch import DecodeBatch, replay  # noqa: E402
from mlx_speculative.hooks.prompt_cache import arrays  # noqa: E402
from mlx_speculative.hooks.specs import hookimpl  # noqa: E402
from mlx_speculative.hooks.state import DecodeState, GeneratedToken, StepOutput  # noqa: E402
from mlx_speculative.hooks.transaction import CacheTransaction  # noqa: E402
from mlx_speculative.plugin import commit, hookimpls  # noqa: E402
from mlx_speculative.plugin import round as rnd  # noqa: E402
from mlx_speculative.plugin.accept import RoundPlans  # noqa: E402
from mlx_speculative.benchmarks import core  # noqa: E402
from mlx_speculative.plugin.draft import as_ints, draft  # noqa: E402
from mlx_speculative.plugin.draft_ahead import draft_ahead  # noqa: E402
from mlx_speculative.plugin.metrics import Laps  # noqa: E402
from mlx_speculative.plugin.verify import verify  # noqa: E402

TRACE: List[Dict[str, Any]] = []
LABEL = [""]  # the bench's progress line of the run in progress ("fresh 3/8 plugin dflash b16 tau6.5 prompt 2049")
PHASES = ("prepare", "draft", "begin", "build", "forward", "accept", "ahead", "commit", "emit", "finish")


def _keys(batch: DecodeBatch) -> int:
    offset = batch.cache[0].offset  # an int, or per-row offsets [B] of a batched cache
    return int(offset) if isinstance(offset, int) else int(mx.max(offset).item())


def _context(br: rnd.BatchRounds) -> Optional[int]:
    inner = getattr(br.draft, "inner", br.draft)  # the oracle's wrapper around the drafter's batch
    context = getattr(inner, "context", None)  # DFlash: positions in each row's context cache
    return sum(context) if context is not None else None


def traced_step(batch: DecodeBatch, att: Any) -> Optional[List[StepOutput]]:
    """``plugin.round.step``, its round traced (``traced_round``)."""
    rows = list(batch.rows)
    reqs = [rnd.row_rounds(r, att) for r in rows]
    on = [b for b, req in enumerate(reqs) if req is not None]
    if not on:
        return None
    br = batch.extras.get(rnd.NAME)
    if br is None:
        br = batch.extras[rnd.NAME] = rnd.BatchRounds(att.drafter.new_batch())
    on_rows, on_reqs = [rows[b] for b in on], [reqs[b] for b in on]
    rnd._observe(on_rows, on_reqs)
    br.draft.sync(on_rows)
    plans = [rnd._plan(r, q, br.draft) for r, q in zip(on_rows, on_reqs)]
    if not any(plans):
        outs = [StepOutput([], None) for _ in rows]
        for b, row, req in zip(on, on_rows, on_reqs):
            outs[b].plain_steps = rnd._grant(row, req, False)
            req.expected = row.generated
        return outs
    return traced_round(batch, att, br, rows, on, plans)


def traced_round(batch: DecodeBatch, att: Any, br: rnd.BatchRounds, rows: List[DecodeState], on: List[int],
                 plans: List[Optional[int]]) -> List[StepOutput]:
    """``plugin.round._round`` with a synchronisation and a time stamp after each phase (no fallbacks:
    a failure is raised)."""
    reqs = [rows[b].extras[rnd.NAME] for b in on]
    on_rows = [rows[b] for b in on]
    vocab = int(rows[0].pending_logprobs.shape[-1]) if rows[0].pending_logprobs is not None else 0
    row: Dict[str, Any] = {"keys": _keys(batch), "plain_before": reqs[0].controller.plain_steps}
    context = _context(br)
    mx.synchronize()
    mark = [time.perf_counter()]

    def phase(name: str, sync: bool = True) -> None:
        if sync:
            mx.synchronize()
        now = time.perf_counter()
        row[name] = (now - mark[0]) * 1e3
        mark[0] = now

    t0 = mark[0]
    br.draft.prepare(on_rows)  # draft() prepares again: nothing is left to catch up on
    inner = getattr(br.draft, "inner", br.draft)
    mx.eval(arrays(getattr(inner, "cache", None) or []))  # DFlash's context appends are lazy until drafted
    phase("prepare")
    lazy = att.lazy_drafts and not any(r.logits_processors for r in rows)
    drafted = draft(br.draft, on_rows, [k or 0 for k in plans], vocab, lazy)
    phase("draft")
    after = _context(br)
    row["context"] = after - context if after is not None and context is not None else None
    t1 = mark[0]
    proposals: List[Proposal] = [Proposal([]) for _ in rows]
    for b, p in zip(on, drafted.proposals):
        proposals[b] = p
    width_for = batch.target.cache_policy.verify_width
    fed: List[Any] = []
    target = CacheTransaction(batch.cache, replay=lambda n: replay(batch.target.model, batch.cache, fed[0], n))
    target.begin()
    phase("begin")
    logits, captured, inputs = verify(batch, [p.tokens for p in proposals], vocab, width_for)  # [B, W, V]
    fed.append(inputs)
    phase("build", sync=False)  # the graph was only built
    mx.eval(logits)
    phase("forward")
    proposals = as_ints(proposals, vocab)
    accepting = RoundPlans(rows, proposals, logits, inputs, att.settings.acceptance)
    ahead = att.ahead and lazy and br.draft.drafts_ahead(on_rows)
    unread = accepting.unread() if ahead else None
    mx.eval(accepting.arrays, unread)
    phase("accept")
    if ahead:  # in a round this runs on the device while the host commits, emits and builds the next verify
        error = draft_ahead(br.draft, rows, on, [len(proposals[b].tokens) for b in on], unread, captured)
        if error is not None:
            raise error
    phase("ahead")
    outcomes = accepting.read(proposals)
    outcomes = commit.fit(target, outcomes, inputs.shape[1])
    commit.commit_target(target, outcomes, inputs.shape[1])
    phase("commit")
    t2 = mark[0]
    commit.commit_drafter(br.draft, drafted, on_rows, commit.verified(outcomes, captured, att.drafter.capture_layers(), on))
    lap = Laps()  # the round's own laps, by the phases above (synchronised, unlike the round's)
    lap.seconds = {"draft": t1 - t0, "verify": t2 - t1, "commit_drafter": time.perf_counter() - t2}
    rnd.record(rows, on, reqs, plans, outcomes, lap, int(inputs.shape[1]))
    phase("finish")
    out = [StepOutput([GeneratedToken(t, accepting.logprob(b, i)) for i, t in enumerate(o.tokens)])
           for b, o in enumerate(outcomes)]
    phase("emit")
    o = outcomes[on[0]]
    row.update(width=int(inputs.shape[1]), drafts=o.draft_tokens, accepted=o.accepted)
    row["label"] = LABEL[0]
    TRACE.append(row)
    return out


class TracedPlugin:
    """The speculative plugin's hooks, with ``traced_step`` as its decode step."""

    @hookimpl
    def host_cache_policy(self, target: Any) -> Any:
        return hookimpls.host_cache_policy(target)

    @hookimpl
    def host_prefill_captures(self, target: Any, state: DecodeState) -> Any:
        return hookimpls.host_prefill_captures(target, state)

    @hookimpl
    def host_decode_step(self, batch: DecodeBatch) -> Optional[List[StepOutput]]:
        att = hookimpls._attached(batch.target)
        return traced_step(batch, att) if att is not None else None

    @hookimpl
    def host_request_finished(self, state: DecodeState, discarded: int) -> None:
        hookimpls.host_request_finished(state, discarded)


def summarise(label: str, rows: List[Dict[str, Any]], every: bool = False) -> Dict[str, Any]:
    first, rest = rows[0], rows[1:] or rows
    med = {p: round(statistics.median(r[p] for r in rest), 3) for p in PHASES}
    mean = {p: round(statistics.fmean(r[p] for r in rows), 3) for p in PHASES}
    totals = [sum(r[p] for p in PHASES) for r in rows]
    m = statistics.median(totals[1:] or totals)
    slow = [dict(i=i, total=round(t, 1), **{p: round(rows[i][p], 1) for p in PHASES}, keys=rows[i]["keys"],
                 width=rows[i]["width"], drafts=rows[i]["drafts"]) for i, t in enumerate(totals) if i and t > 1.5 * m + 2]
    print(f"{label}: {len(rows)} rounds, sum {sum(totals):.0f} ms; first round {totals[0]:.1f} ms ("
          + " ".join(f"{p} {first[p]:.2f}" for p in PHASES if first[p] >= 0.05) + f", context {first['context']})", flush=True)
    print(f"   other rounds: median {m:.2f} ms; medians " + " ".join(f"{p} {med[p]:.2f}" for p in PHASES), flush=True)
    print("   means over every round " + " ".join(f"{p} {mean[p]:.2f}" for p in PHASES), flush=True)
    for s in slow[:12]:
        print(f"   slow round {s}", flush=True)
    if every:
        for i, (r, t) in enumerate(zip(rows, totals)):
            print(f"   round {i}: {t:.1f} ms prepare {r['prepare']:.1f} draft {r['draft']:.1f} forward {r['forward']:.1f} "
                  f"width {r['width']} accepted {r['accepted']}/{r['drafts']} context {r['context']} "
                  f"after {r['plain_before']} plain steps", flush=True)
    return {"label": label, "rounds": len(rows), "first_round_ms": round(totals[0], 3), "first_round": first,
            "median_round_ms": round(m, 3), "sum_ms": round(sum(totals), 1), "median_ms": med, "mean_ms": mean,
            "slow": slow, "rows": rows if every else None}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--synthetic-target", default="llama-8b")
    parser.add_argument("--tau", type=float, default=6.5)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--prompt-lengths", default="1019,2801", help="the bench's base prompt lengths")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--adaptive", action="store_true", help="adaptive block size and pauses (every round printed)")
    parser.add_argument("--kernel", default="auto", choices=["auto", "on", "off"], help="the bench's --kernel")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    s = core.BenchSettings(synthetic_target=args.synthetic_target, kind="dflash", block_sizes=[args.block],
                           taus=[] if args.adaptive else [args.tau], adaptive_taus=[args.tau] if args.adaptive else [],
                           prompt_lengths=[int(x) for x in args.prompt_lengths.split(",")], max_tokens=args.max_tokens,
                           kernel=args.kernel, mlx_lm_spec=False, seed=args.seed, cost_keys=[])

    def progress(msg: str) -> None:
        LABEL[0] = msg
        print(f"[trace] {msg}", file=sys.stderr, flush=True)

    report = core.run_bench(s, on_progress=progress, spec_plugin=TracedPlugin())
    out = []
    labels = list(dict.fromkeys(r["label"] for r in TRACE if not r["label"].startswith("warm-up")))
    for label in labels:
        words = label.split()  # "fresh 3/8 plugin dflash b16 tau6.5 prompt 2049"
        regime, name, L = words[0], " ".join(words[2:-2]), int(words[-1])
        row = report["results"].get(regime, {}).get(name, {})
        i = row.get("prompt_lens", []).index(L) if L in row.get("prompt_lens", []) else None
        rate = f" {row['tok_s_per_prompt'][i]:.1f} tok/s" if i is not None else ""
        same = row["divergence"][i]["identical"] if i is not None and i < len(row.get("divergence", [])) else None
        tag = f"{regime} L={L} {name}{rate} (traced){'' if same in (True, None) else ', tokens DIFFER from plain decoding'}"
        out.append({**summarise(tag, [t for t in TRACE if t["label"] == label], args.adaptive), "identical": same})
    if args.json:
        Path(args.json).write_text(json.dumps({"trace": out, "kernel_costs": report.get("kernel_costs")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
