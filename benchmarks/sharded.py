"""``mlx-spec bench --distributed``: the bench over a target sharded on several ranks (``mlx.launch``).

Every rank loads the target, keeps its share through hooks/distributed.py's ``shard`` (mlx-lm's ``shard()``, as
``mlx-spec generate`` does) and runs the same methods on the same prompts in lockstep: mlx-lm's ``generate_step``
on the sharded model is the plain baseline; the plugin's rounds take the host's lockstep machinery (rank 0's costs,
``drafter: rank0``'s broadcast proposals; plugin/rank0_drafts.py). Rank 0 alone prints and writes the report, which
gains a ``distributed`` section: the ranks, the backend, the bytes exchanged per plain step and per round (from the
sharded layers' shapes), and a check that every rank produced the same tokens.

The unsharded figures come from the same command without ``mlx.launch`` and ``--distributed``; its JSON, given to
the sharded run as ``--compare-unsharded``, adds the ratios sharded / unsharded and whether the outputs match.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from ..hooks.api import LoadedTarget, distributed


def shard_target(target: LoadedTarget, config: Dict[str, Any], cluster: distributed.Cluster) -> LoadedTarget:
    """This rank's share of the target (mlx-lm's ``shard()``), marked sharded for the plugin's rounds."""
    distributed.shard(target.model, config, cluster)
    return dataclasses.replace(target, cluster=cluster)


def digest(tokens: Sequence[int]) -> str:
    """A short digest of a run's tokens: the report compares outputs across runs without carrying them."""
    return hashlib.blake2b(repr([int(t) for t in tokens]).encode(), digest_size=6).hexdigest()


def output_digests(runs: Sequence[Any]) -> Dict[str, Dict[str, List[str]]]:
    """regime -> method -> its runs' token digests, in the order they ran."""
    out: Dict[str, Dict[str, List[str]]] = {}
    for r in runs:
        out.setdefault(r.regime, {}).setdefault(r.method, []).append(digest(r.tokens))
    return out


def section(cluster: distributed.Cluster, model: Any, report: Dict[str, Any], runs: Sequence[Any]) -> Dict[str, Any]:
    """The report's ``distributed`` section, after every rank checked that all produced the same tokens (raises
    on every rank otherwise). Called on every rank (one collective)."""
    cluster.check_same([t for r in runs for t in r.tokens], "the bench's generated tokens")
    collectives, position_bytes = distributed.all_sums(model)
    per_method: Dict[str, Any] = {}  # the plugin's pinned-block methods (a round: the block's positions)
    rows = next(iter(report["results"].values()), {})
    for name, row in rows.items():
        if row.get("family") == "spec" and row.get("block") and not row.get("adaptive") and name.startswith("plugin"):
            per_method[name] = distributed.exchanged(collectives, position_bytes, int(row["block"]), row.get("tau"))
    return {"ranks": cluster.size, "backend": cluster.config.backend, "drafter": cluster.config.drafter,
            "same_tokens_on_every_rank": True, "all_sums_per_forward": collectives,
            "all_sum_bytes_per_position": position_bytes, "exchanged": per_method,
            "unsharded": "the same command without mlx.launch and --distributed; give its JSON as "
                         "--compare-unsharded PATH for the ratios"}


def compare(report: Dict[str, Any], path: str) -> Dict[str, Any]:
    """Ratios sharded / unsharded per method and regime, against the unsharded run's JSON at ``path`` (the same
    bench settings), and whether every run gave the same tokens as its unsharded twin."""
    try:
        whole = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--compare-unsharded: cannot read {path!r} ({e}); expected the JSON of the same "
                         "mlx-spec bench command run without --distributed") from None
    if "distributed" in whole or "results" not in whole:
        raise ValueError(f"--compare-unsharded: {path!r} is not an unsharded bench report; expected the JSON of the "
                         "same mlx-spec bench command run without mlx.launch and --distributed")
    mine = json.loads(json.dumps(report["settings"]))  # as the JSON holds them (tuples: lists)
    differ = [k for k, v in mine.items() if whole.get("settings", {}).get(k) != v]
    if differ:
        raise ValueError(f"--compare-unsharded: {path!r} ran other settings ({', '.join(differ)}); expected the same "
                         "bench settings as this run")
    ratios: Dict[str, Dict[str, Any]] = {}
    same: List[bool] = []
    for regime, rows in report["results"].items():
        theirs = whole["results"].get(regime, {})
        ratios[regime] = {name: round(row["tok_s"] / theirs[name]["tok_s"], 3)
                          for name, row in rows.items() if theirs.get(name, {}).get("tok_s")}
        mine, other = report["output_digests"].get(regime, {}), whole.get("output_digests", {}).get(regime, {})
        same += [mine[name] == other.get(name) for name in mine]
    return {"file": path, "sharded_over_unsharded_tok_s": ratios, "outputs_match_unsharded": bool(same) and all(same),
            "unsharded_tok_s": {g: {n: r["tok_s"] for n, r in rows.items()} for g, rows in whole["results"].items()}}


def summary(d: Dict[str, Any]) -> str:
    """The ``distributed`` section in a few lines, for the terminal."""
    lines = [f"distributed: {d['ranks']} ranks, backend {d['backend']}, drafter {d['drafter']}; the same tokens on "
             f"every rank; {d['all_sums_per_forward']} all_sums per forward, {d['all_sum_bytes_per_position']} bytes "
             "per position"]
    for name, x in d["exchanged"].items():
        lines.append(f"  {name}: a plain step {x['plain_step']['bytes']} B in {x['plain_step']['collectives']} "
                     f"collectives, a round {x['round']['bytes']} B in {x['round']['collectives']} "
                     f"({x['round_over_plain_step_bytes']}x)")
    compared: Optional[Dict[str, Any]] = d.get("compared")
    if compared:
        lines.append(f"  sharded / unsharded tok/s: {compared['sharded_over_unsharded_tok_s']}; outputs match the "
                     f"unsharded run: {compared['outputs_match_unsharded']}")
    return "\n".join(lines)
