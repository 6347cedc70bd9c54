"""Where a DFlash round's draft goes (issue 19): the block's parts, and what its bytes cost to read.

    python bench/dflash_block_profile.py --synthetic-target llama-8b --keys 4096,16384 --json out.json

The DFlash-shape drafter (``--dflash-layers`` layers of the target's width, the target's embedding and
head; benchmarks/synthetic.py) after ``keys`` context positions, warm and synchronised, median of
``--iters`` (benchmarks/kernels.py ``timed``):

- ``append_ms``: ``--new-context`` positions of target features through the fc and each layer's K/V
  into the context caches (what a round that accepted ``new_context - 1`` drafts appends), through
  ``DFlashDrafter.append_context`` as a round does (compiled where the policy compiles; so is the block);
- ``layers_ms``: the block through the layers (append + layers, less ``append_ms``);
- ``head_ms``: the final norm'd B-1 states through the shared head and the argmax;
- ``block_ms``: all of it as a greedy round drafts (kernels.dflash_block_ms, what ``mlx-spec bench`` reports:
  where the policy compiles, one call that writes a verify's ``--block`` positions of features, keeps
  ``new_context`` of them and runs the block and the head's argmax past them).

``read_bound_ms`` is what the block must read (every drafter weight, the head, the context K/V of every
layer) at the device's bandwidth, measured here by a bare copy of a ``--copy-mib`` array;
``read_share`` = read_bound_ms / block_ms, the share of the block its bytes explain (the rest:
launches, synchronisation, small kernels that do not fill the device). ``launch_ms`` is one tiny
dependent kernel's latency (a chain of ``--chain`` one-element adds), for scale.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

import mlx.core as mx
from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_speculative.hooks import attention as host_attention  # noqa: E402
from mlx_speculative.plugin import cuda  # noqa: E402
from mlx_speculative.plugin.cuda import attention, backend as cuda_backend, cuda_attention  # noqa: E402
from mlx_speculative.benchmarks import kernels, synthetic  # noqa: E402
from mlx_speculative.benchmarks.core import BenchSettings  # noqa: E402
from mlx_speculative.benchmarks.loaders import load_target  # noqa: E402


def _ints(text: str) -> List[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _bytes(module: Any) -> int:
    return sum(v.nbytes for _, v in tree_flatten(module.parameters()))


def copy_gb_s(mib: int, iters: int) -> float:
    """Device bandwidth from a bare copy (read + write) of a ``mib`` MiB bfloat16 array."""
    x = mx.zeros((mib * 2**19,), dtype=mx.bfloat16)
    mx.eval(x)
    ms = kernels.timed(lambda: x + 1, iters)
    return 2 * x.nbytes / (ms * 1e-3) / 1e9


def launch_ms(chain: int, iters: int) -> float:
    """One dependent tiny kernel's latency: a chain of ``chain`` one-element adds, per add."""
    x = mx.zeros((1,))
    mx.eval(x)

    def run() -> mx.array:
        y = x
        for _ in range(chain):
            y = y + 1
        return y

    return kernels.timed(run, iters) / chain


def profile(drafter: Any, keys: int, block: int, new_context: int, iters: int, gb_s: float) -> Dict[str, Any]:
    inner = drafter.model
    dtype = inner.norm.weight.dtype
    args = inner.args
    taps = len(args.target_layer_ids) * args.hidden_size
    caches = drafter.make_cache()
    inner.append_context((mx.random.normal((1, keys, taps)) * 0.1).astype(dtype), caches)
    new = (mx.random.normal((1, new_context, taps)) * 0.1).astype(dtype)  # [1, a+1, taps*H]
    toks = mx.array([[5] * block], dtype=mx.uint32)
    h = (mx.random.normal((1, block - 1, args.hidden_size)) * 0.1).astype(dtype)  # [1, B-1, H]
    mx.eval([c.keys for c in caches], new, h)

    def append() -> List[mx.array]:
        drafter.append_context(caches, new)  # as a round does: compiled where the policy compiles
        out = [c.keys for c in caches] + [c.values for c in caches]
        mx.eval(out)
        for c in caches:
            c.trim(new_context)
        return out

    def append_and_layers() -> mx.array:
        drafter.append_context(caches, new)
        out = drafter.block(caches, toks)  # [1, B, H]
        mx.eval(out)
        for c in caches:
            c.trim(new_context)
        return out

    append_ms = kernels.timed(append, iters)
    layers_ms = kernels.timed(append_and_layers, iters) - append_ms
    head_ms = kernels.timed(lambda: mx.argmax(drafter.head(h).astype(mx.float32), axis=-1), iters)
    block_ms = kernels.dflash_block_ms(drafter, keys, block, iters, new_context)
    kv_heads, head_dim = args.num_key_value_heads, args.head_dim or args.hidden_size // args.num_attention_heads
    kv_bytes = args.num_hidden_layers * 2 * (keys + new_context) * kv_heads * head_dim * dtype.size
    weights = {"drafter": _bytes(inner), "head": _bytes(drafter.head), "context_kv": kv_bytes}
    bound = sum(weights.values()) / (gb_s * 1e9) * 1e3
    return {"keys": keys, "block": block, "new_context": new_context, "append_ms": round(append_ms, 3),
            "layers_ms": round(layers_ms, 3), "head_ms": round(head_ms, 3), "block_ms": block_ms,
            "bytes": weights, "read_bound_ms": round(bound, 3), "read_share": round(bound / block_ms, 3)}


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--synthetic-target", default="llama-8b", help=f"one of {', '.join(synthetic.SPECS)}")
    p.add_argument("--keys", type=_ints, default=[4096, 16384], help="context positions (default 4096,16384)")
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--new-context", type=int, default=7, help="positions appended per round (default 7: tau ~6.5)")
    p.add_argument("--dflash-layers", type=int, default=5)
    p.add_argument("--padded", action="store_true", help="the padded context cache the plugin uses on CUDA")
    p.add_argument("--kernel", choices=["on", "off"], default="off",
                   help="route the drafter's attention through the project's kernel (plugin/cuda/attention.py; CUDA only)")
    p.add_argument("--plugin", action="store_true",
                   help="the drafter as the plugin runs it (the environment's backend, plugin/cuda/__init__.py "
                        "backend_for: on CUDA the padded context cache, the attention and projection kernels and "
                        "compiled calls); --padded and --kernel are then ignored")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--copy-mib", type=int, default=1024, help="size of the bandwidth probe's array")
    p.add_argument("--chain", type=int, default=200, help="adds in the launch-latency probe")
    p.add_argument("--cpu", action="store_true", help="run on the CPU (checks the script)")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    if a.cpu:
        mx.set_default_device(mx.cpu)
    target, config, note = load_target(BenchSettings(synthetic_target=a.synthetic_target))
    if a.plugin:
        policy = cuda.backend_for()
        disp = policy.attention if policy is not None else None
    else:
        if a.kernel == "on" and not cuda_attention.available():
            raise SystemExit("--kernel on: the attention kernel needs MLX built with CUDA and the GPU as the default device")
        disp = attention.Dispatcher(attention.cuda_kernel()) if a.kernel == "on" else None
        policy = cuda_backend.ShapeStablePolicy(prewarm_tokens=0, attention=disp) if a.padded else None
    drafter, desc = synthetic.dflash_drafter(target.model, config, a.block, a.dflash_layers, 2, policy)
    if a.plugin:
        host_attention.route_policy(drafter.model, policy)
    elif disp is not None:
        host_attention.route(drafter.model, disp)
    gb_s = copy_gb_s(a.copy_mib, a.iters)
    results = [profile(drafter, k, a.block, a.new_context, a.iters, gb_s) for k in a.keys]
    report = {"target": note, "drafter": desc, "device": str(mx.default_device()), "mlx": mx.__version__,
              "cache": type(policy).__name__ if a.plugin else "padded" if a.padded else "KVCache", "settings": vars(a),
              "attention": disp.report() if disp is not None else "mlx", "copy_gb_s": round(gb_s, 1),
              "launch_ms": round(launch_ms(a.chain, a.iters), 4), "results": results}
    print(json.dumps(report, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
