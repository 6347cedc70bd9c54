"""Reference BLAS against OpenBLAS on the CPU, side by side, from ``mlx-spec bench`` JSONs run both ways.

    python bench/blas_summary.py bench/results/cpu/blas-{reference,openblas}-llama150m.json \
        bench/results/cpu/blas-{reference,openblas}-demo.json --json bench/results/cpu/blas-summary.json

Arguments come in pairs (reference, OpenBLAS) of the same command with ``MLX_SPEC_BLAS=off`` / ``auto``;
each row: tok/s and the speed-up over mlx-lm's generate_step per method and regime, and the target's bare
forward over 16 (and 4, 32) positions as a multiple of one position.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict, List


def forward_ratios(report: Dict[str, Any]) -> Dict[str, Dict[str, float]]:
    """key length -> {"N": T(N positions) / T(1 position)} of the target's bare forwards."""
    out: Dict[str, Dict[str, float]] = {}
    for keys, costs in (report.get("kernel_costs") or {}).get("by_key_length", {}).items():
        ms = costs["target_forward_ms"]
        out[keys] = {n: round(ms[n] / ms["1"], 2) for n in ms if n != "1"}
        out[keys]["1_ms"] = ms["1"]
    return out


def pair(ref: Dict[str, Any], opt: Dict[str, Any]) -> Dict[str, Any]:
    rows: Dict[str, Any] = {}
    for regime in ref["results"]:
        for name, r in ref["results"][regime].items():
            o = opt["results"][regime].get(name)
            if o is None:
                continue
            rows[f"{regime} | {name}"] = {
                "tok_s": [r["tok_s"], o["tok_s"]],
                "x_mlx_lm": [r.get("speedup_vs_mlx_lm_plain"), o.get("speedup_vs_mlx_lm_plain")],
                "tau": r.get("tau"),
            }
    return {"target": ref["target"], "commands": [ref.get("command"), opt.get("command")],
            "blas": [ref["machine"]["blas"], opt["machine"]["blas"]],
            "forward_cost_vs_one_position": {"reference": forward_ratios(ref), "openblas": forward_ratios(opt)},
            "methods (reference, openblas)": rows}


def main(argv: List[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("reports", nargs="+", help="bench JSONs in pairs: reference, then OpenBLAS")
    p.add_argument("--json", help="write the summary here")
    a = p.parse_args(argv)
    if len(a.reports) % 2:
        p.error(f"reports: got {len(a.reports)}; expected pairs (reference, OpenBLAS)")
    loaded = [json.loads(Path(f).read_text()) for f in a.reports]
    summary = {"command": "python bench/blas_summary.py " + " ".join(argv),
               "pairs": [pair(loaded[i], loaded[i + 1]) for i in range(0, len(loaded), 2)]}
    for s in summary["pairs"]:
        print(s["target"][:70])
        for which, by_keys in s["forward_cost_vs_one_position"].items():
            print(f"  {which:9} forward N positions / 1: {by_keys}")
        for name, row in s["methods (reference, openblas)"].items():
            print(f"  {name:55} tok/s {row['tok_s'][0]:7.1f} -> {row['tok_s'][1]:7.1f}   x mlx-lm "
                  f"{row['x_mlx_lm'][0]} -> {row['x_mlx_lm'][1]}")
    if a.json:
        Path(a.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
