"""The verify-width projection kernel (plugin/cuda/cuda_matmul.py) against MLX's matmul, on MLX-CUDA.

    python bench/gpu_matmul_check.py --out bench/results/kernels/h200-matmul-check.json

Correctness: rows 2..32 (contiguous, batched [B, L, K], a view at a row offset, a strided view), the
projection shapes of an 8B llama (q/o, k/v, gate/up, down, lm_head) and odd ones (N not a multiple of the
block's columns, K not of 32), bfloat16 and float16. Error = max |y - y_f32| / max |y_f32| against the float32 product; the kernel
passes where its error is at most twice MLX's own matmul's in the same dtype plus 1e-3 (both round
one f32 sum to 16 bits; the order of the sum differs).

Fused siblings (``mm_many``: q/k/v, gate/up, odd shapes, ten k/v weights; rows 2..32): each output must be bit-equal to
``mm``'s for its weight alone.

Cost: dependent chains of projections (q/o; gate/up then down; k/v then back), each call's input the
previous call's output, as a forward's layers run: per call the host's build and encode times and the
device's, MLX's matmul and the kernel side by side (``--sweep``: each kernel shape of ``VARIANTS``, with
its error on the chain's weights, ``errors``, against MLX's, ``mlx_error``);
rows 1 is MLX's gemv path, for scale. And a layer's sibling projections, one launch per weight against one
fused launch: q/k/v then o over q; gate/up then down over their product.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from host_split import split  # noqa: E402 - bench/host_split.py: build / encode / wait of one graph
from mlx_speculative.plugin.cuda import cuda_matmul  # noqa: E402

SHAPES = {"q/o": (4096, 4096), "k/v": (1024, 4096), "gate/up": (14336, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096), "odd": (1000, 520), "small": (24, 64)}
ROWS = [2, 3, 4, 7, 8, 15, 16, 17, 24, 31, 32]


def error(y: mx.array, ref: mx.array) -> float:
    return (mx.abs(y.astype(mx.float32) - ref).max() / mx.maximum(mx.abs(ref).max(), 1e-30)).item()


def check(dtype: mx.Dtype) -> List[Dict[str, Any]]:
    out = []
    for name, (n, k) in SHAPES.items():
        w = (mx.random.normal((n, k)) * k ** -0.5).astype(dtype)
        for rows in ROWS:
            for layout in ("rows", "batched", "row view", "strided"):
                x = inputs(layout, rows, k, dtype)
                if x is None:
                    continue
                ref = x.astype(mx.float32) @ w.astype(mx.float32).T
                ours = error(cuda_matmul.mm(x, w), ref)
                mlx = error(x @ w.T, ref)
                ok = ours <= 2 * mlx + 1e-3
                out.append({"shape": name, "n": n, "k": k, "x": list(x.shape), "layout": layout, "dtype": str(dtype),
                            "error": round(ours, 6), "mlx_error": round(mlx, 6), "ok": ok})
    return out


GROUPS = {"q/k/v": [(4096, 4096), (1024, 4096), (1024, 4096)], "gate/up": [(14336, 4096), (14336, 4096)],
          "odd": [(1000, 520), (24, 520), (8, 520), (136, 520)],
          "dflash k/v": [(1024, 4096)] * cuda_matmul.MAX_WEIGHTS}  # a DFlash drafter's context K/V, 5 layers


def check_fused(dtype: mx.Dtype) -> List[Dict[str, Any]]:
    out = []
    for name, shapes in GROUPS.items():
        ws = [(mx.random.normal(s) * s[1] ** -0.5).astype(dtype) for s in shapes]
        for rows in ROWS:
            for layout in ("rows", "row view"):
                x = inputs(layout, rows, shapes[0][1], dtype)
                fused = cuda_matmul.mm_many(x, ws)
                alone = [cuda_matmul.mm(x, w) for w in ws]
                same = all(mx.array_equal(a, b).item() for a, b in zip(fused, alone))
                out.append({"group": name, "x": list(x.shape), "layout": layout, "dtype": str(dtype), "ok": same})
    return out


def check_pipe(dtype: mx.Dtype) -> List[Dict[str, Any]]:
    """The kernel with its loads pipelined (shape (G, S, U, 1)) gives the bits of its plan's shape, every shape
    and row count (the same products summed in the same order)."""
    out = []
    for name, (n, k) in SHAPES.items():
        w = (mx.random.normal((n, k)) * k ** -0.5).astype(dtype)
        for rows in ROWS:
            x = inputs("rows", rows, k, dtype)
            plan = cuda_matmul.shape_for(n, k, rows)[:3]
            same = mx.array_equal(cuda_matmul.mm(x, w, plan), cuda_matmul.mm(x, w, (*plan, 1))).item()
            out.append({"shape": name, "x": list(x.shape), "dtype": str(dtype), "ok": same})
    return out


def inputs(layout: str, rows: int, k: int, dtype: mx.Dtype) -> Optional[mx.array]:
    """x of ``rows`` rows: contiguous [rows, K]; [2, rows/2, K]; rows 1.. of a [1, rows+1, K] array (a view
    at an offset, as the DFlash head's input); every other row of [2 rows, K] (not row-contiguous: copied)."""
    if layout == "rows":
        return mx.random.normal((rows, k)).astype(dtype)
    if layout == "batched":
        return mx.random.normal((2, rows // 2, k)).astype(dtype) if rows % 2 == 0 else None
    if layout == "row view":
        return mx.random.normal((1, rows + 1, k)).astype(dtype)[:, 1:]
    return mx.random.normal((2 * rows, k)).astype(dtype)[::2]


CHAINS = {"q/o": [(4096, 4096)], "gate/up+down": [(14336, 4096), (4096, 14336)], "k/v+back": [(1024, 4096), (4096, 1024)],
          # independent calls on one x (an output cannot feed the next): the shared head, a DFlash drafter's fc
          "lm_head": [(128256, 4096)], "fc": [(4096, 20480)],
          # a forward's wide and deep projections alone (8B llama: gate or up, down)
          "gate/up": [(14336, 4096)], "down": [(4096, 14336)]}
DEFAULT_CHAINS = ["q/o", "gate/up+down", "k/v+back"]
# the second line: more blocks and more warps per SM (bytes in flight: the 16-row chains ran at ~50% of the
# copy bandwidth with (2, 8, 1), 16 warps an SM)
VARIANTS: List[Tuple[int, ...]] = [(2, 8, 1), (4, 4, 2), (4, 4, 4), (4, 8, 4), (8, 4, 2), (4, 16, 2), (2, 4, 4), (4, 2, 4),
            (1, 8, 1), (1, 16, 1), (2, 16, 1), (1, 16, 2), (2, 16, 2), (1, 32, 1), (1, 8, 4), (1, 16, 4), (2, 8, 2)]


def per_call(t: Dict[str, float], calls: int) -> Dict[str, float]:
    """``split``'s ms per chain as us per call."""
    return {"build_us": round(t["build_ms"] * 1e3 / calls, 2), "encode_us": round(t["encode_ms"] * 1e3 / calls, 2),
            "sync_us": round(t["sync_ms"] * 1e3 / calls, 2),
            # the device's time once it, not the encoding it runs behind, is the slower
            "device_us": round((t["encode_ms"] + t["wait_ms"]) * 1e3 / calls, 2)}


def variant_name(v: Tuple[int, ...]) -> str:
    return "kernel_g{}_s{}_u{}".format(*v) + ("_pipe" if len(v) > 3 and v[3] else "")


def parse_variants(text: str) -> List[Tuple[int, ...]]:
    """"G,S,U[,P];..." -> [(G, S, U[, P]), ...] (P 1: loads pipelined)"""
    out = []
    for part in text.split(";"):
        v = tuple(int(x) for x in part.split(",") if x.strip())
        if len(v) not in (3, 4) or min(v[:3]) < 1 or (len(v) == 4 and v[3] not in (0, 1)):
            raise SystemExit(f"--variants: got {part!r}; expected G,S,U or G,S,U,P (G, S, U positive integers, "
                             "P 0 or 1), joined by ';'")
        out.append(v)
    return out


def parse_chains(text: str) -> List[str]:
    """"q/o,lm_head" -> the names of CHAINS to time (any other name refused with those allowed)."""
    names = [c.strip() for c in text.split(",") if c.strip()]
    unknown = [c for c in names if c not in CHAINS]
    if unknown or not names:
        raise SystemExit(f"--chains: got {text!r}; expected names of {', '.join(CHAINS)} joined by ','")
    return names


def chain_costs(dtype: mx.Dtype, length: int, iters: int, sweep: bool, copies: int = 6,
                variants: Optional[List[Tuple[int, ...]]] = None, chains: Optional[List[str]] = None
                ) -> List[Dict[str, Any]]:
    """Dependent chains of projections (each call's input the previous call's output; a single weight whose
    output cannot be its input, as the head's: independent calls on one x), ``copies`` distinct weights in turn
    so that the device's L2 holds none of them: per call build / encode / device time, the device's being what
    a forward's layers pay one after another."""
    variants = VARIANTS if variants is None else variants
    out = []
    for name in chains or DEFAULT_CHAINS:
        shapes = CHAINS[name]
        independent = shapes[-1][0] != shapes[0][1]  # the last output cannot feed the first link
        ws = [[(mx.random.normal(s) * s[1] ** -0.5).astype(dtype) for s in shapes] for _ in range(copies)]
        mx.eval(ws)
        for rows in (1, 16, 32):
            x0 = mx.random.normal((rows, shapes[0][1])).astype(dtype)
            mx.eval(x0)

            def chain(f: Callable[[mx.array, mx.array], mx.array]) -> Callable[[], List[mx.array]]:
                def run() -> List[mx.array]:
                    if independent:
                        return [f(x0, w) for i in range(length) for w in ws[i % copies]]
                    x = x0
                    for i in range(length):
                        for w in ws[i % copies]:
                            x = f(x, w)
                    return [x]
                return run

            calls = length * len(shapes)
            row: Dict[str, Any] = {"chain": name, "rows": rows, "calls": calls,
                                   "weight_mb": round(sum(n * k for n, k in shapes) * 2 / len(shapes) / 1e6, 1)}
            ways: List[Any] = [("mlx", chain(lambda x, w: x @ w.T))]
            if rows > 1:
                ways.append(("kernel", chain(cuda_matmul.mm)))
                if sweep:
                    ways += [(variant_name(v), chain(lambda x, w, v=v: cuda_matmul.mm(x, w, v))) for v in variants]
            for how, f in ways:
                try:
                    row[how] = per_call(split(f, lambda: None, iters), calls)
                except Exception as e:  # noqa: BLE001 - a shape that does not compile or launch: recorded, the sweep goes on
                    row[how] = {"error": f"{type(e).__name__}: {e}"[:300]}
            if rows > 1 and sweep:  # a shape that fails to launch (shared memory, registers) is fast and wrong
                xs = [mx.random.normal((rows, w.shape[1])).astype(dtype) for w in ws[0]]
                refs = [x.astype(mx.float32) @ w.astype(mx.float32).T for x, w in zip(xs, ws[0])]
                row["errors"] = {}
                for v in variants:
                    try:
                        row["errors"][variant_name(v)] = round(max(error(cuda_matmul.mm(x, w, v), r)
                                                                   for x, w, r in zip(xs, ws[0], refs)), 6)
                    except Exception as e:  # noqa: BLE001
                        row["errors"][variant_name(v)] = f"{type(e).__name__}: {e}"[:300]
                row["mlx_error"] = round(max(error(x @ w.T, r) for x, w, r in zip(xs, ws[0], refs)), 6)
            out.append(row)
            print(json.dumps(row), flush=True)
    return out


def fused_costs(dtype: mx.Dtype, length: int, iters: int, copies: int = 6) -> List[Dict[str, Any]]:
    """A layer's siblings in dependent chains: per link q/k/v from x, then x = o(q); gate/up from x, then
    x = down(gate * up); the siblings one launch each ("kernel") or one fused launch ("fused")."""
    layers = {"q/k/v+o": (GROUPS["q/k/v"], (4096, 4096)), "gate/up+down": (GROUPS["gate/up"], (4096, 14336))}
    out = []
    for name, (shapes, back) in layers.items():
        ws = [([(mx.random.normal(s) * s[1] ** -0.5).astype(dtype) for s in shapes],
               (mx.random.normal(back) * back[1] ** -0.5).astype(dtype)) for _ in range(copies)]
        mx.eval(ws)
        for rows in (16, 32):
            x0 = mx.random.normal((rows, 4096)).astype(dtype)
            mx.eval(x0)

            def chain(fused: bool) -> Callable[[], List[mx.array]]:
                def run() -> List[mx.array]:
                    x, side = x0, []
                    for i in range(length):
                        sib, wb = ws[i % copies]
                        ys = cuda_matmul.mm_many(x, sib) if fused else [cuda_matmul.mm(x, w) for w in sib]
                        x = cuda_matmul.mm(ys[0] if len(ys) == 3 else ys[0] * ys[1], wb)
                        side += ys[1:] if len(ys) == 3 else []
                    return [x] + side
                return run

            row: Dict[str, Any] = {"layer": name, "rows": rows, "links": length}
            for how in ("kernel", "fused"):
                row[how] = per_call(split(chain(how == "fused"), lambda: None, iters), length)
            out.append(row)
            print(json.dumps(row), flush=True)
    return out


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--chain", type=int, default=24, help="links per timed chain (default 24)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--sweep", action="store_true", help="also time each (G, S, U) kernel shape of VARIANTS (16 and 32 rows)")
    p.add_argument("--variants", type=parse_variants,
                   help="sweep these kernel shapes instead of VARIANTS, 'G,S,U[,P];...' (P 1: loads pipelined; implies --sweep)")
    p.add_argument("--chains-only", action="store_true", help="only the chains (no correctness table, no fused costs)")
    p.add_argument("--chains", type=parse_chains,
                   help=f"time these chains, comma-separated, of {', '.join(CHAINS)} (default {','.join(DEFAULT_CHAINS)})")
    p.add_argument("--out", help="write the results here (JSON)")
    a = p.parse_args(argv)
    if not cuda_matmul.available():
        raise SystemExit("the kernel needs MLX built with CUDA and the GPU as the default device")
    mx.random.seed(0)
    a.sweep = a.sweep or a.variants is not None
    machine = {"device": str(mx.default_device()), "mlx": mx.__version__, "device_info": mx.device_info()}
    if a.chains_only:
        report = {**machine, "chains": chain_costs(mx.bfloat16, a.chain, a.iters, a.sweep, variants=a.variants, chains=a.chains)}
        if a.out:
            Path(a.out).write_text(json.dumps(report, indent=1) + "\n")
        return 0
    results = check(mx.bfloat16) + check(mx.float16)
    fused = check_fused(mx.bfloat16) + check_fused(mx.float16)
    pipe = check_pipe(mx.bfloat16) + check_pipe(mx.float16)
    bad = [r for r in results + fused + pipe if not r["ok"]]
    print(f"{sum(r['ok'] for r in results)} of {len(results)} cases within tolerance; worst error "
          f"{max(r['error'] for r in results):.2e} (MLX's own worst {max(r['mlx_error'] for r in results):.2e}); "
          f"fused: {sum(r['ok'] for r in fused)} of {len(fused)} bit-equal to one launch per weight; "
          f"pipelined: {sum(r['ok'] for r in pipe)} of {len(pipe)} bit-equal to the plan's shape", flush=True)
    for r in bad[:10]:
        print("FAIL", json.dumps(r), flush=True)
    report = {**machine, "passed": not bad, "cases": len(results) + len(fused) + len(pipe), "failures": bad,
              "results": results, "fused": fused, "pipe": pipe, "fused_costs": fused_costs(mx.bfloat16, a.chain, a.iters),
              "chains": chain_costs(mx.bfloat16, a.chain, a.iters, a.sweep, variants=a.variants, chains=a.chains)}
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
