"""Where a speculative round's time goes, round by round, on fresh and then warm shapes.

    python bench/round_trace.py [--synthetic-target llama-8b] [--tau 6.5] [--prompt-lengths 1019,2801] [--adaptive]

Runs the plugin (DFlash-shape drafter, oracle acceptance, as ``mlx-spec bench``) with a traced
round: the device is synchronised between phases (draft, cache-transaction begin, graph build,
target forward, log-probabilities, accept, commit, emit, finish), so each phase's time is its
own. Synchronising adds a little to every round; use it to find costs, not to quote speed-ups.
Prints per-phase medians for each prompt's fresh and warm run and the rounds far above the median;
with ``--adaptive`` (block size and pauses by the controller) every round, with the context
positions the drafter caught up on and the plain steps before it.
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

from mlx_speculative.plugin import hookimpls, padded_cache  # noqa: E402
from mlx_speculative.plugin import round as rnd  # noqa: E402
from mlx_speculative.plugin.bench import core  # noqa: E402
from mlx_speculative.plugin.commit import CacheTransaction  # noqa: E402

TRACE: List[Dict[str, Any]] = []
PHASES = ("draft", "begin", "build", "forward", "logprobs", "accept", "commit", "emit", "finish")


def traced_round(state: Any, req: Any) -> Optional[Any]:
    mark = [time.perf_counter()]
    row: Dict[str, Any] = {"keys": state.cache[0].offset}

    def phase(name: str) -> None:
        mx.synchronize()
        now = time.perf_counter()
        row[name] = (now - mark[0]) * 1e3
        mark[0] = now

    mx.synchronize()
    mark[0] = time.perf_counter()
    plain_before = req.controller.plain_steps
    drafted = rnd.draft_block(state, req)
    phase("draft")
    if drafted is None:
        return None
    session = getattr(req.session, "inner", req.session)
    row["context"] = getattr(session, "_consumed", None)  # DFlash: captured positions fed this round
    row["plain_before"] = plain_before
    proposal, draft_txn, block = drafted
    fed = [state.pending, *proposal.tokens]
    txn = CacheTransaction(state.cache, replay=lambda n: state.forward(fed[:n])).begin()
    phase("begin")
    width = padded_cache.verify_width(state.cache, len(fed))
    logits = state.forward(fed + [state.pending] * (width - len(fed)))[:, : len(fed)]
    row["build"] = (time.perf_counter() - mark[0]) * 1e3  # no sync: the graph was only built
    mark[0] = time.perf_counter()
    mx.eval(logits)
    phase("forward")
    logprobs = state.logprobs(logits, proposal.tokens)
    mx.eval(logprobs)
    phase("logprobs")
    outcome = rnd._accept(state, req, proposal, logprobs)
    phase("accept")
    txn.commit(outcome.emitted)
    phase("commit")
    out = rnd.emit(state, outcome, logprobs)
    phase("emit")
    verify_ms = sum(row[p] for p in ("begin", "build", "forward", "logprobs", "accept", "commit", "emit"))
    rnd.finish_round(state, req, draft_txn, block, outcome, row["draft"] / 1e3, verify_ms / 1e3)
    phase("finish")
    row.update(width=width, drafts=len(proposal.tokens), accepted=outcome.accepted)
    TRACE.append(row)
    return out


def summarise(label: str, rows: List[Dict[str, Any]], every: bool = False) -> Dict[str, Any]:
    med = {p: round(statistics.median(r[p] for r in rows), 3) for p in PHASES}
    totals = [sum(r[p] for p in PHASES) for r in rows]
    m = statistics.median(totals)
    slow = [dict(i=i, total=round(t, 1), **{p: round(rows[i][p], 1) for p in PHASES}, keys=rows[i]["keys"],
                 width=rows[i]["width"], drafts=rows[i]["drafts"]) for i, t in enumerate(totals) if t > 1.5 * m + 2]
    print(f"{label}: {len(rows)} rounds, median round {m:.2f} ms, sum {sum(totals):.0f} ms; medians "
          + " ".join(f"{p} {med[p]:.2f}" for p in PHASES), flush=True)
    for s in slow[:12]:
        print(f"   slow round {s}", flush=True)
    if every:
        for i, (r, t) in enumerate(zip(rows, totals)):
            print(f"   round {i}: {t:.1f} ms draft {r['draft']:.1f} forward {r['forward']:.1f} width {r['width']} "
                  f"accepted {r['accepted']}/{r['drafts']} context {r['context']} after {r['plain_before']} plain steps",
                  flush=True)
    return {"label": label, "rounds": len(rows), "median_round_ms": round(m, 3), "sum_ms": round(sum(totals), 1),
            "median_ms": med, "slow": slow, "rows": rows if every else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--synthetic-target", default="llama-8b")
    parser.add_argument("--tau", type=float, default=6.5)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--prompt-lengths", default="1019,2801")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--adaptive", action="store_true", help="adaptive block size and pauses (every round printed)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    s = core.BenchSettings(synthetic_target=args.synthetic_target, kind="dflash", block_sizes=[args.block],
                           taus=[args.tau], mlx_lm_spec=False)
    lengths = [int(x) for x in args.prompt_lengths.split(",")]
    padded = padded_cache.resolve_mode(s.padded)
    target, config, _ = core.load_target(s)
    drafter = core.load_drafters(s, target, config, padded)["dflash"][0]
    vocab = int(config["vocab_size"])
    max_len = max(lengths) + args.max_tokens + 2 * args.block + 8
    if padded:
        from mlx_speculative.drafters.dflash import prewarm as prewarm_dflash

        padded_cache.prewarm(target.model, max_len, padded_cache.widths_for(args.block), s.bucket)
        prewarm_dflash(drafter, max_len, args.block)
    method = core.HostMethod(target, f"plugin dflash b{args.block} tau{args.tau:g}", padded, s.bucket, drafter,
                             args.block, args.tau, args.adaptive, vocab)
    hookimpls.run_round = traced_round
    stream = [2 + (i * 7919) % (vocab - 3) for i in range(max_len)]
    warm = stream[:64]
    method.run(warm, 16, core.reference(target, warm, 16, padded, s.bucket), 0)
    out = []
    for L in lengths:
        prompt = stream[:L]
        ref = core.reference(target, prompt, args.max_tokens, padded, s.bucket)
        for regime in ("fresh", "warm"):
            TRACE.clear()
            r = method.run(prompt, args.max_tokens, ref, 1)
            out.append(summarise(f"L={L} {regime} {r.tok_s:.1f} tok/s (traced)", list(TRACE), args.adaptive))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
