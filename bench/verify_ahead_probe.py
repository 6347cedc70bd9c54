"""Where a round's host time goes with the verify queued ahead (plugin/verify_ahead.py) and without.

    python bench/verify_ahead_probe.py [--prompt-lengths 2048] [--json PATH]

Runs ``mlx-spec bench`` (plugin/bench/core.py; llama-8b synthetic target, DFlash at oracle tau 6.5, block 16)
with --draft-ahead verify,on, the round's steps (plugin/round.py's draft, adopt, verify, draft_ahead, queue,
as_ints, read_plans, settle) wrapped in wall-clock timers, as the tests wrap them: nothing is synchronised
on top of what the round does, so a step that waits for the device shows it (reading the outcome waits for
the verify; anything else that waits long waits for work queued after it). Prints and writes each method's
per-round medians, fresh and warm.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_speculative.plugin import round as rnd  # noqa: E402
from mlx_speculative.plugin.bench import core  # noqa: E402

STEPS = ("draft", "adopt", "verify", "draft_ahead", "queue", "as_ints", "read_plans", "settle")
TIMES: Dict[str, Dict[str, List[float]]] = defaultdict(lambda: defaultdict(list))
LABEL = [""]


def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args, **kw)
        finally:
            TIMES[LABEL[0]][name].append((time.perf_counter() - t) * 1e3)
    return run


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--synthetic-target", default="llama-8b")
    p.add_argument("--prompt-lengths", default="2048")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--quantize-target", type=int, default=None, choices=[4, 8], help="the bench's --quantize-target")
    p.add_argument("--padded-cache", default="auto", choices=["auto", "on", "off"], help="the bench's --padded-cache")
    p.add_argument("--compiled-forward", default="auto", choices=["auto", "on", "off"],
                   help="the bench's --compiled-forward (verifying ahead needs the compiled forward)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    s = core.BenchSettings(padded=a.padded_cache, compiled_forward=a.compiled_forward, quantize_bits=a.quantize_target,
                           synthetic_target=a.synthetic_target, kind="dflash", block_sizes=[16], taus=[6.5], adaptive_taus=[],
                           prompt_lengths=[int(x) for x in a.prompt_lengths.split(",")], max_tokens=a.max_tokens,
                           mlx_lm_spec=False, cost_keys=[], draft_ahead="verify,on")

    def progress(msg: str) -> None:  # "fresh 4/10 plugin dflash b16 tau6.5 prompt 2049"
        parts = msg.split()
        LABEL[0] = f"{parts[0]} {' '.join(parts[2:-2])}" if len(parts) > 4 else msg
        print(f"[probe] {msg}", file=sys.stderr, flush=True)

    originals = {name: getattr(rnd, name) for name in STEPS}
    try:
        for name, fn in originals.items():
            setattr(rnd, name, timed(name, fn))
        report = core.run_bench(s, on_progress=progress)
    finally:
        for name, fn in originals.items():
            setattr(rnd, name, fn)
    out: Dict[str, Any] = {}
    for label, steps in TIMES.items():
        if label.split(" ", 1)[0] not in ("fresh", "warm") or "plugin" not in label:
            continue
        med = {k: round(statistics.median(v), 3) for k, v in steps.items() if v}
        calls = {k: len(v) for k, v in steps.items()}
        regime, method = label.split(" ", 1)
        row = report["results"].get(regime, {}).get(method, {})
        out[label] = {"median_ms": med, "calls": calls, "tok_s": row.get("tok_s"), "tau": row.get("tau")}
        print(f"{label}: " + " ".join(f"{k} {med[k]:.2f}" for k in STEPS if k in med) + f"  (calls {calls})", flush=True)
    if a.json:
        env = {k: v for k, v in os.environ.items() if k.startswith(("MLX_MAX_", "MLX_SPEC_"))}
        Path(a.json).write_text(json.dumps({"command": "python bench/verify_ahead_probe.py " + " ".join(argv or sys.argv[1:]),
                                            "env": env, "results": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
