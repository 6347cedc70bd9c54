"""Bare forwards with the attention kernel on and off (issue 19): the target by positions, the DFlash block.

    python bench/attention_forwards.py --synthetic-target llama-8b --keys 4096,16384 --json out.json
    python bench/attention_forwards.py --synthetic-target llama-8b --quantize-target 4 --json out-4bit.json

Warm shapes, synchronous, median of ``--iters`` (benchmarks/kernels.py: the forward and its
log-softmax rows after ``keys`` cached positions, trimmed back after each call), with the cache the
plugin uses on CUDA (``--cache padded``: bucket 256, described masks) or mlx-lm's (``--cache kvcache``:
"causal"). The target and the DFlash-shape drafter (``--dflash-layers`` layers of the target's width,
block ``--block``) are routed through the dispatcher (plugin/cuda/attention.py) once; ``off`` disables it
(MLX's attention), ``on`` enables it with its thresholds (``--min-keys`` overrides them). The drafter's
block is timed with a padded context cache (the plugin's on CUDA) and with mlx-lm's KVCache. Every
entry records the dispatcher's calls by path, so the JSON shows which path ran. Without MLX-CUDA only
``off`` runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_speculative.drafters.dflash import DFlashDrafter  # noqa: E402
from mlx_speculative.hooks import attention as host_attention  # noqa: E402
from mlx_speculative.plugin.cuda import attention, backend as cuda_backend, cuda_attention  # noqa: E402
from mlx_speculative.benchmarks import kernels, synthetic  # noqa: E402
from mlx_speculative.benchmarks.core import BenchSettings  # noqa: E402
from mlx_speculative.benchmarks.loaders import load_target  # noqa: E402


def _ints(text: str) -> List[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--synthetic-target", default="llama-8b", help=f"one of {', '.join(synthetic.SPECS)}")
    p.add_argument("--model", help="a checkpoint instead of the synthetic target")
    p.add_argument("--quantize-target", type=int, choices=[4, 8], help="quantize the target's weights (group 64)")
    p.add_argument("--keys", type=_ints, default=[4096, 16384], help="cached key lengths (default 4096,16384)")
    p.add_argument("--widths", type=_ints, default=[1, 2, 4, 8, 16, 32], help="positions per forward")
    p.add_argument("--cache", choices=["padded", "kvcache"], default="padded", help="the target's cache (default padded)")
    p.add_argument("--kernel", choices=["both", "on", "off"], default="both", help="which settings to time (default both)")
    p.add_argument("--min-keys", type=int, help="the dispatcher's key threshold for every mask kind (default: its own)")
    p.add_argument("--block", type=int, default=16, help="the DFlash block (default 16; 0: no drafter)")
    p.add_argument("--dflash-layers", type=int, default=5)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--cpu", action="store_true", help="run on the CPU (checks the script; kernel off only)")
    p.add_argument("--stand-in", action="store_true",
                   help="the kernel's float32 pure-MLX reference in its place (checks the wiring anywhere; "
                        "its times mean nothing)")
    p.add_argument("--json", help="write the results here")
    return p.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    a = parse(argv)
    if a.cpu:
        mx.set_default_device(mx.cpu)
    settings = ["off", "on"] if a.kernel == "both" else [a.kernel]
    if "on" in settings and not (cuda_attention.available() or a.stand_in):
        if a.kernel == "on":
            raise SystemExit("--kernel on: the attention kernel needs MLX built with CUDA and the GPU as the default device")
        settings = ["off"]
    min_keys = {k: a.min_keys for k in attention.MIN_KEYS} if a.min_keys is not None else None
    kernel = attention.Kernel("reference", cuda_attention.reference, None, None) if a.stand_in else attention.cuda_kernel()
    disp = attention.Dispatcher(kernel, min_keys=min_keys)
    s = BenchSettings(synthetic_target=None if a.model else a.synthetic_target, model=a.model,
                      quantize_bits=a.quantize_target)
    target, config, note = load_target(s)
    bucket = cuda_backend.DEFAULT_BUCKET if a.cache == "padded" else None
    policy = cuda_backend.ShapeStablePolicy(prewarm_tokens=0, attention=disp)
    host_attention.route(target.model, disp)
    drafters: Dict[str, Any] = {}
    if a.block:
        padded_drafter, desc = synthetic.dflash_drafter(target.model, config, a.block, a.dflash_layers, 2, policy)
        host_attention.route(padded_drafter.model, disp)
        drafters = {"padded": padded_drafter, "kvcache": DFlashDrafter(padded_drafter.model, padded_drafter.embed,
                                                                          padded_drafter.head, None)}
        note += f"; drafter {desc}"
    results: List[Dict[str, Any]] = []
    for keys in a.keys:
        for setting in settings:
            disp.enabled = setting == "on"
            disp.counts.clear()
            t = time.perf_counter()
            fwd = kernels.target_forward_ms(target.model, keys, a.widths, a.iters, bucket)
            ms = {w: v["ms"] for w, v in fwd.items()}
            row: Dict[str, Any] = {"keys": keys, "kernel": setting, "cache": a.cache,
                                   "target_forward_ms": {str(w): v for w, v in ms.items()},
                                   "ratio_vs_1_position": {str(w): round(v / ms[1], 3) for w, v in ms.items()} if 1 in ms else {},
                                   "target_calls": dict(disp.counts)}
            for name, drafter in drafters.items():
                disp.counts.clear()
                row[f"dflash_block_ms_{name}_context"] = kernels.dflash_block_ms(drafter, keys, a.block, a.iters)
                row[f"dflash_calls_{name}_context"] = dict(disp.counts)
            row["seconds"] = round(time.perf_counter() - t, 1)
            results.append(row)
            print(json.dumps(row), flush=True)
    report = {"target": note, "device": str(mx.default_device()), "mlx": getattr(mx, "__version__", "?"),
              "dispatcher": {"kernel": kernel.name, "min_keys": disp.min_keys, "queries": [disp.min_queries, disp.max_queries]},
              "settings": vars(a), "results": results}
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
