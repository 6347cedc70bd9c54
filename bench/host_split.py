"""Where a forward's time goes on the host and on the device (issue 19): build, encode, device.

    python bench/host_split.py --synthetic-target llama-8b --keys 4096,16384 --json out.json

MLX is lazy: a forward is first *built* (Python runs the model's code, recording the graph), then
*encoded* (``mx.async_eval``: each primitive's kernels launched from the calling thread, returning
before the device finishes), then the device runs what is queued. A one-token decode loop hides
the first two behind the previous step's device time (mlx-lm's generate_step builds step n+1
while step n runs); a speculative round cannot, since the next round needs this round's accepted
count. So for each forward this script reports, warm, median of ``--iters``:

- ``build_ms``, ``encode_ms`` (the async_eval call), ``wait_ms`` (from there until the device is done),
  ``sync_ms`` (all three: what a synchronous call costs);
- ``pipelined_ms``: per forward when each is built and encoded while the previous runs (as mlx-lm's
  loop runs): ~ max(host, device), the device's own time when the device is the slower;
- ``host_share`` = (build + encode) / sync;
- ``ops``: the graph's operations by primitive (``mx.export_to_dot``; views count too), what the encode launches
  one by one (compiled: after mx.compile's fusion, kernels of the project's dispatchers as one op each).

Forwards: the target over 1 and 16 positions after ``keys`` cached positions (the cache the plugin
uses on CUDA: padded, bucket 256, attention through the project's kernel where it takes the call);
the DFlash-shape drafter's round (7 new context positions, the 16-position block, the head's
argmax: ``kernels.dflash_round``, what ``mlx-spec bench`` times; compiled, one call drafting ahead; alone with
``--drafter-only``, by the bound on a launch's weights with ``--max-weights``); and the target's matmuls alone (each layer's seven
projections over 1 and 16 rows, chained as in a forward), which separates what 16 rows cost the
matmuls from the rest of the layer.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_speculative.hooks import attention as host_attention  # noqa: E402
from mlx_speculative.plugin.cuda import attention, backend as cuda_backend, compiled, cuda_attention, cuda_matmul, projections  # noqa: E402
from mlx_speculative.benchmarks import kernels, synthetic  # noqa: E402
from mlx_speculative.benchmarks.core import BenchSettings  # noqa: E402
from mlx_speculative.benchmarks.loaders import load_target  # noqa: E402


def _ints(text: str) -> List[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def graph_ops(outputs: Any) -> Dict[str, int]:
    """Operations in the (unevaluated) graph of ``outputs`` by primitive, most first, with their "total"."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "graph.dot"
        mx.export_to_dot(str(path), *(outputs if isinstance(outputs, (list, tuple)) else [outputs]))
        labels = re.findall(r'label\s*=\s*"([^"]+)"', path.read_text())
    ops = Counter(label.split()[0] for label in labels if not label.startswith("array"))
    return {"total": sum(ops.values()), **dict(ops.most_common())}


def split(build: Callable[[], Any], after: Callable[[], None], iters: int) -> Dict[str, Any]:
    """Median build / encode / wait / sync ms of ``build()``'s graph, the pipelined ms per call, its ops."""
    for i in range(2):
        out = build()
        if i:
            ops = graph_ops(out)
        mx.eval(out)
        after()
    mx.synchronize()
    rows = []
    for _ in range(iters):
        t0 = time.perf_counter()
        out = build()
        t1 = time.perf_counter()
        mx.async_eval(out)
        t2 = time.perf_counter()
        mx.eval(out)
        mx.synchronize()
        t3 = time.perf_counter()
        after()
        rows.append(((t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3, (t3 - t0) * 1e3))
    med = [statistics.median(r[i] for r in rows) for i in range(4)]
    mx.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        out = build()
        mx.async_eval(out)
        after()
    mx.eval(out)
    mx.synchronize()
    pipelined = (time.perf_counter() - t) * 1e3 / iters
    return {"build_ms": round(med[0], 3), "encode_ms": round(med[1], 3), "wait_ms": round(med[2], 3),
            "sync_ms": round(med[3], 3), "pipelined_ms": round(pipelined, 3),
            "host_share": round((med[0] + med[1]) / med[3], 3), "ops": ops}


def target_split(model: nn.Module, keys: int, widths: List[int], iters: int, bucket: Optional[int],
                 policy_forward: Optional[Callable[..., Any]] = None) -> Dict[str, Any]:
    cache = kernels._filled_caches(model, keys, bucket)
    out = {str(n): split(*kernels.target_step(model, cache, n, policy_forward), iters) for n in widths}
    mx.clear_cache()
    return out


def drafter_split(drafter: Any, keys: int, block: int, iters: int, new_context: int = 7) -> Dict[str, Any]:
    caches, new = kernels.dflash_context(drafter, keys, new_context)
    out = split(*kernels.dflash_round(drafter, caches, new, block), iters)
    mx.clear_cache()
    return out


def matmul_split(model: nn.Module, widths: List[int], iters: int) -> Dict[str, Any]:
    """The target's projections alone, layer after layer, over ``n`` rows."""
    layers = model.layers
    H = model.args.hidden_size
    out: Dict[str, Any] = {}
    for n in widths:
        x0 = (mx.random.normal((1, n, H)) * 0.1).astype(layers[0].self_attn.q_proj.weight.dtype)
        mx.eval(x0)

        def build() -> List[mx.array]:
            x, side = x0, []
            for layer in layers:
                a, m = layer.self_attn, layer.mlp
                side += [a.k_proj(x), a.v_proj(x)]
                x = x + a.o_proj(a.q_proj(x))
                x = x + m.down_proj(nn.silu(m.gate_proj(x)) * m.up_proj(x))
            return [x] + side

        out[str(n)] = split(build, lambda: None, iters)
    return out


_ZERO: List[mx.array] = []


class GatherLinear(nn.Linear):
    """Experiment: nn.Linear whose 2-32-row calls take MLX's gather_mm path (its own tiled kernel,
    compiled once) instead of cuBLASLt (a plan and a heuristic query on the host every call)."""

    def __call__(self, x: mx.array) -> mx.array:
        rows = x.size // x.shape[-1]
        if not 2 <= rows <= 32:
            return super().__call__(x)
        if not _ZERO:
            _ZERO.append(mx.array([0], dtype=mx.uint32))
        y = mx.gather_mm(x.reshape(1, rows, -1), self["weight"].T[None], _ZERO[0], _ZERO[0])
        y = y.reshape(*x.shape[:-1], -1)
        return y + self["bias"] if "bias" in self else y


def gather_linears(model: nn.Module, cls: type = GatherLinear) -> int:
    n = 0
    for _, m in model.named_modules():
        if type(m) in (nn.Linear, GatherLinear):
            m.__class__ = cls
            n += 1
    return n


def check_linear(model: nn.Module, widths: List[int]) -> Dict[str, float]:
    """Max |routed - matmul| of a layer's projection as the model now runs it, relative to max |matmul|."""
    out = {}
    lin = model.layers[0].mlp.gate_proj
    for n in widths:
        x = (mx.random.normal((1, n, lin.weight.shape[1])) * 0.1).astype(lin.weight.dtype)
        ref = nn.Linear.__call__(lin, x).astype(mx.float32)
        got = lin(x).astype(mx.float32)
        out[str(n)] = round((mx.abs(ref - got).max() / mx.abs(ref).max()).item(), 5)
    return out


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--synthetic-target", default="llama-8b", help=f"one of {', '.join(synthetic.SPECS)}")
    p.add_argument("--keys", type=_ints, default=[4096, 16384])
    p.add_argument("--widths", type=_ints, default=[1, 16])
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--dflash-layers", type=int, default=5)
    p.add_argument("--kernel", choices=["on", "off"], default="on")
    p.add_argument("--linear", type=lambda t: t.split(","), default=["mlx"],
                   help="comma list of mlx, gather (2-32-row projections through mx.gather_mm), kernel "
                        "(routed through plugin/cuda/projections.py), each timed in turn in this process")
    p.add_argument("--compiled", choices=["off", "on", "both"], default="off",
                   help="the target's multi-position forwards through plugin/cuda/compiled.py (mx.compile of its own "
                        "forward; both: plain and compiled in turn, rows '<linear>+compiled')")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--max-weights", type=_ints, default=[],
                   help="with --linear kernel: rows for each of these bounds on the weights one launch of named siblings "
                        "takes (hooks/attention.py project_all: 10 = a DFlash drafter's K/V of 5 layers in one; 1 = "
                        "each projection alone); default: the dispatcher's own, one row")
    p.add_argument("--staged", choices=["on", "off", "both"], default="on",
                   help="the DFlash draft queued in stages (context writes, each layer; the default) or as one graph")
    p.add_argument("--drafter-only", action="store_true", help="the DFlash round alone (no target forwards, no matmuls)")
    p.add_argument("--cpu", action="store_true", help="run on the CPU (checks the script; kernel off)")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    if a.cpu:
        mx.set_default_device(mx.cpu)
    on = a.kernel == "on" and cuda_attention.available()
    disp = attention.Dispatcher(attention.cuda_kernel()) if on else None
    target, config, note = load_target(BenchSettings(synthetic_target=a.synthetic_target))
    policy = cuda_backend.ShapeStablePolicy(prewarm_tokens=0, attention=disp)
    drafter, desc = synthetic.dflash_drafter(target.model, config, a.block, a.dflash_layers, 2, policy)
    if disp is not None:
        host_attention.route(target.model, disp)
        host_attention.route(drafter.model, disp)
    bad = [how for how in a.linear if how not in ("mlx", "gather", "kernel")]
    if bad:
        raise SystemExit(f"--linear: got {', '.join(bad)}; allowed: mlx, gather, kernel")
    if "kernel" in a.linear and not cuda_matmul.available():
        raise SystemExit("--linear kernel: the projection kernel needs MLX built with CUDA and the GPU as the default "
                         f"device; this process runs on {mx.default_device()} (allowed here: mlx, gather)")
    if a.max_weights and "kernel" not in a.linear:
        raise SystemExit(f"--max-weights: bounds the projection kernel's launches; got --linear {','.join(a.linear)} "
                         "(allowed with: --linear kernel)")
    proj = projections.Projections() if "kernel" in a.linear else None
    fwd = compiled.CompiledForward(cuda_backend.PaddedKVCache, (1, *compiled.DEFAULT_WIDTHS))  # 1: a plain step compiled

    def use(how: str) -> None:
        for model in (target.model, drafter.model):
            host_attention.unroute_projections(model)
            gather_linears(model, GatherLinear if how == "gather" else nn.Linear)
            if how == "kernel":
                host_attention.route_projections(model, proj)

    checks = {}
    for how in a.linear:
        use(how)
        checks[how] = check_linear(target.model, [2, 16, 32])
    print(checks, flush=True)

    report: Dict[str, Any] = {"linear_checks": checks, "target": note, "drafter": desc, "device": str(mx.default_device()),
                              "mlx": mx.__version__, "kernel": "on" if on else "off", "settings": vars(a),
                              "matmuls": {}, "by_keys": {}}
    for how in [] if a.drafter_only else a.linear:
        use(how)
        report["matmuls"][how] = matmul_split(target.model, a.widths, a.iters)
        print(how, json.dumps(report["matmuls"][how]), flush=True)
    for keys in a.keys:
        report["by_keys"][str(keys)] = {}
        for how in a.linear:
            use(how)
            for f in {"off": [None], "on": [fwd], "both": [None, fwd]}[a.compiled]:
                for most in a.max_weights if how == "kernel" and a.max_weights else [None]:
                    if most is not None:  # weights a launch of project_all takes; traced afresh (a new CompiledForward)
                        proj.max_weights = most
                        f = f if f is None else compiled.CompiledForward(cuda_backend.PaddedKVCache, f.widths)
                    drafter.compiler = f  # the drafter's block and context append compiled with the target's forwards
                    base = {} if a.drafter_only else {
                        "target": target_split(target.model, keys, a.widths, a.iters, cuda_backend.DEFAULT_BUCKET, f)}
                    for staged in [True] if f is None else {"on": [True], "off": [False], "both": [True, False]}[a.staged]:
                        drafter.staged = staged
                        row = {**base, "dflash_round": drafter_split(drafter, keys, a.block, a.iters)}
                        name = (how if f is None else how + "+compiled") + ("" if most is None else f" w{most}") + \
                            ("" if staged else " one graph")
                        seen = report["by_keys"][str(keys)]
                        name += f" #{sum(k.split(' #')[0] == name for k in seen) + 1}" if name in seen else ""  # a repeat
                        seen[name] = row
                        print(keys, name, json.dumps(row), flush=True)
            drafter.compiler = None
    use("mlx")
    if disp is not None:
        report["attention"] = disp.report()
    if proj is not None:
        report["projections"] = proj.report()
    if a.compiled != "off":
        report["compiled_forward"] = fwd.report()
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
