"""What a verify's rows cost MLX's quantized matmul (issue 19's 4-bit note), against the bytes it must read.

    python bench/quantized_matmul_cost.py --json out.json

For the Llama-3-8B shape's projections (4096 -> 4096 / 1024 / 14336, 14336 -> 4096; 4 bits, group 64, bf16
activations), 32 calls per timed graph, each with its own weights (so from HBM) as in a forward's layers, median of ``--iters``, per call: MLX's
``mx.quantized_matmul`` at 1, 2, 4, 8, 16, 32 rows; the same weights dequantized once and multiplied by MLX's bf16
matmul (what reading 4x the bytes costs); and the bandwidth bound of the quantized weights (their bytes at the
device's measured copy bandwidth). A verify-width kernel that reads the quantized weights once for all rows
would approach the one-row time; the gap at 16 rows is what it could gain.

The chained calls are independent, so the GPU may overlap them (throughput). ``--skeleton`` also times
the layers' matmuls as a forward orders them (latency): per layer q/k/v from the residual, o from q
(attention left out), the residual add, gate/up from it, down from silu(gate) * up, the residual add;
``--chain`` layers, one synchronous graph, 4-bit and bf16, at the same rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import mlx.core as mx

SHAPES = {"q_proj/o_proj": (4096, 4096), "k_proj/v_proj": (1024, 4096), "gate/up": (14336, 4096), "down": (4096, 14336)}


def timed(fn: Any, iters: int) -> float:
    mx.eval(fn())
    out = []
    for _ in range(iters):
        t = time.perf_counter()
        mx.eval(fn())
        out.append((time.perf_counter() - t) * 1e3)
    return statistics.median(out)


def bandwidth_gbs(mib: int = 1024) -> float:
    a = mx.zeros((mib * 1024 * 1024 // 2,), mx.bfloat16)
    mx.eval(a)
    ms = timed(lambda: a + 1, 10)
    return 2 * a.nbytes / ms / 1e6  # read + write


def skeleton(layers: int, rows: List[int], iters: int, dims: Any,
             kernels: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """ms per synchronous graph of ``layers`` layers' matmuls in a forward's order, 4-bit and bf16, by rows.
    ``kernels``: {name: (x, (w, scales, biases)) -> y} timed too at 2 rows and more (bench/gpu_qmatmul_check.py)."""
    hidden, inter, kv = dims
    shapes = {"q": (hidden, hidden), "k": (kv, hidden), "v": (kv, hidden), "o": (hidden, hidden),
              "gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
    q_layers, d_layers = [], []
    for _ in range(layers):
        ql, dl = {}, {}
        for name, shape in shapes.items():
            w = (mx.random.normal(shape) * 0.02).astype(mx.bfloat16)
            ql[name] = mx.quantize(w, group_size=64, bits=4)
            dl[name] = mx.dequantize(*ql[name], group_size=64, bits=4)
            mx.eval(ql[name], dl[name])
        q_layers.append(ql)
        d_layers.append(dl)

    def forward(x: mx.array, mm: Any, ws: List[Dict[str, Any]]) -> List[mx.array]:
        kept = []
        for w in ws:
            q, k, v = mm(x, w["q"]), mm(x, w["k"]), mm(x, w["v"])  # [1, m, H], [1, m, kv] x 2
            kept += [k, v]
            x = x + mm(q, w["o"])
            g, u = mm(x, w["gate"]), mm(x, w["up"])  # [1, m, I]
            x = x + mm(nn_silu(g) * u, w["down"])
        return [x] + kept

    qmm = lambda x, w: mx.quantized_matmul(x, *w, transpose=True, group_size=64, bits=4)  # noqa: E731
    bmm = lambda x, w: x @ w.T  # noqa: E731
    out: Dict[str, Any] = {"layers": layers, "quantized_ms": {}, "bf16_ms": {}}
    for name in kernels or {}:
        out[f"{name}_ms"] = {}
    for m in rows:
        x = (mx.random.normal((1, m, hidden)) * 0.1).astype(mx.bfloat16)
        mx.eval(x)
        out["quantized_ms"][str(m)] = round(timed(lambda: forward(x, qmm, q_layers), iters), 3)
        out["bf16_ms"][str(m)] = round(timed(lambda: forward(x, bmm, d_layers), iters), 3)
        for name, f in (kernels or {}).items():
            if m >= 2:
                out[f"{name}_ms"][str(m)] = round(timed(lambda: forward(x, f, q_layers), iters), 3)
    return out


def nn_silu(x: mx.array) -> mx.array:
    return x * mx.sigmoid(x)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="1,2,4,8,16,32")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}")
    p.add_argument("--chain", type=int, default=32, help="calls per timed graph")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--skeleton", action="store_true", help="also the layers' matmuls in a forward's order")
    p.add_argument("--cpu", action="store_true", help="run on the CPU (checks the script)")
    p.add_argument("--json")
    a = p.parse_args(argv)
    bad = [n for n in a.shapes.split(",") if n not in SHAPES]
    if bad:
        raise SystemExit(f"--shapes: got {', '.join(bad)}; allowed: {', '.join(SHAPES)}")
    if a.cpu:
        mx.set_default_device(mx.cpu)
    rows = [int(r) for r in a.rows.split(",")]
    gbs = bandwidth_gbs(64 if a.cpu else 1024)
    report: Dict[str, Any] = {"device": str(mx.default_device()), "mlx": mx.__version__, "bits": 4, "group_size": 64,
                              "chain": a.chain, "copy_bandwidth_gbs": round(gbs, 1), "shapes": {}}
    for name in a.shapes.split(","):
        n, k = SHAPES[name]
        # a distinct weight per chained call: one reused weight would be read from L2 (50 MB on the H200)
        qs, ds = [], []
        for i in range(a.chain):
            w = (mx.random.normal((n, k)) * 0.02).astype(mx.bfloat16)
            qs.append(mx.quantize(w, group_size=64, bits=4))
            ds.append(mx.dequantize(*qs[-1], group_size=64, bits=4))
            mx.eval(qs[-1], ds[-1])
        qbytes = sum(t.nbytes for t in qs[0])
        row: Dict[str, Any] = {"out": n, "in": k, "quantized_bytes": qbytes,
                               "bound_ms": round(qbytes / gbs / 1e6, 4), "quantized_ms": {}, "dequantized_bf16_ms": {}}
        for m in rows:
            x = (mx.random.normal((1, m, k)) * 0.1).astype(mx.bfloat16)
            mx.eval(x)

            def q() -> List[mx.array]:
                return [mx.quantized_matmul(x, *qs[i], transpose=True, group_size=64, bits=4) for i in range(a.chain)]

            def d() -> List[mx.array]:
                return [x @ ds[i].T for i in range(a.chain)]

            row["quantized_ms"][str(m)] = round(timed(q, a.iters) / a.chain, 4)
            row["dequantized_bf16_ms"][str(m)] = round(timed(d, a.iters) / a.chain, 4)
        row["quantized_16_over_1"] = round(row["quantized_ms"]["16"] / row["quantized_ms"]["1"], 2) \
            if "16" in row["quantized_ms"] and "1" in row["quantized_ms"] else None
        report["shapes"][name] = row
        print(name, json.dumps(row), flush=True)
    if a.skeleton:
        report["skeleton"] = skeleton(a.chain, rows, a.iters, (64, 256, 16) if a.cpu else (4096, 14336, 1024))
        print("skeleton", json.dumps(report["skeleton"]), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
