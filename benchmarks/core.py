"""``mlx-spec bench``: plain decoding (mlx-lm, this host) against speculative rounds, in one process.

Regimes. The first use of an attention shape is expensive on MLX-CUDA, so every method is timed
twice per prompt: *fresh* (key lengths no method has run before in this process, what a user meets
on a new prompt) and *warm* (the same lengths replayed). Methods that use exact key lengths
would warm each other's shapes, so in the fresh regime each method gets its own prompt length
near each base length (offsets rotate over the methods from prompt to prompt); the warm-up runs a
shorter length than any timed one.
"""

from __future__ import annotations

import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import mlx.core as mx

from ..hooks.api import Backend, route_policy, route_projections, taps, unroute_projections
from ..plugin import cuda
from ..plugin.cuda import attention, backend as cuda_backend, compiled, projections
from .loaders import build_methods, load_drafters, load_target
from .methods import HostMethod, Method, Reference, Run, allocate_lengths, divergence, reference
from .report import paired_medians, summarize
from . import kernels, real, sharded


# -- the bench ------------------------------------------------------------------------------------

@dataclass
class BenchSettings:
    synthetic_target: Optional[str] = None
    model: Optional[str] = None
    draft_model: Optional[str] = None
    kind: str = "auto"  # dflash | eagle3 | draft_model | ngram | auto
    block_sizes: List[int] = field(default_factory=lambda: [16])
    taus: List[Optional[float]] = field(default_factory=lambda: [6.5])
    adaptive_taus: List[float] = field(default_factory=list)
    prompt_lengths: List[int] = field(default_factory=lambda: [128, 512, 1024])
    max_tokens: int = 256
    padded: str = "auto"
    bucket: int = cuda_backend.DEFAULT_BUCKET
    kernel: str = "auto"  # the short-query attention kernel (plugin/cuda/attention.py): auto | on | off
    projection_kernel: str = "auto"  # the verify-width matmul kernel (plugin/cuda/projections.py): auto | on | off
    compiled_forward: str = "auto"  # compiled verify forwards (plugin/cuda/compiled.py), padded caches only: auto | on | off
    compiled_widths: Tuple[int, ...] = compiled.DEFAULT_WIDTHS  # the input widths compiled (1: plain steps too)
    quantize_bits: Optional[int] = None  # the target's weights quantized (group size 64) after loading
    mlx_lm_spec: bool = True
    draft_layers: int = 2
    dflash_layers: int = 5
    seed: int = 0
    cpu: bool = False
    drafters: List[str] = field(default_factory=list)  # real checkpoints, PATH or PATH@B (real.py)
    prompts_file: Optional[str] = None  # text prompts instead of random tokens (real.py)
    max_prompts: Optional[int] = None
    cost_keys: Optional[List[int]] = None  # extra key lengths of the bare forward costs; None: 8192,16384 on CUDA
    paired: int = 0  # paired regimes: every method on the same prompt per base (N > 1: and their median)
    draft_ahead: str = "on"  # what rounds queue ahead (plugin/round.py): on | verify | off, or several: twin methods


_last_stage: List[str] = []


def _progress(msg: str) -> None:
    """One line rewritten in place on a terminal; into a file or pipe, a plain line per stage (no \\r, no
    escapes), the first message of each (a stage: the message up to its first number)."""
    if sys.stderr.isatty():
        print(f"\r\033[K[bench] {msg}", end="", file=sys.stderr, flush=True)
        return
    stage = msg.strip().split(" ")[0] if msg.strip() else ""
    if stage and stage != "done" and _last_stage[-1:] != [stage]:
        _last_stage[:] = [stage]
        print(f"[bench] {msg.strip()}", file=sys.stderr, flush=True)


def run_bench(s: BenchSettings, on_progress: Callable[[str], None] = _progress,
              dispatcher: Optional[attention.Dispatcher] = None,
              projection_dispatcher: Optional[projections.Projections] = None,
              spec_plugin: Any = None, cluster: Any = None) -> Dict[str, Any]:
    """``dispatcher`` / ``projection_dispatcher``: the attention and projection dispatchers to route with
    (tests: stand-ins); default: ``--kernel``'s and ``--projection-kernel``'s. ``spec_plugin``: the
    speculative methods' host plugin (default: this project's; bench/round_trace.py: a traced one).
    ``cluster``: the ranks the target is sharded over (sharded.py): every rank runs this in lockstep."""
    quiet = cluster is not None and not cluster.primary  # rank 0 alone tells the progress
    on_progress = (lambda msg: None) if quiet else on_progress
    if s.cpu:
        mx.set_default_device(mx.cpu)
    padded = cuda.padded_on(s.padded)
    disp = dispatcher if dispatcher is not None else attention.dispatcher_for(
        s.kernel, source="--kernel", min_keys=None if padded else attention.ROUTED_MIN_KEYS)  # as policy_for
    proj = projection_dispatcher if projection_dispatcher is not None else \
        projections.projections_for(s.projection_kernel, "--projection-kernel")
    policy: Optional[Backend] = None
    if padded:
        policy = cuda_backend.ShapeStablePolicy(s.bucket, prewarm_tokens=0, attention=disp, projections=proj,
                                                forward=compiled.forward_for(cuda_backend.PaddedKVCache,
                                                                             s.compiled_forward, "--compiled-forward",
                                                                             s.compiled_widths))
    elif disp is not None or proj is not None:
        policy = cuda_backend.RoutedPolicy(disp, proj)
    fwd = policy.forward if policy is not None else None
    real.check(s)
    texts = real.read_prompts(s.prompts_file)[:s.max_prompts or None] if s.prompts_file else None
    t_start = time.perf_counter()
    on_progress("loading the target")
    target, config, note = load_target(s)
    if cluster is not None:
        target = sharded.shard_target(target, config, cluster)
        note += f"; sharded over {cluster.size} ranks (mlx-lm's shard(), backend {cluster.config.backend})"
    info: Optional[Dict[str, Dict[str, Any]]] = None
    if s.drafters:  # real checkpoints: the families route their own models (as under mlx-spec generate)
        drafters, info = real.load_drafters(s, target, policy)
        if s.mlx_lm_spec and "draft_model" not in drafters:
            print("[bench] no draft_model drafter among --drafter: skipping mlx-lm's speculative_generate_step",
                  file=sys.stderr)
    else:
        drafters = load_drafters(s, target, config, policy)
    routed: List[Any] = []
    if disp is not None or proj is not None:  # as the host and the drafter families do with the policy's dispatchers
        extra = [] if info is not None else [d[1] for d in drafters.values() if d[1] is not None] + \
            [d[0].model for k, d in drafters.items() if k == "dflash"]
        routed = [target.model] + extra
        for model in routed:
            route_policy(model, policy)
    methods = build_methods(s, target, config, drafters, policy,
                            {k: v["blocks"] for k, v in info.items()} if info is not None else None, spec_plugin)
    calls: Dict[str, Counter] = {m.name: Counter() for m in methods}

    def kernels_on(on: bool) -> None:
        """The project's kernels for the routed models, or MLX's attention and matmuls (the projections
        unrouted: not even the routed layers' size check)."""
        if disp is not None:
            disp.enabled = on
        if fwd is not None:
            fwd.enabled = on
        for model in routed if proj is not None else []:
            route_projections(model, proj) if on else unroute_projections(model)

    def run(m: Method, *args: Any) -> Run:
        """One run; the dispatchers serve this project's host only (mlx-lm's methods keep mlx-lm's attention
        and matmuls)."""
        host = isinstance(m, HostMethod)
        if not host:
            kernels_on(False)
        before = Counter(disp.counts) if disp is not None else None
        try:
            return m.run(*args)
        finally:
            if disp is not None:
                calls[m.name].update(Counter(disp.counts) - before)
            if not host:
                kernels_on(True)
    vocab = int(config["vocab_size"])
    cap = max([m.block for m in methods if m.block] + s.block_sizes + [2])
    stride = s.max_tokens + 2 * cap + 8
    n = len(methods)
    if texts is not None:  # every method decodes every prompt; the order rotates from prompt to prompt
        tokens = real.tokenize(target.tokenizer, texts, s.prompts_file)
        lengths = [[len(t)] * n for t in tokens]
        order = [[(j + p) % n for j in range(n)] for p in range(len(tokens))]
        prompt = lambda p, mi: tokens[p]  # noqa: E731
    else:
        lengths = allocate_lengths(s.prompt_lengths, n, stride)
        order = [list(range(n)) for _ in lengths]
        rng = random.Random(s.seed)
        stream = [rng.randrange(2, vocab - 1) for _ in range(max(max(r) for r in lengths) + stride)]
        prompt = lambda p, mi: stream[:lengths[p][mi]]  # noqa: E731 - all prompts: prefixes of one stream
    max_len = max(max(r) for r in lengths) + stride
    prewarm_s = 0.0
    if padded:
        on_progress(f"pre-warming padded shapes up to {max_len} keys")
        t = time.perf_counter()
        policy.prewarm_tokens = max_len
        # the compiled verify forwards' traces too, with the layers each kind's rounds record (a trace per set)
        layer_sets = sorted({tuple(d[0].capture_layers()) for d in drafters.values()}) if fwd is not None else []
        for layers in layer_sets:
            taps.install_taps(target.model, layers)
        policy.capture_layers = layer_sets[0] if layer_sets else ()
        policy.prewarm(target.model, cap)
        for layers in layer_sets[1:]:
            cuda_backend.prewarm_compiled(target.model, fwd, max_len, policy.widths(cap), layers)
        if fwd is not None and 1 in fwd.widths:  # the host's plain steps record nothing
            cuda_backend.prewarm_compiled(target.model, fwd, max_len, [1], ())
        if "draft_model" in drafters:
            cuda_backend.prewarm(drafters["draft_model"][1], max_len, [1, 2], s.bucket)
        if "dflash" in drafters:
            from ..drafters.dflash import prewarm as prewarm_dflash

            prewarm_dflash(drafters["dflash"][0], max_len, cap)
        if "eagle3" in drafters:
            from ..drafters.eagle3 import prewarm as prewarm_eagle3

            prewarm_eagle3(drafters["eagle3"][0], max_len, cap)
        prewarm_s = time.perf_counter() - t

    # warm-up: every method once, on a length shorter than any timed range (prompts file: its first
    # prompt's first 8 tokens, whatever the other lengths), long enough for rounds after the first at the cap
    # (verifying ahead queues only where a round follows): code first met in a timed run costs it its first use
    # (MLX-CUDA builds some kernels then), not the new prompt shapes the fresh regime measures
    warm_tokens = max(16, 3 * cap + 4)
    if texts is not None:
        warm_prompt = tokens[0][:8]
    else:
        warm_len = max(8, min(s.prompt_lengths) // 4)
        if warm_len + warm_tokens + 2 * cap + 2 >= min(min(r) for r in lengths) - 1:
            raise ValueError(f"--prompt-lengths: the shortest ({min(s.prompt_lengths)}) leaves no room for a warm-up "
                             f"below it; expected at least {4 * (warm_tokens + 2 * cap + 4)}")
        warm_prompt = stream[:warm_len]
    warm_ref = reference(target, warm_prompt, warm_tokens, policy)
    for i, m in enumerate(methods):
        on_progress(f"warm-up {i + 1}/{len(methods)} {m.name}")
        run(m, warm_prompt, warm_tokens, warm_ref, s.seed)

    refs: Dict[Tuple[int, int], Reference] = {}
    total = len(lengths) * n
    for p in range(len(lengths)):
        shared: Dict[int, Reference] = {}  # one reference per distinct prompt length (a prompts file: one per prompt)
        for mi in range(n):
            if methods[mi].family != "spec":
                continue  # plain methods need no oracle; their divergence is not measured
            on_progress(f"references {p * n + mi + 1}/{total}")
            L = lengths[p][mi]
            if L not in shared:
                shared[L] = reference(target, prompt(p, mi), s.max_tokens, policy)
            refs[p, mi] = shared[L]
    # paired: method mi' of prompt p decodes the prompt of the method with the shortest length there
    first = [min(range(n), key=lambda mi: lengths[p][mi]) for p in range(len(lengths))]
    repeats = int(s.paired)
    regimes = ["fresh", "warm"] + [f"paired {k + 1}" if k else "paired" for k in range(repeats)]

    runs: List[Run] = []
    done = 0
    for k, regime in enumerate(regimes):
        paired = regime.startswith("paired")
        for p in range(len(lengths)):
            for mi in (order[p] if not paired else [(j + p + k - 2) % n for j in range(n)]):
                m = methods[mi]
                src = first[p] if paired else mi  # whose prompt (and reference) this run takes
                done += 1
                L = lengths[p][src]
                on_progress(f"{regime} {done}/{len(regimes) * total} {m.name} prompt {L}")
                mx.clear_cache()
                mx.reset_peak_memory()
                ref = refs.get((p, src)) if m.family == "spec" else None
                if m.family == "spec" and ref is None:  # the shortest prompt was a plain method's
                    ref = refs[p, src] = reference(target, prompt(p, src), s.max_tokens, policy)
                before = Counter(calls[m.name])
                r = run(m, prompt(p, src), s.max_tokens, ref, s.seed + 1000 * p + mi)
                r.attention = dict(calls[m.name] - before) if disp is not None else None
                r.peak_memory_gb = mx.get_peak_memory() / 1e9
                r.regime = regime
                r.divergence = divergence(r.tokens, ref) if ref is not None else None
                runs.append(r)
                tau = f" tau {1 + r.spec['accepted_tokens'] / r.spec['rounds']:.2f}" if r.spec and r.spec["rounds"] else ""
                if not quiet:
                    print(f"[run] {regime} L={L} {m.name}: {r.tok_s:.1f} tok/s{tau}", file=sys.stderr, flush=True)
    if repeats > 1:
        runs += paired_medians(runs)
    run_keys = kernels.prompt_key_lengths(lengths, s.max_tokens)
    extra_keys = s.cost_keys if s.cost_keys is not None else \
        (kernels.EXTRA_KEYS_CUDA if cuda.device() == "cuda" else [])
    bucket = s.bucket if padded else None
    costs = kernels.kernel_costs(target.model, drafters, methods, run_keys, extra_keys, bucket, on_progress=on_progress,
                                 policy_forward=fwd)
    if disp is not None or proj is not None or fwd is not None:  # the same bare forwards: MLX's attention and matmuls, not compiled
        kernels_on(False)
        off = kernels.kernel_costs(target.model, drafters, methods, run_keys, extra_keys, bucket, on_progress=on_progress,
                                   policy_forward=fwd)
        kernels_on(True)
        for mine, theirs in [(costs, off)] + [(costs["by_key_length"][L], c) for L, c in off["by_key_length"].items()]:
            mine["target_forward_ms_kernel_off"] = theirs["target_forward_ms"]
            mine["draft_ms_kernel_off"] = theirs["draft_ms"]
    costs["attention"] = "kernel" if disp is not None else "mlx"
    costs["projections"] = "kernel" if proj is not None else "mlx"
    costs["target_forward"] = "compiled" if fwd is not None else "plain"
    on_progress("done\n")
    info_att = {"kernel": "on" if disp is not None else "off", "mode": s.kernel,
            "dispatcher": disp.report() if disp is not None else None,
            "projections": proj.report() if proj is not None else None,
            "compiled_forward": fwd.report() if fwd is not None else None,
            "calls_by_method": {name: dict(c) for name, c in calls.items()} if disp is not None else None}
    report = summarize(s, methods, runs, lengths, note, drafters, padded, prewarm_s, time.perf_counter() - t_start,
                       costs, info_att)
    report["output_digests"] = sharded.output_digests(runs)
    if cluster is not None:
        report["distributed"] = sharded.section(cluster, target.model, report, runs)
    if s.paired:
        report["prompt_lengths"]["paired"] = [lengths[p][first[p]] for p in range(len(lengths))]
    if info is not None:
        report["drafter_checkpoints"] = info
    if texts is not None:
        report["prompt_lengths"]["bases"] = [len(t) for t in tokens]
        report["regimes"].update({"fresh": real.FRESH_NOTE, "warm": real.WARM_NOTE})
        report["prompts"] = {"file": s.prompts_file, "count": len(tokens), "token_lengths": [len(t) for t in tokens],
                             "tokenized": real.TOKENIZED, "chat": sum(t.chat for t in texts), "fresh_rule_holds": False,
                             "method_order": [[methods[i].name for i in row] for row in order]}
    return report

