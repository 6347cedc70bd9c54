"""The bench's report: medians per method and regime, speed-ups, bounds; the table, the plot, the JSON."""

from __future__ import annotations

import dataclasses
import json
import platform
import statistics
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx

from ..hooks.api import blas_in_use
from ..plugin import cuda
from ..plugin.metrics import ROUND_STEPS
from . import kernels
from .methods import Method, Run


REGIMES = {"fresh": "key lengths never run before in this process", "warm": "the same lengths replayed",
           "paired": "every method on the same prompt per base (the shortest of its fresh lengths), after the fresh "
                     "and warm regimes, the order rotating from prompt to prompt: ratios compare like with like",
           "paired median": "each method's middle run (by tok/s) per prompt over the paired regimes"}


def regime_note(regime: str) -> str:
    if regime.startswith("paired ") and regime[7:].isdigit():
        return f"the paired regime again (time {regime[7:]}), its order rotated once more"
    return REGIMES[regime]


def paired_medians(runs: List[Run]) -> List[Run]:
    """Each method's middle run by tok/s per prompt over the paired regimes, as the regime 'paired median'."""
    groups: Dict[Tuple[str, int], List[Run]] = {}  # (method, prompt index) -> its paired runs
    seen: Dict[Tuple[str, str], int] = {}  # (regime, method) -> its runs so far: the next one's prompt index
    for r in runs:
        if r.regime == "paired" or (r.regime.startswith("paired ") and r.regime[7:].isdigit()):
            p = seen[r.regime, r.method] = seen.get((r.regime, r.method), -1) + 1
            groups.setdefault((r.method, p), []).append(r)
    return [dataclasses.replace(sorted(rs, key=lambda r: r.tok_s)[len(rs) // 2], regime="paired median")
            for rs in groups.values()]


def _per_position(spec: Dict[str, Any], drafted: List[int]) -> List[float]:
    acc = spec.get("accepted_per_position") or []
    out = []
    for i, a in enumerate(acc):
        n = sum(1 for d in drafted if d > i)
        out.append(round(a / n, 4) if n else 0.0)
    return out


def summarize(s: Any, methods: List[Method], runs: List[Run], lengths: List[List[int]], note: str,
              drafters: Dict[str, Any], padded: bool, prewarm_s: float, wall_s: float,
              costs: Optional[Dict[str, Any]] = None, attention: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    import importlib.metadata as md

    def med(xs: List[float]) -> float:
        return statistics.median(xs) if xs else 0.0

    results: Dict[str, Any] = {}
    keys = kernels.prompt_key_lengths(lengths, s.max_tokens)  # [prompts], as kernel_costs timed them
    present = list(dict.fromkeys(r.regime for r in runs))  # in the order they ran, 'paired median' last
    for regime in present:
        rows: Dict[str, Any] = {}
        for m in methods:
            rs = [r for r in runs if r.method == m.name and r.regime == regime]
            row: Dict[str, Any] = dict(m.describe())
            row["tok_s"] = round(med([r.tok_s for r in rs]), 2)
            row["tok_s_per_prompt"] = [round(r.tok_s, 2) for r in rs]
            row["prompt_lens"] = [r.prompt_len for r in rs]
            row["peak_memory_gb"] = round(max(r.peak_memory_gb for r in rs), 3)
            divs = [r.divergence for r in rs if r.divergence is not None]
            row["identical_share"] = sum(1 for d in divs if d["identical"]) / len(divs) if divs else None
            row["divergence"] = divs
            paths: Dict[str, int] = {}
            for r in rs:
                for k, n in (r.attention or {}).items():
                    paths[k] = paths.get(k, 0) + n
            if paths:  # which attention path this method's timed runs took
                row["attention_calls"] = paths
                row["attention_kernel_share"] = round(paths.get("kernel", 0) / sum(paths.values()), 4)
            specs = [r.spec for r in rs if r.spec]
            if specs:
                rounds = sum(x["rounds"] for x in specs)
                acc = sum(x["accepted_tokens"] for x in specs)
                drafted_total = sum(x["draft_tokens"] for x in specs)
                row["tau"] = round(1 + acc / rounds, 3) if rounds else 0.0
                row["acceptance_rate"] = round(acc / drafted_total, 4) if drafted_total else 0.0
                row["rounds"] = rounds
                row["rounds_verified_ahead"] = sum(x.get("verified_ahead", 0) for x in specs)
                merged_pos: List[int] = []
                drafted: List[int] = []
                for r in rs:
                    if r.spec:
                        pos = r.spec.get("accepted_per_position") or []
                        merged_pos = [a + b for a, b in zip(merged_pos + [0] * (len(pos) - len(merged_pos)), pos + [0] * (len(merged_pos) - len(pos)))] if merged_pos else list(pos)
                        drafted += r.drafted
                row["per_position_acceptance"] = _per_position({"accepted_per_position": merged_pos}, drafted)
                row["tau_per_prompt"] = [round(1 + r.spec["accepted_tokens"] / r.spec["rounds"], 3)
                                         if r.spec and r.spec["rounds"] else None for r in rs]
                secs = [x.get("seconds") or {} for x in specs]
                if rounds and all(secs):
                    ms = {k: round(1000 * sum(x[k] for x in secs) / rounds, 3) for k in ("draft", "verify", "commit")}
                    wall = sum(x.get("decode_seconds", 0.0) for x in specs)
                    ms["host_overhead"] = round(1000 * wall / rounds - sum(ms.values()), 3)
                    row["ms_per_round"] = ms
                    steps = [x.get("steps") or {} for x in specs]
                    row["ms_per_round_steps"] = {k: round(1000 * sum(x.get(k, 0.0) for x in steps) / rounds, 3)
                                                 for k in ROUND_STEPS if any(k in x for x in steps)}
            rows[m.name] = row
        # speed-ups, and the kernel bound prompt by prompt (each prompt's own key length and plain speed)
        base = rows[methods[0].name]["tok_s"]
        project_plain = max((r["tok_s"] for r in rows.values() if r["family"] == "plain" and r["name"].startswith("host")), default=0.0)
        best_plain = max((r["tok_s"] for r in rows.values() if r["family"] == "plain"), default=0.0)
        hosts = [r["tok_s_per_prompt"] for r in rows.values() if r["family"] == "plain" and r["name"].startswith("host")]
        plain = _Plain(rows[methods[0].name]["tok_s_per_prompt"], [max(x) for x in zip(*hosts)] if hosts else [])
        for r in rows.values():
            r["speedup_vs_mlx_lm_plain"] = round(r["tok_s"] / base, 3) if base else None
            r["speedup_vs_best_project_plain"] = round(r["tok_s"] / project_plain, 3) if project_plain else None
            r["speedup_vs_best_plain"] = round(r["tok_s"] / best_plain, 3) if best_plain else None
            if not r.get("adaptive"):  # per-round bounds say nothing about a run that is mostly plain steps
                r.update(_kernel_bounds(costs, r, keys, plain))
        results[regime] = rows

    def version(name: str) -> str:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return "not installed"

    try:
        info = {k: (v if isinstance(v, (int, float, str)) else str(v)) for k, v in mx.device_info().items()}
    except Exception:  # noqa: BLE001
        info = {}
    return {
        "machine": {"platform": platform.platform(), "processor": platform.machine(), "python": platform.python_version(),
                    "device": str(mx.default_device()), "backend": cuda.device(), "device_info": info,
                    "blas": blas_in_use().to_dict()},  # the library MLX's float32 CPU matmuls call
        "versions": {"mlx": getattr(mx, "__version__", "?"), "mlx-lm": version("mlx-lm"),
                     "mlx-speculative": version("mlx-speculative")},
        "settings": dataclasses.asdict(s),
        "target": note,
        "drafters": {k: v[2] for k, v in drafters.items()},
        "padded_cache": {"on": padded, "bucket": s.bucket, "prewarm_seconds": round(prewarm_s, 2)},
        "attention": attention or {"kernel": "off"},
        "prompt_lengths": {"bases": s.prompt_lengths, "per_method": {m.name: [lengths[p][i] for p in range(len(lengths))] for i, m in enumerate(methods)}},
        "regimes": {g: regime_note(g) for g in present},
        "kernel_costs": costs,
        "results": results,
        "wall_seconds": round(wall_s, 1),
    }


@dataclasses.dataclass
class _Plain:
    mlx_lm: List[float]  # tok/s per prompt of mlx-lm's generate_step
    project: List[float]  # the best of this host's plain methods, per prompt


def _kernel_bounds(costs: Optional[Dict[str, Any]], row: Dict[str, Any], keys: List[int], plain: _Plain) -> Dict[str, Any]:
    """A fixed-block plugin row against bare rounds, prompt by prompt at each prompt's key length (``keys``):
    the bound tau * T(plain step) / (bare draft + bare verify), the ceiling with a drafter that costs
    nothing, and the share tok/s * bare / tau. Medians over the prompts; nothing when costs are missing."""
    if not costs or row.get("family") != "spec" or not row.get("block") or row["name"].startswith("mlx_lm"):
        return {}
    b = str(row["block"])
    per: Dict[str, List[Optional[float]]] = {k: [] for k in ("bare", "bound", "bound_p", "ceil", "ceil_p", "share")}
    for i, (L, tok_s, tau) in enumerate(zip(keys, row["tok_s_per_prompt"], row.get("tau_per_prompt") or [])):
        c = costs.get("by_key_length", {}).get(str(L), {})
        verify = c.get("target_forward_ms", {}).get(b)
        draft = c.get("draft_ms", {}).get(row.get("kind"), {}).get(b)
        step = 1000.0 / plain.mlx_lm[i] if plain.mlx_lm[i] else None
        step_p = 1000.0 / plain.project[i] if i < len(plain.project) and plain.project[i] else None
        ok = verify is not None and draft is not None and tau and step
        bare = draft + verify if ok else None
        per["bare"].append(bare)
        per["bound"].append(round(tau * step / bare, 3) if ok else None)
        per["bound_p"].append(round(tau * step_p / bare, 3) if ok and step_p else None)
        per["ceil"].append(round(tau * step / verify, 3) if ok else None)
        per["ceil_p"].append(round(tau * step_p / verify, 3) if ok and step_p else None)
        # tau tokens per bare round is what no machinery reaches; a round overlapping the drafter with
        # building the verify is the only way past it
        per["share"].append(round(tok_s * bare / (1000.0 * tau), 4) if ok else None)

    def med(k: str, digits: int = 3) -> Optional[float]:
        xs = [x for x in per[k] if x is not None]
        return round(statistics.median(xs), digits) if xs else None

    if med("bare") is None:
        return {}
    return {"bare_key_length_per_prompt": keys, "bare_round_ms": med("bare"),
            "kernel_bound_vs_mlx_lm_plain": med("bound"), "kernel_bound_vs_best_project_plain": med("bound_p"),
            "verify_ceiling_vs_mlx_lm_plain": med("ceil"), "verify_ceiling_vs_best_project_plain": med("ceil_p"),
            "kernel_bound_share": med("share", 4), "kernel_bound_per_prompt": per["bound"],
            "kernel_bound_share_per_prompt": per["share"]}


def _costs_line(c: Dict[str, Any], suffix: str = "") -> str:
    """One key length's bare forwards: target by positions; drafters by block (ms)."""
    fwd = ", ".join(f"{w}: {ms:.2f}" for w, ms in c["target_forward_ms" + suffix].items())
    drafts = "; ".join(f"{k} " + ", ".join(f"b{b}: {ms:.2f}" for b, ms in v.items()) for k, v in c["draft_ms" + suffix].items())
    return f"target by positions {fwd}" + (f"; {drafts}" if drafts else "")


def format_table(report: Dict[str, Any]) -> str:
    lines = []
    for regime, rows in report["results"].items():
        lines.append(f"{regime} shapes:")
        lines.append(f"  {'method':<44} {'tok/s':>8} {'x mlx-lm':>8} {'x proj':>7} {'tau':>6} {'bound%':>7} {'bound':>6} {'same':>5}  ms/round d/v/c/host")
        for name, r in rows.items():
            ms = r.get("ms_per_round")
            split = "/".join(f"{ms[k]:.1f}" for k in ("draft", "verify", "commit", "host_overhead")) if ms else ""
            share = f"{100 * r['kernel_bound_share']:.0f}" if r.get("kernel_bound_share") else ""
            tau = f"{r['tau']:.2f}" if r.get("tau") is not None else ""
            bound = f"{r['kernel_bound_vs_mlx_lm_plain']:.2f}" if r.get("kernel_bound_vs_mlx_lm_plain") else ""
            lines.append(f"  {name:<44} {r['tok_s']:>8.1f} {r['speedup_vs_mlx_lm_plain']:>8.2f} "
                         f"{r['speedup_vs_best_project_plain'] or 0:>7.2f} {tau:>6} {share:>7} {bound:>6} {'' if r['identical_share'] is None else format(r['identical_share'], '.0%'):>5}  {split}")
    costs = report.get("kernel_costs")
    if costs:
        by_key = costs.get("by_key_length") or {str(costs["key_length"]): costs}  # older reports: one key length
        extra = ", ".join(map(str, costs.get("extra_key_lengths") or [])) or "none"
        projections = costs.get("projections", "mlx")
        compiled = costs.get("target_forward") == "compiled"
        lines.append(f"bare forwards, ms ({costs['cache']}, attention {costs.get('attention', 'mlx')}, projections "
                     f"{projections}{', forwards compiled' if compiled else ''}; the prompts' key lengths at mid-decode, "
                     f"rounded up to 256, and --cost-keys {extra}):")
        off = "MLX's attention and matmuls" if projections == "kernel" else "MLX's attention"
        off += ", not compiled" if compiled else ""
        for L in sorted(by_key, key=int):
            lines.append(f"  {L:>6} keys: {_costs_line(by_key[L])}")
            if by_key[L].get("target_forward_ms_kernel_off"):
                lines.append(f"  {'':>6} {off}: {_costs_line(by_key[L], '_kernel_off')}")
        lines.append("bound: tau * T(mlx-lm plain step) / (bare draft + bare verify) at each prompt's key length, median "
                     "over prompts: the speed-up over mlx-lm with no machinery at all (each forward timed alone and "
                     "synchronised)")
        lines.append("bound%: tok/s * (bare draft + bare verify) / tau, the share of tau tokens per bare round reached "
                     "(median over prompts): under 100 is time the machinery costs; over 100 only where a round "
                     "overlaps the drafter's host work with the device's (drafting ahead, or building the verify "
                     "while the drafter's kernels run)")
    return "\n".join(lines)


def plot(report: Dict[str, Any], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
    except ImportError as e:
        raise ValueError("--plot needs matplotlib: pip install 'mlx-speculative[bench]'") from e
    figure(report).savefig(path, dpi=120)


def figure(report: Dict[str, Any]) -> Any:
    """Speed-up against block size (one line per method and tau) and against measured tau (per method and
    block): one colour per method in both panels, the marker per tau / block, solid fresh, dashed warm."""
    import textwrap

    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.4))
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    markers = "osD^v<>ph*"
    colours: Dict[str, str] = {}
    ticks: List[List[float]] = [[], []]
    for regime, line in (("fresh", "-"), ("warm", "--")):
        rows = [r for r in report["results"][regime].values() if r["family"] == "spec" and r.get("tau")]
        series: List[Dict[Any, List[Tuple[float, float]]]] = [{}, {}]
        for r in rows:
            if r["adaptive"] or not r["block"]:
                continue
            method = "mlx-lm" if r["name"].startswith("mlx_lm") else r["kind"]
            series[0].setdefault((method, f"~tau {r['oracle_tau']}"), []).append((r["block"], r["speedup_vs_mlx_lm_plain"]))
            series[1].setdefault((method, f"b{r['block']}"), []).append((r["tau"], r["speedup_vs_mlx_lm_plain"]))
        for i, ax in enumerate(axes):
            variants = sorted({v for _, v in series[i]})
            for (method, variant), pts in sorted(series[i].items()):
                pts.sort()
                colour = colours.setdefault(method, palette[len(colours) % len(palette)])
                ax.plot([p[0] for p in pts], [p[1] for p in pts], line, color=colour,
                        marker=markers[variants.index(variant) % len(markers)], label=f"{regime} {method} {variant}")
                ticks[i] += [p[0] for p in pts]
    axes[0].set_xlabel("block size"); axes[0].set_ylabel("speed-up vs mlx-lm generate_step")
    axes[1].set_xlabel("measured tau"); axes[1].set_ylabel("speed-up vs mlx-lm generate_step")
    for ax, xs, pad in zip(axes, ticks, (1.0, 0.5)):
        ax.axhline(1.0, color="grey", lw=0.5); ax.legend(fontsize=6)
        if len(set(xs)) == 1:  # one value: a readable axis around it, not matplotlib's +-0.2
            ax.set_xlim(xs[0] - pad, xs[0] + pad)
            ax.set_xticks([xs[0]])
    fig.suptitle("\n".join(textwrap.wrap(report["target"], 110)), fontsize=8)
    fig.tight_layout()
    return fig


def write_json(report: Dict[str, Any], path: str) -> None:
    Path(path).write_text(json.dumps(report, indent=1))
