"""This checkout's host and plugin against an older checkout's, in ONE process, runs alternating.

Not a test. Whole runs of ``mlx-spec bench`` on one machine drift by +-30% from run to run (the
same mlx-lm code included), which hides small differences between two code versions. Here both
versions decode the same synthetic target (one model in memory) with the same methods, run after
run, alternating old and new for each prompt, so the ratio of each adjacent pair compares them
under the same conditions. The old checkout is imported as the package ``mlx_speculative_old``
(its hooks/, plugin/ and drafters/ under ``--old-root``; they import each other relatively).

Methods: plain host decoding (mlx-lm's KVCache; on CUDA also the shape-stable padded caches) and
DFlash rounds (a DFlash-shape drafter, oracle acceptance, block 16), both versions as they run on
the backend. Regimes as in ``mlx-spec bench``: fresh (key lengths no run met before) and warm.

    python bench/engine_ab.py --old-root /tmp/oldpkg --synthetic-target llama-8b --pairs 3 --json out.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_speculative.hooks.state import LoadedTarget
from mlx_speculative.plugin import cuda
from mlx_speculative.plugin.cuda import backend as cuda_backend
from mlx_speculative.benchmarks import methods as new_methods
from mlx_speculative.benchmarks import synthetic


class Version:
    """One code version's plain and DFlash host methods on the shared target."""

    def __init__(self, name: str, model: Any, config: Dict[str, Any], block: int, tau: float, padded: bool, bucket: int):
        self.name = name
        vocab = int(config["vocab_size"])
        if name == "new":
            target = LoadedTarget(model=model, tokenizer=None, path=Path("synthetic"), model_config=config, name="synthetic")
            policy = cuda_backend.ShapeStablePolicy(bucket, prewarm_tokens=0) if padded else None
            drafter, _ = synthetic.dflash_drafter(model, config, block, 5, 2, policy)
            self.methods = {"plain": new_methods.HostMethod(target, "plain", None),
                            "plain padded": new_methods.HostMethod(target, "plain padded", policy) if padded else None,
                            "dflash": new_methods.HostMethod(target, "dflash", policy, drafter, block, tau, False, vocab)}
            self.reference = lambda p, n: new_methods.reference(target, p, n, policy)
            self.policy, self.drafter = policy, drafter
        else:
            core = importlib.import_module("mlx_speculative_old.plugin.bench.core")
            state = importlib.import_module("mlx_speculative_old.hooks.state")
            old_synthetic = importlib.import_module("mlx_speculative_old.plugin.bench.synthetic")
            target = state.LoadedTarget(model=model, tokenizer=None, path=Path("synthetic"), model_config=config,
                                        name="synthetic")
            drafter, _ = old_synthetic.dflash_drafter(model, config, block, 5, 2)
            if padded:
                drafter.cache_bucket = bucket
            self.methods = {"plain": core.HostMethod(target, "plain", False, bucket),
                            "plain padded": core.HostMethod(target, "plain padded", True, bucket) if padded else None,
                            "dflash": core.HostMethod(target, "dflash", padded, bucket, drafter, block, tau, False, vocab)}
            self.reference = lambda p, n: core.reference(target, p, n, padded, bucket)
            self.policy, self.drafter = None, drafter
        self.methods = {k: v for k, v in self.methods.items() if v is not None}


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old-root", required=True, help="folder holding mlx_speculative_old/{hooks,plugin,drafters}")
    ap.add_argument("--synthetic-target", default="tiny", choices=list(synthetic.SPECS))
    ap.add_argument("--pairs", type=int, default=3, help="old/new pairs per prompt and regime")
    ap.add_argument("--prompt-lengths", default="512,1024")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--tau", type=float, default=6.5)
    ap.add_argument("--bucket", type=int, default=256)
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.cpu:
        mx.set_default_device(mx.cpu)
    sys.path.insert(0, str(Path(args.old_root).resolve()))
    padded = cuda.padded_on()
    config = synthetic.config_for(args.synthetic_target)
    model = synthetic.build(config)
    # A second model object on the same weight arrays: each version taps its own layer instances
    # (the hidden-state taps swap the layers' classes, each version with its own recorder).
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    twin = model_class(args_class.from_dict(config))  # its own random init stays lazy: never computed
    twin.load_weights(tree_flatten(model.parameters()))
    versions = {"old": Version("old", twin, config, args.block, args.tau, padded, args.bucket),
                "new": Version("new", model, config, args.block, args.tau, padded, args.bucket)}
    bases = [int(x) for x in args.prompt_lengths.split(",")]
    stride = args.max_tokens + 2 * args.block + 8
    runs_per_base = 2 * args.pairs * len(versions["new"].methods)  # both regimes: fresh lengths for each run
    lengths = new_methods.allocate_lengths(bases, runs_per_base, stride)
    top = max(max(r) for r in lengths) + stride
    stream = [(7 + 13 * i) % (config["vocab_size"] - 3) + 2 for i in range(top)]
    if padded:
        new = versions["new"]
        new.policy.prewarm_tokens = top
        new.policy.prewarm(model, args.block)
        importlib.import_module("mlx_speculative.drafters.dflash").prewarm(new.drafter, top, args.block)
        importlib.import_module("mlx_speculative_old.drafters.dflash").prewarm(versions["old"].drafter, top, args.block)
    warm = stream[: max(8, min(bases) // 4)]
    for v in versions.values():  # warm-up: every method once, shorter than any timed prompt
        ref = v.reference(warm, 16)
        for m in v.methods.values():
            m.run(warm, 16, ref, 0)
    results: List[Dict[str, Any]] = []
    for b, base in enumerate(bases):
        fresh_lengths = iter(lengths[b])
        for regime in ("fresh", "warm"):
            for method in versions["new"].methods:
                for pair in range(args.pairs):
                    # fresh: each run its own length; warm: one length, run before by both
                    L = next(fresh_lengths) if regime == "fresh" else lengths[b][0]
                    prompt = stream[:L]
                    ref = versions["new"].reference(prompt, args.max_tokens) if method == "dflash" else None
                    tok_s = {}
                    order = ("old", "new") if pair % 2 == 0 else ("new", "old")  # alternate who goes first
                    for name in order:
                        mx.clear_cache()
                        r = versions[name].methods[method].run(prompt, args.max_tokens, ref, 1000 * b + pair)
                        tok_s[name] = r.tok_s
                        if ref is not None:
                            assert r.tokens == ref.tokens or name == "old", "new code diverged from the reference"
                    results.append({"base": base, "regime": regime, "method": method, "pair": pair, "prompt_len": L,
                                    "old_tok_s": round(tok_s["old"], 2), "new_tok_s": round(tok_s["new"], 2),
                                    "ratio": round(tok_s["new"] / tok_s["old"], 4)})
                    print(json.dumps(results[-1]), flush=True)
    summary: Dict[str, Any] = {}
    for regime in ("fresh", "warm", "all"):
        for method in versions["new"].methods:
            ratios = [r["ratio"] for r in results if r["method"] == method and regime in ("all", r["regime"])]
            summary[f"{regime} {method}"] = {"median_new_over_old": round(statistics.median(ratios), 4),
                                             "min": min(ratios), "max": max(ratios), "pairs": len(ratios)}
    for k, v in summary.items():
        print(f"{k:24} median new/old {v['median_new_over_old']:.3f} (min {v['min']:.3f}, max {v['max']:.3f}, {v['pairs']} pairs)")
    if args.json:
        args.json.write_text(json.dumps({
            "command": "python bench/engine_ab.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "device": str(mx.default_device()), "backend": cuda.device(), "mlx": mx.__version__,
            "platform": platform.platform(), "padded": padded, "target": args.synthetic_target,
            "summary": summary, "pairs": results, "when": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
