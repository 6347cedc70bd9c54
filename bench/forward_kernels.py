"""Each kernel of a forward on the device, by Nsight Compute (issue 19: what a 16-position forward costs over one).

    ncu --profile-from-start off --clock-control none --cache-control none --metrics gpu__time_duration.sum \
        --print-units base --csv --log-file k.csv python bench/forward_kernels.py --windows w.json
    python bench/forward_kernels.py --summarise k.csv --windows w.json --json out.json

The first run warms each forward of bench/host_split.py's setup (the Llama-3-8B-shape synthetic target as the
plugin runs it on CUDA: padded cache, the attention and projection kernels, compiled verify forwards; the
DFlash-shape drafter's round, drafting ahead), then runs each once inside a profiler window (cuProfilerStart /
cuProfilerStop), behind a marker kernel that names the window in ncu's list, and writes the windows' order.
ncu times every kernel of the windows alone (serialised: no overlap, no launch gaps), so a window's sum is
the device's own work, without what its launches and the host add; host_split.py's ``wait``/``pipelined``
give the rest. The second run sums the kernels by group (projections, attention, norms, rope, cache writes,
the rest) and reports the projections' bytes per second: where 16 positions cost more than one.
``--shapes``: instead, each projection shape of the 8B llama (and a DFlash fc) alone, one launch per window for
MLX's own matmul and each kernel shape of ``--variants`` (plugin/cuda/cuda_matmul.py's (G, S, U[, PIPE])), its weight
out of the L2, over ``--rows``; a window's bytes per second is its weight's over its one kernel.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import json
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import mlx.core as mx
from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_speculative.benchmarks import _ints  # noqa: E402 - the bench CLI's own list parser (clear errors)

MARK = "forward_kernels_window"
GROUPS: List[Tuple[str, str]] = [  # (group, regex over the lower-cased kernel name), first match wins
    ("window marker", MARK),
    ("projections", r"spec_mm|spec_qmm|gemv|gemm|cublas|cutlass|nvjet|sm90_xmma|matmul|qmv|qmm"),
    ("attention", r"spec_attn|sdpa|attention|flash"),
    ("norms", r"rms|layer_?norm"),
    ("rope", r"rope"),
    ("cache writes", r"scatter|slice_update|put_along"),
    ("reductions", r"softmax|logsumexp|reduce|arg_?reduce|argmax"),
    ("copies", r"copy|concatenate"),
]
UNITS = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6, "ns": 1e-3, "us": 1.0, "ms": 1e3}


def group_of(name: str) -> str:
    low = name.lower()
    return next((g for g, rx in GROUPS if re.search(rx, low)), "other")


def short_name(name: str) -> str:
    """A kernel's name without template arguments and parameters."""
    depth, out = 0, []
    for ch in name:
        depth += ch in "<("
        if depth == 0:
            out.append(ch)
        depth -= ch in ">)" and depth > 0
    return "".join(out).strip() or name


def read_ncu_csv(path: Path) -> List[Tuple[str, float]]:
    """(kernel name, device us) per profiled kernel, in launch order, from ncu's --csv log."""
    lines = path.read_text(errors="replace").splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        raise SystemExit(f"{path}: no ncu CSV header (a line starting with \"ID\"); is it ncu's --csv --log-file?")
    out: Dict[int, Tuple[str, float]] = {}
    for row in csv.DictReader(lines[start:]):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        unit = (row.get("Metric Unit") or "nsecond").strip()
        if unit not in UNITS:
            raise SystemExit(f"{path}: metric unit {unit!r}; allowed: {', '.join(UNITS)}")
        value = float(row["Metric Value"].replace(",", ""))
        out[int(row["ID"])] = (row["Kernel Name"], value * UNITS[unit])
    return [out[i] for i in sorted(out)]


def summarise(kernels: List[Tuple[str, float]], windows: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The kernels split at the markers into ``windows`` (in order), each summed by group and by name."""
    parts: List[List[Tuple[str, float]]] = []
    for name, us in kernels:
        if MARK in name:
            parts.append([])
        elif parts:
            parts[-1].append((name, us))
    if len(parts) != len(windows):
        raise SystemExit(f"ncu log: {len(parts)} windows marked; the run wrote {len(windows)}")
    out = {}
    for w, part in zip(windows, parts):
        groups: Dict[str, List[float]] = defaultdict(lambda: [0, 0.0])
        names: Dict[str, List[float]] = defaultdict(lambda: [0, 0.0])
        for name, us in part:
            for table, key in ((groups, group_of(name)), (names, short_name(name))):
                table[key][0] += 1
                table[key][1] += us
        total = sum(us for _, us in part)
        row: Dict[str, Any] = {**w, "kernels": len(part), "device_ms": round(total / 1e3, 3),
                               "groups": {g: {"kernels": int(n), "ms": round(us / 1e3, 3), "share": round(us / total, 3)}
                                          for g, (n, us) in sorted(groups.items(), key=lambda kv: -kv[1][1])},
                               "names": {k: {"kernels": int(n), "us": round(us, 1)}
                                         for k, (n, us) in sorted(names.items(), key=lambda kv: -kv[1][1])[:25]}}
        proj = groups.get("projections")
        if w.get("shape") and total:  # one projection alone (--shapes): its bytes over the whole window
            row["tb_s"] = round(w["weight_bytes"] / (total * 1e-6) / 1e12, 2)
        elif proj and w.get("weight_bytes"):
            row["projection_tb_s"] = round(w["weight_bytes"] / (proj[1] * 1e-6) / 1e12, 2)
        out[w["name"]] = row
    return out


def _driver() -> Any:
    lib = ctypes.CDLL("libcuda.so.1")
    ctx, dev = ctypes.c_void_p(), ctypes.c_int()
    # MLX-CUDA runs on device 0's primary context: made current here, so that the profiler calls reach it
    for call, args in (("cuInit", (0,)), ("cuDeviceGet", (ctypes.byref(dev), 0)),
                       ("cuDevicePrimaryCtxRetain", (ctypes.byref(ctx), dev)), ("cuCtxSetCurrent", (ctx,))):
        rc = getattr(lib, call)(*args)
        if rc:
            raise SystemExit(f"{call}: CUDA error {rc}")
    return lib


class Windows:
    """Profiler windows, each behind a marker kernel, and their names in order (for ``summarise``)."""

    def __init__(self) -> None:
        self.lib = _driver()
        self.mark = mx.fast.cuda_kernel(name=MARK, input_names=["x"], output_names=["y"], source="y[0] = x[0];")
        self.one = mx.zeros((1,), mx.float32)
        self.rows: List[Dict[str, Any]] = []

    def __call__(self, name: str, build: Callable[[], Any], undo: Callable[[], None] = lambda: None,
                 before: Callable[[], None] = lambda: None, **info: Any) -> None:
        for _ in range(3):  # warm: traced, compiled and every kernel loaded before the window
            mx.eval(build())
            undo()
        before()
        mx.synchronize()
        self.lib.cuProfilerStart()
        mx.eval(self.mark(inputs=[self.one], grid=(1, 1, 1), threadgroup=(1, 1, 1), output_shapes=[(1,)],
                          output_dtypes=[mx.float32])[0])
        mx.eval(build())
        mx.synchronize()
        self.lib.cuProfilerStop()
        undo()
        self.rows.append({"name": name, **info})
        print("window", name, flush=True)


def run(a: argparse.Namespace) -> List[Dict[str, Any]]:
    """The forwards' windows: the target over each width at each key length, the DFlash round."""
    from mlx_speculative.hooks import attention as host_attention
    from mlx_speculative.plugin.cuda import attention, backend as cuda_backend, compiled, projections
    from mlx_speculative.benchmarks import kernels, synthetic
    from mlx_speculative.benchmarks.core import BenchSettings
    from mlx_speculative.benchmarks.loaders import load_target

    disp = attention.Dispatcher(attention.cuda_kernel())
    target, config, _ = load_target(BenchSettings(synthetic_target=a.synthetic_target))
    policy = cuda_backend.ShapeStablePolicy(prewarm_tokens=0, attention=disp)
    drafter, desc = synthetic.dflash_drafter(target.model, config, a.block, a.dflash_layers, 2, policy)
    proj = projections.Projections()
    for model in (target.model, drafter.model):
        host_attention.route(model, disp)
        host_attention.route_projections(model, proj)
    fwd = compiled.CompiledForward(cuda_backend.PaddedKVCache)
    drafter.compiler = fwd
    window = Windows()
    weights = _read_bytes(target.model)
    for keys in a.keys:
        cache = kernels._filled_caches(target.model, keys, cuda_backend.DEFAULT_BUCKET)
        for n in a.widths:
            window(f"target {n} @ {keys}", *kernels.target_step(target.model, cache, n, fwd), keys=keys, weight_bytes=weights)
        del cache
        caches, new = kernels.dflash_context(drafter, keys)
        window(f"dflash round @ {keys}", *kernels.dflash_round(drafter, caches, new, a.block), keys=keys)
        del caches
        mx.clear_cache()
    a.meta = {"target": a.synthetic_target, "drafter": desc}
    return window.rows


SHAPES = {"q/o": (4096, 4096), "k/v": (1024, 4096), "gate/up": (14336, 4096), "down": (4096, 14336), "fc": (4096, 20480)}


def run_shapes(a: argparse.Namespace) -> List[Dict[str, Any]]:
    """One launch per (projection shape, kernel shape) over ``--rows`` rows, its weight not in the L2 (a 512 MB
    buffer read before the window), and MLX's own (one row: its gemv; more: cuBLAS) beside."""
    from mlx_speculative.plugin.cuda import cuda_matmul

    window = Windows()
    flush = mx.zeros((1 << 28,), mx.bfloat16)  # 512 MB: more than the L2 (50 MB)
    before = lambda: mx.eval(flush + 1)  # noqa: E731
    for name, (n, k) in SHAPES.items():
        w = (mx.random.normal((n, k)) * k ** -0.5).astype(mx.bfloat16)
        for rows in a.rows:
            x = mx.random.normal((rows, k)).astype(mx.bfloat16)
            mx.eval(w, x)
            info = {"shape": name, "rows": rows, "weight_bytes": w.nbytes}
            window(f"{name} x{rows} mlx", lambda: x @ w.T, before=before, kernel="mlx", **info)
            for v in a.variants if rows > 1 else []:
                label = ",".join(map(str, v))
                window(f"{name} x{rows} {label}", lambda v=v: cuda_matmul.mm(x, w, v), before=before, kernel=label, **info)
            window(f"{name} x{rows} plan", lambda: cuda_matmul.mm(x, w) if rows > 1 else x @ w.T, before=before,
                   kernel="plan", **info)
    a.meta = {"shapes": SHAPES}
    return window.rows


def _read_bytes(model: Any) -> int:
    """The weights a forward reads: every parameter but the embedding (a forward gathers its rows), which a
    tied head reads whole."""
    tied = bool(getattr(getattr(model, "args", None), "tie_word_embeddings", False))
    return sum(v.nbytes for k, v in tree_flatten(model.parameters()) if tied or "embed_tokens" not in k)


def _variants(text: str) -> List[Tuple[int, ...]]:
    """"G,S,U[,P];..." -> kernel shapes (plugin/cuda/cuda_matmul.py's ``mm(x, w, shape)``)."""
    try:
        out = [tuple(int(x) for x in v.split(",")) for v in text.split(";")]
    except ValueError:
        out = []
    if not out or any(len(v) not in (3, 4) or min(v[:3]) < 1 or v[3:] not in ((), (0,), (1,)) for v in out):
        raise argparse.ArgumentTypeError(f"got {text!r}; expected G,S,U or G,S,U,P (positive integers, P 0 or 1) "
                                         "joined by ';'")
    return out


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--synthetic-target", default="llama-8b")
    p.add_argument("--keys", type=_ints, default=[4096, 16384])
    p.add_argument("--widths", type=_ints, default=[1, 16])
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--dflash-layers", type=int, default=5)
    p.add_argument("--shapes", action="store_true", help="each projection shape alone, per kernel shape (--variants)")
    p.add_argument("--rows", type=_ints, default=[1, 16], help="with --shapes")
    p.add_argument("--variants", type=_variants,
                   default=[(1, 8, 1), (2, 8, 2)], help="with --shapes: G,S,U[,P] kernel shapes joined by ';'")
    p.add_argument("--windows", required=True, help="the windows' order (written by the run, read by --summarise)")
    p.add_argument("--summarise", metavar="NCU_CSV", help="sum ncu's --csv log by window and kernel group")
    p.add_argument("--json", help="with --summarise: write the summary here")
    a = p.parse_args(argv)
    if not a.summarise:
        from mlx_speculative.plugin.cuda import cuda_attention
        if not cuda_attention.available():
            raise SystemExit(f"forward_kernels: needs MLX built with CUDA and the GPU as the default device; this "
                             f"process runs on {mx.default_device()}")
        rows = run_shapes(a) if a.shapes else run(a)
        Path(a.windows).write_text(json.dumps({**a.meta, "mlx": mx.__version__, "device": mx.device_info().get(
            "device_name"), "windows": rows}, indent=1))
        return 0
    meta = json.loads(Path(a.windows).read_text())
    report = {k: v for k, v in meta.items() if k != "windows"}
    report["command"] = "ncu --profile-from-start off --clock-control none --cache-control none --metrics " \
                        "gpu__time_duration.sum --print-units base --csv (kernels serialised, each timed alone)"
    report["windows"] = summarise(read_ncu_csv(Path(a.summarise)), meta["windows"])
    text = json.dumps(report, indent=1)
    if a.json:
        Path(a.json).write_text(text + "\n")
    for name, w in report["windows"].items():
        if "tb_s" in w:
            print(f"{name}: {w['device_ms'] * 1e3:.1f} us, {w['tb_s']} TB/s ({w['kernels']} kernels)")
            continue
        print(f"{name}: {w['kernels']} kernels, {w['device_ms']} ms;",
              ", ".join(f"{g} {v['ms']} ({v['kernels']})" for g, v in w["groups"].items()),
              f"; projections {w.get('projection_tb_s', '-')} TB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
