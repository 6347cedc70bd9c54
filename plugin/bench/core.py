"""``mlx-spec bench``: plain decoding (mlx-lm, this host) against speculative rounds, in one process.

Regimes. The first use of an attention shape is expensive on MLX-CUDA, so every method is timed
twice per prompt: *fresh* (key lengths no method has run before in this process, what a user meets
on a new prompt) and *warm* (the same lengths replayed). Methods that use exact key lengths
would warm each other's shapes, so in the fresh regime each method gets its own prompt length
near each base length (offsets rotate over the methods from prompt to prompt); the warm-up runs a
shorter length than any timed one.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from ...hooks.host import GenerationParams, Host
from ...hooks.manager import make_plugin_manager
from ...hooks.state import HostConfig, LoadedTarget
from .. import hookimpls, padded_cache
from ..settings import SpeculativeSettings
from . import oracle as orc
from . import synthetic


@dataclass
class Reference:
    tokens: List[int]
    margins: List[float]  # top-1 minus top-2 log-probability at each generated position


@dataclass
class Run:
    method: str
    regime: str
    prompt_len: int
    tokens: List[int]
    decode_seconds: float
    tok_s: float
    peak_memory_gb: float
    spec: Optional[Dict[str, Any]] = None
    drafted: List[int] = field(default_factory=list)
    divergence: Optional[Dict[str, Any]] = None


class Method:
    name: str = ""
    family: str = "plain"  # plain | spec
    tau: Optional[float] = None
    block: Optional[int] = None
    adaptive: bool = False
    kind: str = ""

    def run(self, prompt: List[int], max_tokens: int, ref: Optional[Reference], seed: int) -> Run:
        raise NotImplementedError

    def describe(self) -> Dict[str, Any]:
        return {"name": self.name, "family": self.family, "kind": self.kind, "oracle_tau": self.tau,
                "block": self.block, "adaptive": self.adaptive}


def _sync() -> None:
    mx.synchronize() if hasattr(mx, "synchronize") else None


class MlxLmPlain(Method):
    family = "plain"

    def __init__(self, model: Any):
        self.model = model
        self.name = "mlx_lm.generate_step"

    def run(self, prompt, max_tokens, ref, seed):
        from mlx_lm.generate import generate_step

        gen = generate_step(mx.array(prompt, dtype=mx.uint32), self.model, max_tokens=max_tokens)
        first, _ = next(gen)
        t0 = time.perf_counter()
        tokens = [int(first)] + [int(t) for t, _ in gen]
        dt = time.perf_counter() - t0
        return Run(self.name, "", len(prompt), tokens, dt, (len(tokens) - 1) / dt if dt > 0 else 0.0, 0.0)


class MlxLmSpec(Method):
    family = "spec"
    kind = "draft_model"

    def __init__(self, model: Any, draft: Any, block: int, tau: Optional[float], vocab: int):
        self.model, self.draft, self.block, self.tau, self.vocab = model, draft, block, tau, vocab
        self.name = f"mlx_lm.speculative_generate_step b{block}" + (f" tau{tau:g}" if tau else "")
        self.oracle = orc.Oracle(orc.alpha_for_tau(tau, block), vocab) if tau else None
        self.lm = orc.OracleDraftLM(draft, self.oracle, vocab) if tau else draft

    def run(self, prompt, max_tokens, ref, seed):
        from mlx_lm.generate import speculative_generate_step

        if self.oracle is not None:
            self.oracle.set_request(prompt, ref.tokens if ref else [], seed)
            self.lm.set_request()
        gen = speculative_generate_step(mx.array(prompt, dtype=mx.uint32), self.model, self.lm,
                                        num_draft_tokens=self.block - 1, max_tokens=max_tokens)
        first, _, _ = next(gen)
        t0 = time.perf_counter()
        rest = [(int(t), bool(d)) for t, _, d in gen]
        dt = time.perf_counter() - t0
        tokens = [int(first)] + [t for t, _ in rest]
        # rounds: each ends with one target token (from_draft False); drafts accepted in a row
        rounds, accepted, per_pos, run = 0, 0, [0] * (self.block - 1), 0
        for _, from_draft in rest:
            if from_draft:
                if run < len(per_pos):
                    per_pos[run] += 1
                run += 1
                accepted += 1
            else:
                rounds += 1
                run = 0
        spec = {"rounds": rounds, "accepted_tokens": accepted, "draft_tokens": rounds * (self.block - 1),
                "mean_acceptance_length": 1 + accepted / rounds if rounds else 0.0,
                "acceptance_rate": accepted / (rounds * (self.block - 1)) if rounds else 0.0,
                "accepted_per_position": per_pos, "seconds": {}}
        return Run(self.name, "", len(prompt), tokens, dt, (len(tokens) - 1) / dt if dt > 0 else 0.0, 0.0,
                   spec=spec, drafted=[self.block - 1] * rounds)


class HostMethod(Method):
    """Decoding through this project's host: plain (no plugin step) or the speculative plugin."""

    def __init__(self, target: LoadedTarget, name: str, padded: bool, bucket: int,
                 drafter: Any = None, block: Optional[int] = None, tau: Optional[float] = None,
                 adaptive: bool = False, vocab: int = 0):
        self.name = name
        self.padded = padded
        attachments: Dict[str, Any] = {}
        if padded:
            attachments[padded_cache.FACTORY_KEY] = lambda model, max_kv_size=None: padded_cache.make_padded_cache(model, max_kv_size, bucket)
        self.wrapped = None
        if drafter is None:
            self.family = "plain"
            self.host = Host(HostConfig(), pm=make_plugin_manager(load_entry_points=False))
        else:
            self.family = "spec"
            self.kind, self.block, self.tau, self.adaptive = drafter.kind, block, tau, adaptive
            self.oracle = orc.Oracle(orc.alpha_for_tau(tau, block), vocab) if tau else None
            self.wrapped = orc.WrappedDrafter(drafter, self.oracle)
            settings = SpeculativeSettings(enabled=True, kind=drafter.kind, block_size=None if adaptive else block,
                                           adaptive=adaptive)
            attachments[hookimpls.NAME] = hookimpls.Attachment(settings=settings, drafter=self.wrapped, block_size=block)
            self.host = Host(HostConfig(), pm=make_plugin_manager(load_entry_points=False, plugins=[hookimpls]))
        self.target = dataclasses.replace(target, attachments=attachments)

    def run(self, prompt, max_tokens, ref, seed):
        if self.wrapped is not None:
            self.wrapped.drafted.clear()
            if self.oracle is not None:
                self.oracle.set_request(prompt, ref.tokens if ref else [], seed)
        params = GenerationParams(max_tokens=max_tokens, stop_token_ids=[])
        state = self.host.new_state(self.target, prompt, params)
        self.host.prefill(state, params.prefill_step_size)
        _sync()
        t0 = time.perf_counter()
        for _ in self.host.decode_steps(state):
            pass
        dt = time.perf_counter() - t0
        tokens = state.tokens[state.prompt_len:]
        stats = state.report.get(hookimpls.NAME)
        spec = stats.to_dict() if stats is not None else None
        if spec is not None:
            spec["decode_seconds"] = dt
        return Run(self.name, "", len(prompt), tokens, dt, (len(tokens) - 1) / dt if dt > 0 else 0.0, 0.0,
                   spec=spec, drafted=list(self.wrapped.drafted) if self.wrapped else [])


class PaddedModel:
    """A draft LM whose caches are padded (the draft_model family asks ``make_cache``)."""

    def __init__(self, model: Any, bucket: int):
        self.model, self.bucket = model, bucket
        self.layers = getattr(model, "layers", None)

    def make_cache(self) -> List[Any]:
        return padded_cache.make_padded_cache(self.model, bucket=self.bucket)

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        return self.model(inputs, cache=cache)


# -- references, divergence, prompts --------------------------------------------------------------

def reference(target: LoadedTarget, prompt: List[int], max_tokens: int, padded: bool, bucket: int) -> Reference:
    """Plain greedy decoding (untimed) with the log-probability margin at every position.

    With padded caches on, the reference uses them: it then meets no exact key length that a
    timed fresh run will meet (the CPU tests show both give the same tokens)."""
    m = HostMethod(target, "reference", padded, bucket)
    params = GenerationParams(max_tokens=max_tokens, stop_token_ids=[])
    state = m.host.new_state(m.target, prompt, params)
    m.host.prefill(state, params.prefill_step_size)
    margins = [_margin(state.pending_logprobs)]
    for gen in m.host.decode_steps(state):
        margins.append(_margin(gen.logprobs))
    return Reference(state.tokens[state.prompt_len:], margins)


def _margin(logprobs: mx.array) -> float:
    top = mx.topk(logprobs.astype(mx.float32), 2)
    return float((mx.max(top) - mx.min(top)).item())


def divergence(tokens: Sequence[int], ref: Reference) -> Dict[str, Any]:
    n = min(len(tokens), len(ref.tokens))
    first = next((i for i in range(n) if tokens[i] != ref.tokens[i]), None)
    if first is None and len(tokens) != len(ref.tokens):
        first = n
    return {"identical": first is None, "first": first,
            "margin_there": round(ref.margins[first], 4) if first is not None and first < len(ref.margins) else None}


def allocate_lengths(bases: Sequence[int], n_methods: int, stride: int) -> List[List[int]]:
    """lengths[p][m]: disjoint key-length ranges [L - 1, L + stride) for every (prompt, method)."""
    used: List[Tuple[int, int]] = []
    out: List[List[int]] = []
    for p, base in enumerate(bases):
        row = [0] * n_methods
        for j in range(n_methods):
            m = (j + p) % n_methods  # rotate which method gets the shortest length
            L = base
            while any(not (L + stride <= a or L - 1 >= b) for a, b in used):
                L += 1
            used.append((L - 1, L + stride))
            row[m] = L
        out.append(row)
    return out


# -- the bench ------------------------------------------------------------------------------------

@dataclass
class BenchSettings:
    synthetic_target: Optional[str] = None
    model: Optional[str] = None
    draft_model: Optional[str] = None
    kind: str = "auto"  # dflash | draft_model | ngram | auto
    block_sizes: List[int] = field(default_factory=lambda: [16])
    taus: List[Optional[float]] = field(default_factory=lambda: [6.5])
    adaptive_taus: List[float] = field(default_factory=list)
    prompt_lengths: List[int] = field(default_factory=lambda: [128, 512, 1024])
    max_tokens: int = 256
    padded: str = "auto"
    bucket: int = padded_cache.DEFAULT_BUCKET
    mlx_lm_spec: bool = True
    draft_layers: int = 2
    dflash_layers: int = 5
    seed: int = 0
    cpu: bool = False


def _progress(msg: str) -> None:
    print(f"\r\033[K[bench] {msg}", end="", file=sys.stderr, flush=True)


def load_target(s: BenchSettings) -> Tuple[LoadedTarget, Dict[str, Any], str]:
    if s.synthetic_target:
        config = synthetic.config_for(s.synthetic_target)
        model = synthetic.build(config, seed=s.seed)
        note = (f"synthetic {s.synthetic_target}: random {config['torch_dtype']} weights built in memory; large logit "
                "margins by construction (head row pi(t) = embedding of t, layer output projections x0.1)")
        return LoadedTarget(model=model, tokenizer=None, path=Path("synthetic"), model_config=config,
                            name=s.synthetic_target), config, note
    if not s.model:
        raise ValueError("mlx-spec bench: give --model PATH or --synthetic-target NAME "
                         f"(allowed: {', '.join(synthetic.SPECS)})")
    from mlx_lm import load as mlx_load

    from ...hooks import loading

    path = loading.resolve_path(s.model, "model")
    config = loading.read_config(path, "model")
    model, tok = mlx_load(str(path))
    return LoadedTarget(model=model, tokenizer=tok, path=path, model_config=config, name=s.model), config, f"checkpoint {s.model}"


def load_drafters(s: BenchSettings, target: LoadedTarget, config: Dict[str, Any], padded: bool) -> Dict[str, Any]:
    """kind -> (drafter, draft LM module or None, description)."""
    from ...drafters.draft_model import DraftModelDrafter
    from ...drafters.ngram import family as ngram_family

    out: Dict[str, Any] = {}
    kinds = ["dflash", "draft_model"] if s.kind == "auto" else [s.kind]
    if s.synthetic_target:
        dcfg = synthetic.config_for(s.synthetic_target, num_hidden_layers=s.draft_layers)
        draft_lm = synthetic.build(dcfg, seed=s.seed + 1)
        desc = f"draft LM: {s.draft_layers} layers, width {dcfg['hidden_size']}, random weights"
    elif s.draft_model:
        from mlx_lm import load as mlx_load

        draft_lm, _ = mlx_load(s.draft_model)
        desc = f"draft LM {s.draft_model}"
    else:
        draft_lm, desc = None, ""
    if "draft_model" in kinds or s.mlx_lm_spec:
        if draft_lm is None:
            raise ValueError("mlx-spec bench: the draft_model kind needs --draft-model PATH (or --synthetic-target)")
        lm = PaddedModel(draft_lm, s.bucket) if padded else draft_lm
        out["draft_model"] = (DraftModelDrafter(lm), draft_lm, desc + (", padded caches" if padded else ""))
    if "dflash" in kinds:
        try:
            drafter, ddesc = synthetic.dflash_drafter(target.model, config, max(s.block_sizes), s.dflash_layers, s.seed + 2)
            if padded:  # as drafters.dflash.load does on CUDA: padded context cache, power-of-two blocks
                drafter.cache_bucket = s.bucket
                ddesc += ", padded context cache"
            out["dflash"] = (drafter, None, ddesc)
        except Exception as e:  # noqa: BLE001 - the DFlash family may be missing in this build
            if s.kind == "dflash":
                raise
            print(f"[bench] dflash drafter unavailable ({type(e).__name__}: {e}); skipping it", file=sys.stderr)
    if "ngram" in kinds:
        from ...drafters.base import DraftTarget

        out["ngram"] = (ngram_family.load(None, {}, DraftTarget(config=config), {"ngram_n": 3}), None, "ngram (n=3)")
    return out


def build_methods(s: BenchSettings, target: LoadedTarget, config: Dict[str, Any], drafters: Dict[str, Any],
                  padded: bool) -> List[Method]:
    vocab = int(config["vocab_size"])
    methods: List[Method] = [MlxLmPlain(target.model), HostMethod(target, "host plain (KVCache)", False, s.bucket)]
    if padded:
        methods.append(HostMethod(target, "host plain (padded)", True, s.bucket))
    spec_kinds = [k for k in ("dflash", "draft_model", "ngram") if k in drafters and (s.kind in ("auto", k))]
    for kind in spec_kinds:
        drafter = drafters[kind][0]
        taus = s.taus if kind != "draft_model" or s.kind == "draft_model" else [t for t in s.taus[:1]]
        for block in s.block_sizes:
            for tau in taus:
                tag = f"tau{tau:g}" if tau else "real drafts"
                methods.append(HostMethod(target, f"plugin {kind} b{block} {tag}", padded, s.bucket, drafter, block, tau,
                                          False, vocab))
        for tau in s.adaptive_taus:
            block = max(s.block_sizes)
            methods.append(HostMethod(target, f"plugin {kind} b{block} tau{tau:g} adaptive", padded, s.bucket, drafter,
                                      block, tau, True, vocab))
    if s.mlx_lm_spec and "draft_model" in drafters:
        block = max(s.block_sizes)
        methods.append(MlxLmSpec(target.model, drafters["draft_model"][1], block, s.taus[0], vocab))
    return methods


def run_bench(s: BenchSettings, on_progress: Callable[[str], None] = _progress) -> Dict[str, Any]:
    if s.cpu:
        mx.set_default_device(mx.cpu)
    padded = padded_cache.resolve_mode(s.padded)
    t_start = time.perf_counter()
    on_progress("loading the target")
    target, config, note = load_target(s)
    drafters = load_drafters(s, target, config, padded)
    methods = build_methods(s, target, config, drafters, padded)
    vocab = int(config["vocab_size"])
    cap = max(s.block_sizes)
    stride = s.max_tokens + 2 * cap + 8
    lengths = allocate_lengths(s.prompt_lengths, len(methods), stride)
    max_len = max(max(r) for r in lengths) + stride
    rng = random.Random(s.seed)
    stream = [rng.randrange(2, vocab - 1) for _ in range(max_len)]  # all prompts are prefixes of one stream
    prewarm_s = 0.0
    if padded:
        on_progress(f"pre-warming padded shapes up to {max_len} keys")
        t = time.perf_counter()
        widths = padded_cache.widths_for(cap)
        padded_cache.prewarm(target.model, max_len, widths, s.bucket)
        if "draft_model" in drafters:
            padded_cache.prewarm(drafters["draft_model"][1], max_len, [1, 2], s.bucket)
        if "dflash" in drafters:
            from ...drafters.dflash import prewarm as prewarm_dflash

            prewarm_dflash(drafters["dflash"][0], max_len, cap)
        prewarm_s = time.perf_counter() - t

    # warm-up: every method once, on a length shorter than any timed range
    warm_len, warm_tokens = max(8, min(s.prompt_lengths) // 4), 16
    if warm_len + warm_tokens + 2 * cap + 2 >= min(min(r) for r in lengths) - 1:
        raise ValueError(f"--prompt-lengths: the shortest ({min(s.prompt_lengths)}) leaves no room for a warm-up "
                         f"below it; expected at least {4 * (warm_tokens + 2 * cap + 4)}")
    warm_prompt = stream[:warm_len]
    warm_ref = reference(target, warm_prompt, warm_tokens, padded, s.bucket)
    for i, m in enumerate(methods):
        on_progress(f"warm-up {i + 1}/{len(methods)} {m.name}")
        m.run(warm_prompt, warm_tokens, warm_ref, s.seed)

    refs: Dict[Tuple[int, int], Reference] = {}
    total = len(s.prompt_lengths) * len(methods)
    for p in range(len(s.prompt_lengths)):
        for mi in range(len(methods)):
            if methods[mi].family != "spec":
                continue  # plain methods need no oracle; their divergence is not measured
            on_progress(f"references {p * len(methods) + mi + 1}/{total}")
            L = lengths[p][mi]
            refs[p, mi] = reference(target, stream[:L], s.max_tokens, padded, s.bucket)

    runs: List[Run] = []
    done = 0
    for regime in ("fresh", "warm"):
        for p in range(len(s.prompt_lengths)):
            for mi, m in enumerate(methods):
                done += 1
                L = lengths[p][mi]
                on_progress(f"{regime} {done}/{2 * total} {m.name} prompt {L}")
                mx.clear_cache()
                mx.reset_peak_memory()
                ref = refs.get((p, mi))
                r = m.run(stream[:L], s.max_tokens, ref, s.seed + 1000 * p + mi)
                r.peak_memory_gb = mx.get_peak_memory() / 1e9
                r.regime = regime
                r.divergence = divergence(r.tokens, ref) if ref is not None else None
                runs.append(r)
                tau = f" tau {1 + r.spec['accepted_tokens'] / r.spec['rounds']:.2f}" if r.spec and r.spec["rounds"] else ""
                print(f"[run] {regime} L={L} {m.name}: {r.tok_s:.1f} tok/s{tau}", flush=True)
    on_progress("bare forward costs (kernel bound)")
    timed_lens = sorted(L for row in lengths for L in row)
    costs = kernel_costs(s, target, drafters, methods, timed_lens[len(timed_lens) // 2] + s.max_tokens // 2, padded)
    on_progress("done\n")
    return summarize(s, methods, runs, lengths, note, drafters, padded, prewarm_s, time.perf_counter() - t_start,
                     costs)


def kernel_costs(s: BenchSettings, target: LoadedTarget, drafters: Dict[str, Any], methods: List[Method],
                 key_length: int, padded: bool, iters: int = 10) -> Dict[str, Any]:
    """Bare, warm, synchronised forward costs after ``key_length`` positions (plugin/bench/kernels.py):
    the target over 1 position and over each block, and each drafter's block."""
    from . import kernels

    bucket = s.bucket if padded else None
    blocks = sorted({m.block for m in methods if m.family == "spec" and m.block})
    target_ms = kernels.target_forward_ms(target.model, key_length, [1] + blocks, iters, bucket)
    draft_ms: Dict[str, Dict[int, float]] = {}
    for kind in sorted({m.kind for m in methods if m.family == "spec" and m.kind in drafters}):
        drafter, draft_lm, _ = drafters[kind]
        if kind == "dflash":
            draft_ms[kind] = {b: kernels.dflash_block_ms(drafter, key_length, b, iters) for b in blocks}
        elif kind == "draft_model" and draft_lm is not None:
            draft_ms[kind] = {b: kernels.draft_lm_ms(draft_lm, key_length, b, iters, bucket) for b in blocks}
    return {"key_length": key_length, "cache": "padded" if padded else "KVCache", "iters": iters,
            "target_forward_ms": {str(w): v["ms"] for w, v in target_ms.items()},
            "target_graph_build_ms": {str(w): v["build_ms"] for w, v in target_ms.items()},
            "draft_ms": {k: {str(b): ms for b, ms in v.items()} for k, v in draft_ms.items()}}


# -- summary --------------------------------------------------------------------------------------

def _per_position(spec: Dict[str, Any], drafted: List[int]) -> List[float]:
    acc = spec.get("accepted_per_position") or []
    out = []
    for i, a in enumerate(acc):
        n = sum(1 for d in drafted if d > i)
        out.append(round(a / n, 4) if n else 0.0)
    return out


def summarize(s: BenchSettings, methods: List[Method], runs: List[Run], lengths: List[List[int]], note: str,
              drafters: Dict[str, Any], padded: bool, prewarm_s: float, wall_s: float,
              costs: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    import importlib.metadata as md

    def med(xs: List[float]) -> float:
        return statistics.median(xs) if xs else 0.0

    results: Dict[str, Any] = {}
    for regime in ("fresh", "warm"):
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
            specs = [r.spec for r in rs if r.spec]
            if specs:
                rounds = sum(x["rounds"] for x in specs)
                acc = sum(x["accepted_tokens"] for x in specs)
                drafted_total = sum(x["draft_tokens"] for x in specs)
                row["tau"] = round(1 + acc / rounds, 3) if rounds else 0.0
                row["acceptance_rate"] = round(acc / drafted_total, 4) if drafted_total else 0.0
                row["rounds"] = rounds
                merged_pos: List[int] = []
                drafted: List[int] = []
                for r in rs:
                    if r.spec:
                        pos = r.spec.get("accepted_per_position") or []
                        merged_pos = [a + b for a, b in zip(merged_pos + [0] * (len(pos) - len(merged_pos)), pos + [0] * (len(merged_pos) - len(pos)))] if merged_pos else list(pos)
                        drafted += r.drafted
                row["per_position_acceptance"] = _per_position({"accepted_per_position": merged_pos}, drafted)
                secs = [x.get("seconds") or {} for x in specs]
                if rounds and all(secs):
                    ms = {k: round(1000 * sum(x[k] for x in secs) / rounds, 3) for k in ("draft", "verify", "commit")}
                    wall = sum(x.get("decode_seconds", 0.0) for x in specs)
                    ms["host_overhead"] = round(1000 * wall / rounds - sum(ms.values()), 3)
                    row["ms_per_round"] = ms
            rows[m.name] = row
        # speed-ups and the ideal bound
        base = rows[methods[0].name]["tok_s"]
        project_plain = max((r["tok_s"] for r in rows.values() if r["family"] == "plain" and r["name"].startswith("host")), default=0.0)
        best_plain = max((r["tok_s"] for r in rows.values() if r["family"] == "plain"), default=0.0)
        for r in rows.values():
            r["speedup_vs_mlx_lm_plain"] = round(r["tok_s"] / base, 3) if base else None
            r["speedup_vs_best_project_plain"] = round(r["tok_s"] / project_plain, 3) if project_plain else None
            r["speedup_vs_best_plain"] = round(r["tok_s"] / best_plain, 3) if best_plain else None
            if r.get("adaptive"):
                continue  # per-round bounds say nothing about a run that is mostly plain steps
            if "ms_per_round" in r and project_plain:
                t_step = 1000.0 / project_plain
                t_round = r["ms_per_round"]["draft"] + r["ms_per_round"]["verify"]
                ideal = r["tau"] * t_step / t_round if t_round else 0.0
                r["ideal_bound"] = round(ideal, 3)
                r["share_of_ideal"] = round(r["speedup_vs_best_project_plain"] / ideal, 3) if ideal else None
            bare = _bare_costs_ms(costs, r)
            if bare and r.get("tau") and base and project_plain:
                # No machinery at all: tau tokens for one bare draft + one bare verify; the ceiling
                # counts the verify alone (a drafter that costs nothing).
                draft, verify = bare
                bare = draft + verify
                r["bare_round_ms"] = round(bare, 3)
                r["kernel_bound_vs_mlx_lm_plain"] = round(r["tau"] * (1000.0 / base) / bare, 3)
                r["kernel_bound_vs_best_project_plain"] = round(r["tau"] * (1000.0 / project_plain) / bare, 3)
                r["verify_ceiling_vs_mlx_lm_plain"] = round(r["tau"] * (1000.0 / base) / verify, 3)
                r["verify_ceiling_vs_best_project_plain"] = round(r["tau"] * (1000.0 / project_plain) / verify, 3)
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
                    "device": str(mx.default_device()), "backend": padded_cache.backend(), "device_info": info},
        "versions": {"mlx": getattr(mx, "__version__", "?"), "mlx-lm": version("mlx-lm"),
                     "mlx-speculative": version("mlx-speculative")},
        "settings": dataclasses.asdict(s),
        "target": note,
        "drafters": {k: v[2] for k, v in drafters.items()},
        "padded_cache": {"on": padded, "bucket": s.bucket, "prewarm_seconds": round(prewarm_s, 2)},
        "prompt_lengths": {"bases": s.prompt_lengths, "per_method": {m.name: [lengths[p][i] for p in range(len(lengths))] for i, m in enumerate(methods)}},
        "regimes": {"fresh": "key lengths never run before in this process", "warm": "the same lengths replayed"},
        "kernel_costs": costs,
        "results": results,
        "wall_seconds": round(wall_s, 1),
    }


def _bare_costs_ms(costs: Optional[Dict[str, Any]], row: Dict[str, Any]) -> Optional[Tuple[float, float]]:
    """(bare draft, bare verify) milliseconds of a plugin row's block, when both were timed."""
    if not costs or row.get("family") != "spec" or not row.get("block") or row["name"].startswith("mlx_lm"):
        return None
    verify = costs["target_forward_ms"].get(str(row["block"]))
    draft = costs["draft_ms"].get(row.get("kind"), {}).get(str(row["block"]))
    return (draft, verify) if verify is not None and draft is not None else None


def format_table(report: Dict[str, Any]) -> str:
    lines = []
    for regime, rows in report["results"].items():
        lines.append(f"{regime} shapes:")
        lines.append(f"  {'method':<44} {'tok/s':>8} {'x mlx-lm':>8} {'x proj':>7} {'tau':>6} {'ideal%':>7} {'bound':>6} {'same':>5}  ms/round d/v/c/host")
        for name, r in rows.items():
            ms = r.get("ms_per_round")
            split = "/".join(f"{ms[k]:.1f}" for k in ("draft", "verify", "commit", "host_overhead")) if ms else ""
            share = f"{100 * r['share_of_ideal']:.0f}" if r.get("share_of_ideal") else ""
            tau = f"{r['tau']:.2f}" if r.get("tau") is not None else ""
            bound = f"{r['kernel_bound_vs_mlx_lm_plain']:.2f}" if r.get("kernel_bound_vs_mlx_lm_plain") else ""
            lines.append(f"  {name:<44} {r['tok_s']:>8.1f} {r['speedup_vs_mlx_lm_plain']:>8.2f} "
                         f"{r['speedup_vs_best_project_plain'] or 0:>7.2f} {tau:>6} {share:>7} {bound:>6} {'' if r['identical_share'] is None else format(r['identical_share'], '.0%'):>5}  {split}")
    costs = report.get("kernel_costs")
    if costs:
        fwd = ", ".join(f"{w}: {ms:.2f}" for w, ms in costs["target_forward_ms"].items())
        drafts = "; ".join(f"{k} " + ", ".join(f"b{b}: {ms:.2f}" for b, ms in v.items()) for k, v in costs["draft_ms"].items())
        lines.append(f"bare forwards after {costs['key_length']} keys ({costs['cache']}), ms: target by positions {fwd}; "
                     f"drafters {drafts}")
        lines.append("bound: tau * T(mlx-lm plain step) / (bare draft + bare verify), the speed-up over mlx-lm "
                     "with no machinery at all (each forward timed alone and synchronised; a round overlaps the "
                     "drafter's kernels with building the verify, so it can beat this)")
    return "\n".join(lines)


def plot(report: Dict[str, Any], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ValueError("--plot needs matplotlib: pip install 'mlx-speculative[bench]'") from e
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for regime, style in (("fresh", "o-"), ("warm", "s--")):
        rows = [r for r in report["results"][regime].values() if r["family"] == "spec" and r.get("tau")]
        by_tau: Dict[Any, List[Tuple[int, float]]] = {}
        by_block: Dict[Any, List[Tuple[float, float]]] = {}
        for r in rows:
            if r["adaptive"] or not r["block"]:
                continue
            by_tau.setdefault((r["kind"], r["name"].startswith("mlx_lm"), r["oracle_tau"]), []).append((r["block"], r["speedup_vs_mlx_lm_plain"]))
            by_block.setdefault((r["kind"], r["name"].startswith("mlx_lm"), r["block"]), []).append((r["tau"], r["speedup_vs_mlx_lm_plain"]))
        for key, pts in by_tau.items():
            pts.sort()
            axes[0].plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"{regime} {'mlx-lm' if key[1] else key[0]} ~tau {key[2]}")
        for key, pts in by_block.items():
            pts.sort()
            axes[1].plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"{regime} {'mlx-lm' if key[1] else key[0]} b{key[2]}")
    axes[0].set_xlabel("block size"); axes[0].set_ylabel("speed-up vs mlx-lm generate_step")
    axes[1].set_xlabel("measured tau"); axes[1].set_ylabel("speed-up vs mlx-lm generate_step")
    for ax in axes:
        ax.axhline(1.0, color="grey", lw=0.5); ax.legend(fontsize=6)
    fig.suptitle(report["target"][:90], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write_json(report: Dict[str, Any], path: str) -> None:
    Path(path).write_text(json.dumps(report, indent=1))
