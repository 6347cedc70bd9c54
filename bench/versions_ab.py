"""Two code versions' ``mlx-spec bench`` JSONs side by side (bench/versions_ab.sh): per regime and method, each
version's tok/s by run, new over old, and whether their outputs' digests are the same (where both keep them).

    python bench/versions_ab.py OLD-1.json NEW-1.json [OLD-2.json NEW-2.json ...] [--json summary.json]

Files named ``*-old-*`` are the older code's, ``*-new-*`` this checkout's.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple


def summarise(loaded: List[Tuple[Path, Dict[str, Any]]]) -> Dict[str, Any]:
    """``loaded``: each file with its JSON."""
    runs: Dict[str, List[Dict[str, Any]]] = {"old": [], "new": []}
    for f, run in sorted(loaded, key=lambda fr: fr[0]):
        version = "old" if "-old-" in f.name else "new" if "-new-" in f.name else None
        if version is None:
            raise SystemExit(f"versions_ab: expected files named *-old-N.json or *-new-N.json; got {f.name}")
        runs[version].append(run)
    if not runs["old"] or not runs["new"]:
        raise SystemExit(f"versions_ab: expected runs of both versions; got {len(runs['old'])} old, {len(runs['new'])} new")
    out: Dict[str, Any] = {}
    for regime in runs["new"][0]["results"]:
        for method in runs["new"][0]["results"][regime]:
            tok = {v: [r["results"][regime][method]["tok_s"] for r in rs if method in r["results"].get(regime, {})]
                   for v, rs in runs.items()}
            digests = {v: {tuple(r["output_digests"][regime][method]) for r in rs
                           if method in r.get("output_digests", {}).get(regime, {})} for v, rs in runs.items()}
            if not tok["old"]:
                continue
            out[f"{regime} {method}"] = {
                "old_tok_s": tok["old"], "new_tok_s": tok["new"],
                "new_over_old": round(statistics.median(tok["new"]) / statistics.median(tok["old"]), 4),
                # None: a version whose bench kept no digests of its outputs
                "same_outputs": digests["old"] == digests["new"] and len(digests["new"]) == 1
                if digests["old"] and digests["new"] else None,
            }
    return out


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    loaded = [(f, json.loads(f.read_text())) for f in args.files]
    summary = summarise(loaded)
    for k, v in summary.items():
        print(f"{k:48} old {v['old_tok_s']} new {v['new_tok_s']} new/old {v['new_over_old']:.3f} "
              f"same outputs {v['same_outputs']}")
    if args.json:
        args.json.write_text(json.dumps({"files": [f.name for f, _ in loaded],
                                         "commands": [r.get("command") for _, r in loaded], "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
