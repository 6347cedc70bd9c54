"""Where a verify forward's time goes: matmul by width and weight layout, attention, whole forwards.

    python bench/verify_cost.py [--spec llama-8b] [--key-length 1024] [--json out.json]

Builds the synthetic target (benchmarks/synthetic.py) in memory and times, warm and synchronised
(median of ``--iters``): each weight shape's ``x @ W.T`` for 1..32 rows (as mlx-lm's Linear runs it)
and against a pre-transposed copy; attention for 1 and 16 queries; the whole target forward (and its
log-softmax) for 1..32 positions after ``--key-length`` cached positions, with ``KVCache`` and the
padded cache; and the DFlash-shape drafter's block forward (benchmarks/kernels.py, as the bench's
kernel bound times them). Run it on the GPU machine; CPU figures only check it runs.
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
from mlx_speculative.hooks.api import draft_backend  # noqa: E402
from mlx_speculative.plugin.cuda import backend as cuda_backend  # noqa: E402
from mlx_speculative.benchmarks import kernels, synthetic  # noqa: E402
from mlx_speculative.benchmarks.kernels import timed  # noqa: E402


def matmuls(config: Dict[str, Any], widths: List[int], iters: int, dtype: mx.Dtype) -> List[Dict[str, Any]]:
    h, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    kv = config["num_key_value_heads"] * config.get("head_dim", h // config["num_attention_heads"])
    shapes = {"q/o": (h, h), "k/v": (kv, h), "gate/up": (f, h), "down": (h, f), "lm_head": (v, h)}
    rows = []
    for name, (out, inp) in shapes.items():
        w = (mx.random.normal((out, inp)) * 0.02).astype(dtype)
        wt = mx.contiguous(w.T)
        mx.eval(w, wt)
        gb = out * inp * w.itemsize / 1e9
        for m in widths:
            x = mx.random.normal((1, m, inp)).astype(dtype)
            mx.eval(x)
            ms = timed(lambda: x @ w.T, iters)
            ms_t = timed(lambda: x @ wt, iters)
            rows.append({"weight": name, "shape": [out, inp], "rows": m, "ms": round(ms, 4), "ms_pretransposed": round(ms_t, 4),
                         "GB_s": round(gb / (ms / 1e3), 1)})
            print(f"matmul {name:8s} {out}x{inp} rows {m:3d}: {ms:7.3f} ms ({gb / (ms / 1e3):7.1f} GB/s)  pre-transposed {ms_t:7.3f} ms", flush=True)
    return rows


def attention(config: Dict[str, Any], key_length: int, iters: int, dtype: mx.Dtype) -> List[Dict[str, Any]]:
    heads, kvh = config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim", config["hidden_size"] // heads)
    rows = []
    k = mx.random.normal((1, kvh, key_length, d)).astype(dtype)
    v = mx.random.normal((1, kvh, key_length, d)).astype(dtype)
    for n in (1, 2, 16):
        q = mx.random.normal((1, heads, n, d)).astype(dtype)
        mask = mx.arange(key_length)[None] <= (key_length - n + mx.arange(n))[:, None]  # [n, K]
        mx.eval(q, k, v, mask)
        scale = d ** -0.5
        variants = {
            "none": lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale),
            "bool mask": lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask),
        }
        if n > 1:
            variants["causal"] = lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")
        for name, fn in variants.items():
            ms = timed(fn, iters)
            rows.append({"queries": n, "keys": key_length, "mask": name, "ms": round(ms, 4)})
            print(f"attention q {n:2d} k {key_length} {name:9s}: {ms:7.3f} ms", flush=True)
    return rows


def forwards(model: Any, key_length: int, widths: List[int], iters: int) -> List[Dict[str, Any]]:
    rows = []
    for cache_name, bucket in (("KVCache", None), ("padded", cuda_backend.DEFAULT_BUCKET)):
        for n, r in kernels.target_forward_ms(model, key_length, widths, iters, bucket).items():
            rows.append({"cache": cache_name, "positions": n, "keys": key_length, **r})
            print(f"forward {cache_name:7s} positions {n:2d} after {key_length}: {r['ms']:7.3f} ms "
                  f"(graph build {r['build_ms']:.3f} ms)", flush=True)
    return rows


def drafter_forward(model: Any, config: Dict[str, Any], key_length: int, iters: int) -> List[Dict[str, Any]]:
    """A DFlash round's draft: 7 new context positions (tau ~6.5) + a block through the drafter + the head."""
    plain, desc = synthetic.dflash_drafter(model, config)
    # The same drafter weights with the shape-stable policy: padded context caches, as on CUDA.
    policy = cuda_backend.ShapeStablePolicy(cuda_backend.DEFAULT_BUCKET, prewarm_tokens=0)
    padded = DFlashDrafter(plain.model, plain.embed, plain.head, draft_backend(policy))
    rows = []
    for cache_name, drafter in (("KVCache", plain), ("padded", padded)):
        for block in (2, 4, 8, 16):
            ms = kernels.dflash_block_ms(drafter, key_length, block, iters)
            rows.append({"cache": cache_name, "block": block, "context": key_length, "ms": ms, "drafter": desc})
            print(f"drafter {cache_name:7s} block {block:2d} context {key_length} (+7 new): {ms:7.3f} ms", flush=True)
    return rows


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default="llama-8b", choices=sorted(synthetic.SPECS))
    parser.add_argument("--key-length", type=int, default=1024)
    parser.add_argument("--widths", default="1,2,4,8,16,32")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--skip", default="", help="comma list of parts to skip: matmul,attention,forward,drafter")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    widths = [int(w) for w in args.widths.split(",")]
    skip = set(filter(None, args.skip.split(",")))
    config = synthetic.config_for(args.spec)
    dtype = getattr(mx, config["torch_dtype"])
    result: Dict[str, Any] = {"spec": args.spec, "device": str(mx.default_device()), "mlx": mx.__version__,
                              "key_length": args.key_length}
    if "matmul" not in skip:
        result["matmul"] = matmuls(config, widths, args.iters, dtype)
    if "attention" not in skip:
        result["attention"] = attention(config, args.key_length, args.iters, dtype)
    if not {"forward", "drafter"} <= skip:
        t = time.perf_counter()
        model = synthetic.build(config)
        print(f"built {args.spec} in {time.perf_counter() - t:.1f} s", flush=True)
        if "forward" not in skip:
            result["forward"] = forwards(model, args.key_length, widths, args.iters)
        if "drafter" not in skip:
            result["drafter"] = drafter_forward(model, config, args.key_length, args.iters)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
