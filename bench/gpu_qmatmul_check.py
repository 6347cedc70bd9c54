"""The verify-width 4-bit projection kernel (plugin/cuda/cuda_qmatmul.py) against MLX's quantized matmul, on MLX-CUDA.

    python bench/gpu_qmatmul_check.py --out bench/results/kernels/h200-qmatmul-check.json

Correctness: rows 2..32 (contiguous, batched [B, L, K], a view at a row offset, a strided view), the
projection shapes of an 8B llama and odd ones, group sizes 32 / 64 / 128, bfloat16 and float16 activations
(scales and biases in the same dtype). Error = max |y - y_f32| / max |y_f32| against the float32 product
with the dequantized weight; the kernel passes where its error is at most twice that of MLX's matmul
with the weight dequantized to x's dtype, plus 1e-3 (both round one f32 sum to 16 bits in another order).

Cost: the matmuls of ``--layers`` llama-8B layers in a forward's order (bench/quantized_matmul_cost.py's
skeleton, one synchronous graph), MLX's 4-bit matmul, the same weights dequantized to bf16, and the kernel,
at 1..32 rows.

``--sweep``: the skeleton also with each kernel shape (G, S) of ``VARIANTS``.
``--reference``: the kernel's float32 reference in its place, on any device (checks this script).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_matmul_check import error, inputs  # noqa: E402 - the same error measure and input layouts
from quantized_matmul_cost import skeleton  # noqa: E402
from mlx_speculative.plugin.cuda import cuda_qmatmul  # noqa: E402

SHAPES = {"q/o": (4096, 4096), "k/v": (1024, 4096), "gate/up": (14336, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096), "odd": (1000, 512), "small": (24, 64)}
ROWS = [2, 3, 4, 7, 8, 15, 16, 17, 24, 31, 32]
VARIANTS = [(1, 8), (2, 8), (4, 8), (1, 16), (2, 16), (4, 16), (1, 32), (2, 4)]  # (G, S): columns / 8, warps a block


def check(dtype: mx.Dtype, qmm: Callable[..., mx.array], shapes: Dict[str, Any], rows_list: List[int],
          layouts: List[str]) -> List[Dict[str, Any]]:
    out = []
    for name, (n, k) in shapes.items():
        w = (mx.random.normal((n, k)) * k ** -0.5).astype(dtype)
        for gs in cuda_qmatmul.GROUP_SIZES:
            if k % gs:
                continue
            t0 = time.perf_counter()
            wq, sc, bi = mx.quantize(w, group_size=gs, bits=4)
            wd = mx.dequantize(wq, sc, bi, group_size=gs, bits=4)  # in x's dtype, as the kernel rounds it
            wf = wd.astype(mx.float32)
            mx.eval(wq, sc, bi, wd, wf)
            group: List[Dict[str, Any]] = []
            first_s = 0.0  # the kernel's first call of the group: its NVRTC compile where the kernel is new
            for rows in rows_list:
                for layout in layouts:
                    x = inputs(layout, rows, k, dtype)
                    if x is None:
                        continue
                    ref = x.astype(mx.float32) @ wf.T
                    mx.eval(x, ref)
                    t1 = time.perf_counter()
                    ours = error(qmm(x, wq, sc, bi, gs), ref)
                    first_s = first_s or time.perf_counter() - t1
                    # MLX's own rounding of the same products: its matmul with the dequantized weight (its
                    # quantized_matmul compiles per shape class on first use, too slow for every case)
                    mlx = error(x @ wd.T, ref)
                    group.append({"shape": name, "n": n, "k": k, "group_size": gs, "x": list(x.shape),
                                  "layout": layout, "dtype": str(dtype), "error": round(ours, 6),
                                  "mlx_error": round(mlx, 6), "ok": ours <= 2 * mlx + 1e-3})
            out += group
            print(f"  {dtype} {name} group {gs}: {sum(not r['ok'] for r in group)} failures, "
                  f"{time.perf_counter() - t0:.1f} s (kernel's first call {first_s:.1f} s)", flush=True)
    return out


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=32, help="layers in the timed skeleton (default 32)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--sweep", action="store_true", help="the skeleton with each (G, S) of VARIANTS too")
    p.add_argument("--reference", action="store_true", help="the reference in the kernel's place (any device)")
    p.add_argument("--shapes", help=f"comma-separated, of {', '.join(SHAPES)} (default all)")
    p.add_argument("--rows", help="comma-separated row counts (default 2..32, as ROWS)")
    p.add_argument("--dtypes", default="bfloat16,float16", help="comma-separated (default bfloat16,float16)")
    p.add_argument("--no-skeleton", action="store_true", help="the correctness cases only")
    p.add_argument("--watchdog", type=float, default=0, help="dump every thread's stack and exit after this many s")
    p.add_argument("--out", help="write the results here (JSON)")
    a = p.parse_args(argv)
    if a.watchdog:
        faulthandler.dump_traceback_later(a.watchdog, exit=True)
    if a.reference:
        qmm: Callable[..., mx.array] = cuda_qmatmul.reference
        shapes, rows_list, layouts = {"small": SHAPES["small"]}, [2, 16], ["rows", "strided"]
        dims = (64, 256, 16)
    else:
        if not cuda_qmatmul.available():
            raise SystemExit("the kernel needs MLX built with CUDA and the GPU as the default device")
        qmm, shapes, rows_list, layouts = cuda_qmatmul.qmm, SHAPES, ROWS, ["rows", "batched", "row view", "strided"]
        dims = (4096, 14336, 1024)
    if a.shapes:
        unknown = sorted(set(a.shapes.split(",")) - set(SHAPES))
        if unknown:
            raise SystemExit(f"--shapes: expected names of {', '.join(SHAPES)}; got {', '.join(unknown)}")
        shapes = {s: SHAPES[s] for s in a.shapes.split(",")}
    if a.rows:
        try:
            rows_list = [int(r) for r in a.rows.split(",")]
        except ValueError:
            raise SystemExit(f"--rows: expected comma-separated row counts (2..32); got {a.rows!r}") from None
    mx.random.seed(0)
    dtypes = {"bfloat16": mx.bfloat16, "float16": mx.float16}
    if set(a.dtypes.split(",")) - set(dtypes):
        raise SystemExit(f"--dtypes: expected bfloat16 and/or float16; got {a.dtypes}")
    results = [r for d in a.dtypes.split(",") for r in check(dtypes[d], qmm, shapes, rows_list, layouts)]
    bad = [r for r in results if not r["ok"]]
    print(f"{len(results) - len(bad)} of {len(results)} cases within tolerance; worst error "
          f"{max(r['error'] for r in results):.2e} (MLX's own worst {max(r['mlx_error'] for r in results):.2e})", flush=True)
    for r in bad[:10]:
        print("FAIL", json.dumps(r), flush=True)
    kernels: Dict[str, Callable[..., mx.array]] = {"kernel": lambda x, w: qmm(x, *w, 64)}  # the skeleton's: group 64
    if a.sweep and not a.reference:
        kernels.update({f"kernel_g{g}_s{s}": (lambda x, w, v=(g, s): qmm(x, *w, 64, shape=v)) for g, s in VARIANTS})
    costs = {} if a.no_skeleton else skeleton(a.layers, [1, 2, 4, 8, 16, 32], a.iters, dims, kernels)
    print("skeleton", json.dumps(costs), flush=True)
    report = {"device": str(mx.default_device()), "mlx": mx.__version__, "kernel": "reference" if a.reference else "cuda_qmatmul.qmm",
              "passed": not bad, "cases": len(results), "failures": bad, "results": results, "skeleton": costs}
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0 if not bad else 1


if __name__ == "__main__":
    raise SystemExit(main())
