"""Where a batched decode step's time goes: plain steps and DFlash rounds of 1..8 rows, phase by phase.

    python bench/batch_trace.py [--rows 1,2,4,8] [--tau 6.0] [--max-tokens 96] [--served-steps] [--profile] [--json out.json]

Not a test; run it on the GPU machine. The synthetic Llama-3-8B-shape target (benchmarks/synthetic.py) with
the plugin's cache policy (padded caches; rows of a batch at their own lengths, compiled forwards, the
attention and projection kernels). For each row count B, B requests of different prompt lengths go through
the host's scheduler together (no HTTP):

- plain: the host's one-token steps, synchronised after each, median ms per step over mlx-lm's own caches
  (no policy) and over the policy's;
- dflash: rounds with a DFlash-shape drafter whose proposals are replaced by each request's reference
  continuation with errors injected (oracle tau), each round phase by phase with the device synchronised
  between phases (bench/round_trace.py's traced round), the first rounds (fresh shapes) apart from the rest.

``--served-steps`` adds pipelined plain steps over mlx-lm's caches and over the policy's with and without the
drafter's captures (as a server takes them without the plugin and during a pause) and synchronised verify
forwards; ``--profile`` the plugin's own rounds under cProfile (the functions with the most host time a step);
``--no-rounds`` skips the traced rounds.

``--kernel-all`` also runs each with the attention kernel taking every 1..32-query call of a batch at any key
length (MLX's attention compiles per shape).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))

import round_trace as rt  # noqa: E402
from mlx_speculative.hooks import taps  # noqa: E402
from mlx_speculative.hooks.host import GenerationParams, Host  # noqa: E402
from mlx_speculative.hooks.transaction import CacheTransaction  # noqa: E402
from mlx_speculative.hooks.manager import make_plugin_manager  # noqa: E402
from mlx_speculative.hooks.scheduler import Scheduler  # noqa: E402
from mlx_speculative.hooks.state import HostConfig, LoadedTarget  # noqa: E402
from mlx_speculative.plugin import cuda, hookimpls  # noqa: E402
from mlx_speculative.benchmarks import oracle as orc  # noqa: E402
from mlx_speculative.benchmarks import synthetic  # noqa: E402
from mlx_speculative.plugin.settings import SpeculativeSettings  # noqa: E402


def prompts(n: int, vocab: int, base: int) -> List[List[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, vocab) for _ in range(base + 37 * i)] for i in range(n)]


def started(host: Host, target: LoadedTarget, reqs: List[List[int]], max_tokens: int) -> Scheduler:
    """A scheduler with ``reqs`` submitted (greedy, no stop tokens), prefilled and joined to its batch."""
    scheduler = Scheduler(host, target)
    for p in reqs:
        scheduler.submit(p, GenerationParams(max_tokens=max_tokens, stop_token_ids=[]))
    while scheduler.prefilling or scheduler.ready:
        scheduler.step()
    return scheduler


def plain_steps(host: Host, target: LoadedTarget, reqs: List[List[int]], max_tokens: int,
                capture: Sequence[int] = (), synced: bool = True) -> Dict[str, Any]:
    """Median ms per plain step of ``len(reqs)`` rows decoding together (after the first 4): synchronised after
    each, or (``synced`` False) a whole pipelined run's wall clock over its steps, as a server takes them.
    ``capture``: every row records these layers' outputs, as rows feeding a drafter do during a pause."""
    scheduler = Scheduler(host, target)
    handles = [scheduler.submit(p, GenerationParams(max_tokens=max_tokens, stop_token_ids=[])) for p in reqs]
    while scheduler.prefilling:  # the rows' joining step is timed with the rest
        scheduler.step()
    if capture:
        taps.install_taps(target.model, capture)
        for h in handles:
            h.state.capture_layers = sorted(capture)
    times = []
    t_run = time.perf_counter()
    while scheduler.busy:
        if synced:
            mx.synchronize()
        t = time.perf_counter()
        scheduler.step()
        if synced:
            mx.synchronize()
        if scheduler.decoded and scheduler.decoded[0] == len(reqs):
            times.append((time.perf_counter() - t) * 1e3)
    if not synced:
        per = (time.perf_counter() - t_run) * 1e3 / max(1, len(times))
        return {"rows": len(reqs), "steps": len(times), "pipelined_ms": round(per, 3), "capture": list(capture)}
    rest = times[4:] or times
    return {"rows": len(reqs), "steps": len(times), "median_ms": round(statistics.median(rest), 3),
            "first_ms": [round(x, 1) for x in times[:4]], "max_ms": round(max(rest), 2), "capture": list(capture)}


def verify_forwards(host: Host, target: LoadedTarget, reqs: List[List[int]], width: int, policy: Any,
                    repeats: int = 20) -> Dict[str, Any]:
    """Median ms of one synchronised verify forward of ``len(reqs)`` rows x ``width`` positions, rolled back after
    each. The projection kernel takes the rows its dispatcher's bounds give when the model was routed (compare
    with ``MLX_SPEC_PROJECTION_KERNEL=off`` in another process)."""
    scheduler = started(host, target, reqs, 64)
    batch = scheduler.decoders[0].batch
    assert len(batch.rows) == len(reqs), (len(batch.rows), len(reqs))
    inputs = mx.array([[(7 * b + j) % 1000 + 3 for j in range(width)] for b in range(len(reqs))], dtype=mx.uint32)
    times = []
    for _ in range(repeats + 3):
        tx = CacheTransaction(batch.cache).begin()
        mx.synchronize()
        t = time.perf_counter()
        logits, _ = batch.forward(inputs)
        mx.eval(logits)
        times.append((time.perf_counter() - t) * 1e3)
        tx.abort()
    proj = policy.projections if policy is not None else None
    out = {"rows": len(reqs), "width": width, "projections": None if proj is None or not proj.enabled else
           {"rows": list(proj.rows), "quantized_rows": list(proj.quantized_rows)},
           "median_ms": round(statistics.median(times[3:]), 3)}
    print(f"verify {out}", flush=True)
    while scheduler.busy:
        scheduler.step()
    return out


def profiled_rounds(host: Host, target: LoadedTarget, reqs: List[List[int]], max_tokens: int, top: int = 25) -> Dict[str, Any]:
    """The plugin's own rounds (not traced) for ``len(reqs)`` rows decoding together, twice (the first compiles),
    the second under cProfile: wall ms per decode step and the functions with the most own time (host work;
    device waits show up in whatever synchronises)."""
    import cProfile
    import pstats

    out: Dict[str, Any] = {"rows": len(reqs)}
    for run in ("warm-up", "profiled"):
        scheduler = started(host, target, reqs, max_tokens)
        prof, steps = cProfile.Profile(), 0
        mx.synchronize()
        t = time.perf_counter()
        if run == "profiled":
            prof.enable()
        while scheduler.busy:
            scheduler.step()
            steps += 1
        mx.synchronize()
        prof.disable()
        out[f"{run}_ms_per_step"] = round((time.perf_counter() - t) * 1e3 / max(1, steps), 3)
    stats = pstats.Stats(prof)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]  # by own time
    out["steps"] = steps
    out["own_ms_per_step"] = [{"function": f"{Path(f).name}:{line} {name}", "calls_per_step": round(nc / max(1, steps), 2),
                               "own_ms": round(tt * 1e3 / max(1, steps), 3), "cumulative_ms": round(ct * 1e3 / max(1, steps), 3)}
                              for (f, line, name), (_, nc, tt, ct, _) in rows]
    print(f"profile rows {len(reqs)}: {out['profiled_ms_per_step']} ms a step", flush=True)
    for r in out["own_ms_per_step"][:12]:
        print(f"   {r['own_ms']:8.3f} ms own {r['cumulative_ms']:8.3f} cum {r['calls_per_step']:7.2f} calls  {r['function']}")
    return out


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--synthetic-target", default="llama-8b", choices=list(synthetic.SPECS))
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--tau", type=float, default=6.0)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--prompt-length", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--kernel-all", action="store_true")
    ap.add_argument("--served-steps", action="store_true",
                    help="also: pipelined plain steps with and without the drafter's captures, synchronised "
                         "verify forwards")
    ap.add_argument("--no-rounds", action="store_true", help="skip the traced DFlash rounds")
    ap.add_argument("--profile", action="store_true", help="also: the plugin's own rounds (adaptive) under cProfile")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    config = synthetic.config_for(args.synthetic_target)
    model = synthetic.build(config)
    vocab = config["vocab_size"]
    reqs = prompts(max(rows), vocab, args.prompt_length)
    report: Dict[str, Any] = {"command": "python bench/batch_trace.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                              "device": str(mx.default_device()), "mlx": mx.__version__, "plain": [], "dflash": []}

    # plain: mlx-lm's caches, then the policy's
    stock = LoadedTarget(model=model, tokenizer=None, path=Path("synthetic"), model_config=config, name="stock")
    plain_host = Host(HostConfig(), pm=make_plugin_manager(False))
    refs = {tuple(p): plain_host.generate(stock, p, GenerationParams(max_tokens=args.max_tokens, stop_token_ids=[])).tokens
            for p in reqs}
    for b in rows:
        row = plain_steps(plain_host, stock, reqs[:b], args.max_tokens)
        report["plain"].append({"caches": "mlx-lm", **row})
        print(f"plain mlx-lm {row}", flush=True)
        if args.served_steps:  # as a server without the plugin takes them: the policy's pipelined steps' baseline
            row = plain_steps(plain_host, stock, reqs[:b], args.max_tokens, synced=False)
            report["plain"].append({"caches": "mlx-lm, pipelined", **row})
            print(f"plain mlx-lm pipelined {row}", flush=True)
    policy = cuda.backend_for()
    drafter, _ = synthetic.dflash_drafter(model, config, args.block, 5, 2, policy)
    ora = orc.Oracle(orc.alpha_for_tau(args.tau, args.block), vocab)
    for p in reqs:
        ora.register(p, refs[tuple(p)])
    target = LoadedTarget(model=model, tokenizer=None, path=Path("synthetic"), model_config=config, name="policy")
    settings = SpeculativeSettings(enabled=True, kind="dflash", block_size=args.block, adaptive=False)
    if policy is not None:
        policy.block_size = args.block
        policy.capture_layers = tuple(drafter.capture_layers())
    target.attachments[hookimpls.NAME] = hookimpls.Attachment(
        settings=settings, drafter=orc.WrappedDrafter(drafter, ora), block_size=args.block, policy=policy)
    host = Host(HostConfig(), pm=make_plugin_manager(False, [rt.TracedPlugin()]))
    t0 = time.perf_counter()
    host.apply_policy(target, policy)
    report["prewarm_s"] = round(time.perf_counter() - t0, 1)
    variants = ["measured"] + (["kernel-all"] if args.kernel_all and policy is not None and policy.attention else [])
    for variant in variants:
        if variant == "kernel-all":
            policy.attention.min_keys = {"mlx-mask": 0, "array": 0}
            policy.attention.min_queries = 1
        for b in rows:
            row = plain_steps(Host(HostConfig(), pm=make_plugin_manager(False, [hookimpls])), _plain_target(target, policy),
                              reqs[:b], args.max_tokens)
            report["plain"].append({"caches": f"policy ({variant})", **row})
            print(f"plain policy {variant} {row}", flush=True)
            if args.served_steps:
                layers = tuple(sorted(set(drafter.capture_layers())))
                for cap in ((), layers):
                    row = plain_steps(Host(HostConfig(), pm=make_plugin_manager(False, [hookimpls])),
                                      _plain_target(target, policy), reqs[:b], args.max_tokens, cap, synced=False)
                    report["plain"].append({"caches": f"policy ({variant}), pipelined", **row})
                    print(f"plain policy pipelined {row}", flush=True)
                report.setdefault("verify", []).append(verify_forwards(
                    Host(HostConfig(), pm=make_plugin_manager(False, [hookimpls])), _plain_target(target, policy),
                    reqs[:b], args.block, policy))
            if args.profile:
                prof_target = LoadedTarget(model=model, tokenizer=None, path=Path("synthetic"), model_config=config, name="prof")
                prof_target.cache_policy = target.cache_policy
                prof_target.attachments[hookimpls.NAME] = hookimpls.Attachment(
                    settings=SpeculativeSettings(enabled=True, kind="dflash", block_size=args.block), drafter=orc.WrappedDrafter(drafter, ora),
                    block_size=args.block, policy=policy)
                report.setdefault("profile", []).append(profiled_rounds(
                    Host(HostConfig(), pm=make_plugin_manager(False, [hookimpls])), prof_target, reqs[:b], args.max_tokens))
            if args.no_rounds:
                continue
            for regime in ("fresh", "warm"):
                rt.TRACE.clear()
                scheduler = Scheduler(host, target)
                submitted = [scheduler.submit(p, GenerationParams(max_tokens=args.max_tokens, stop_token_ids=[]))
                             for p in reqs[:b]]
                t = time.perf_counter()
                while scheduler.busy:
                    scheduler.step()
                wall = time.perf_counter() - t
                same = all(r.state.tokens[r.state.prompt_len:] == refs[tuple(p)] for r, p in zip(submitted, reqs[:b]))
                batch_rounds = [r for r in rt.TRACE if r["width"]]
                s = rt.summarise(f"dflash {variant} {regime} rows {b}", batch_rounds or rt.TRACE)
                report["dflash"].append({"variant": variant, "regime": regime, "rows": b, "identical": same,
                                         "tokens_per_s_traced": round(b * args.max_tokens / wall, 1), **s})
    mx.synchronize()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    return 0


def _plain_target(target: LoadedTarget, policy: Any) -> LoadedTarget:
    """The same model and policy, speculation off: the host's plain steps over the policy's caches."""
    plain = LoadedTarget(model=target.model, tokenizer=None, path=target.path, model_config=target.model_config,
                         name="plain")
    plain.cache_policy = policy if policy is not None else plain.cache_policy
    plain.attachments[hookimpls.NAME] = hookimpls.Attachment(settings=SpeculativeSettings(enabled=False), policy=policy)
    return plain


if __name__ == "__main__":
    raise SystemExit(main())
