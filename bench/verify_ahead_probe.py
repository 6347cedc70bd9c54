"""Where a round's host time goes with the verify queued ahead (plugin/cuda/verify_ahead.py) and without.

    python bench/verify_ahead_probe.py [--prompt-lengths 2048] [--json PATH]

Runs ``mlx-spec bench`` (benchmarks/core.py; llama-8b synthetic target, DFlash at oracle tau 6.5, block 16)
with --draft-ahead verify,on and prints each method's ``ms_per_round_steps``, fresh and warm: the round's own
wall-clock laps (plugin/metrics.py ``ROUND_STEPS``, recorded by plugin/round.py in every run), means per round.
Nothing is synchronised on top of what the round does, so a step that waits for the device shows it (``read``
waits for the verify's outcome; anything else that waits long waits for work queued before it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_speculative.benchmarks import core  # noqa: E402
from mlx_speculative.plugin.metrics import ROUND_STEPS  # noqa: E402


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--synthetic-target", default="llama-8b")
    p.add_argument("--prompt-lengths", default="2048")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--quantize-target", type=int, default=None, choices=[4, 8], help="the bench's --quantize-target")
    p.add_argument("--padded-cache", default="auto", choices=["auto", "on", "off"], help="the bench's --padded-cache")
    p.add_argument("--compiled-forward", default="auto", choices=["auto", "on", "off"],
                   help="the bench's --compiled-forward (verifying ahead needs the compiled forward)")
    p.add_argument("--draft-ahead", default="verify,on", help="the bench's --draft-ahead (modes joined by commas)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    s = core.BenchSettings(padded=a.padded_cache, compiled_forward=a.compiled_forward, quantize_bits=a.quantize_target,
                           synthetic_target=a.synthetic_target, kind="dflash", block_sizes=[16], taus=[6.5], adaptive_taus=[],
                           prompt_lengths=[int(x) for x in a.prompt_lengths.split(",")], max_tokens=a.max_tokens,
                           mlx_lm_spec=False, cost_keys=[], draft_ahead=a.draft_ahead)
    report = core.run_bench(s, on_progress=lambda msg: print(f"[probe] {msg}", file=sys.stderr, flush=True))
    out: Dict[str, Any] = {}
    for regime in ("fresh", "warm"):
        for name, row in report["results"].get(regime, {}).items():
            if row.get("family") != "spec":
                continue
            steps = row.get("ms_per_round_steps") or {}
            label = f"{regime} {name}"
            out[label] = {"mean_ms": steps, "rounds": row.get("rounds"), "rounds_verified_ahead": row.get("rounds_verified_ahead"),
                          "tok_s": row.get("tok_s"), "tau": row.get("tau")}
            print(f"{label}: " + " ".join(f"{k} {steps[k]:.2f}" for k in ROUND_STEPS if k in steps)
                  + f"  ({row.get('rounds')} rounds, {row.get('rounds_verified_ahead')} verified ahead)", flush=True)
    if a.json:
        env = {k: v for k, v in os.environ.items() if k.startswith(("MLX_MAX_", "MLX_SPEC_"))}
        Path(a.json).write_text(json.dumps({"command": "python bench/verify_ahead_probe.py " + " ".join(argv or sys.argv[1:]),
                                            "env": env, "results": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
