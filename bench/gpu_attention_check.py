"""Checks plugin/cuda/cuda_attention.py against MLX's SDPA on the GPU and times both (run on the device).

    python bench/gpu_attention_check.py --out bench/results/kernels/h200-attention-kernel-check.json

Correctness: query counts 2, 4, 8, 16, 32 x key lengths 1, 31, 256, 1000, 4096, 8191, 16384, 20000 x head
dims 64, 128, 256 x GQA ratios 1, 4, 8 (32 query heads), batch 1, bf16: causal with the L queries at the
end of the S keys (S < L: every query sees all S keys, no mask). The kernel reads a KV buffer longer than
S whose tail is NaN, with key length and offset passed as arrays; extra cases: batch 4 (left padding and
per-row key lengths, NaN in the padding), int key length, non-causal, sharp scores, float16.
Rule: a case passes when the kernel's output is finite and its max abs difference both from MLX's SDPA
and from a float32 reference (same bf16 inputs) is <= 2e-2 x max|reference| (bf16 keeps 8 bits).
Every case also runs the kernel's other variants (cuda_attention.VARIANTS) on the same inputs.
Latency: synchronous per-call time (median) of the kernel against SDPA "causal", SDPA with a boolean
array mask and SDPA for one query, 32 query / 8 KV heads, head dim 128, 16 queries, 512 / 4096 / 16384
keys; inputs rotate over 4 sets so that K/V come from memory; also 20 independent calls in one graph and
32 chained calls (each output the next queries, as a forward's layers), per variant and split target.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import time
import traceback
import types
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import mlx.core as mx

# Standalone: plugin/cuda/cuda_attention.py, its sources and plugin/cuda/probe.py load as a package of their own
# (no other imports).
_PLUGIN = Path(__file__).resolve().parents[1] / "plugin" / "cuda"
_pkg = types.ModuleType("_spec_kernels")
_pkg.__path__ = [str(_PLUGIN)]
sys.modules["_spec_kernels"] = _pkg
_spec = importlib.util.spec_from_file_location("_spec_kernels.cuda_attention", _PLUGIN / "cuda_attention.py")
ca = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = ca
_spec.loader.exec_module(ca)

TOL = 2e-2
HQ = 32


def make_inputs(B: int, Hkv: int, G: int, L: int, S: int, D: int, dtype: mx.Dtype, q_gain: float = 1.0,
                starts: Optional[List[int]] = None, lens: Optional[List[int]] = None, strided: bool = False) -> Dict[str, Any]:
    """Random q and a KV buffer of S_alloc > S keys; keys outside [start, len) of each row are NaN."""
    s_alloc = (S // 256 + 1) * 256
    q = (q_gain * mx.random.normal((B, Hkv * G, L, D))).astype(dtype)
    k = mx.random.normal((B, Hkv, s_alloc, D)).astype(dtype)
    v = mx.random.normal((B, Hkv, s_alloc, D)).astype(dtype)
    starts = starts or [0] * B
    lens = lens or [S] * B
    j = mx.arange(s_alloc)
    keep = (j[None] >= mx.array(starts)[:, None]) & (j[None] < mx.array(lens)[:, None])  # [B, S_alloc]
    nan = mx.array(float("nan"), dtype=dtype)
    k_dirty = mx.where(keep[:, None, :, None], k, nan)
    v_dirty = mx.where(keep[:, None, :, None], v, nan)
    k_clean = mx.where(keep[:, None, :, None], k, 0)[:, :, :S]
    v_clean = mx.where(keep[:, None, :, None], v, 0)[:, :, :S]
    if strided:  # q as mlx-lm's attention makes it (a transposed view); k with channels strided (no vector loads)
        q = mx.contiguous(q.swapaxes(1, 2)).swapaxes(1, 2)
        k_dirty = mx.contiguous(k_dirty.swapaxes(2, 3)).swapaxes(2, 3)
    mx.eval(q, k_dirty, v_dirty, k_clean, v_clean)
    return dict(q=q, k=k_dirty, v=v_dirty, kc=k_clean, vc=v_clean, s_alloc=s_alloc)


def run_case(c: Dict[str, Any]) -> Dict[str, Any]:
    B, G, L, S, D, mode = c["B"], c["G"], c["L"], c["S"], c["D"], c["mode"]
    Hkv = HQ // G
    dtype = mx.float16 if c.get("dtype") == "float16" else mx.bfloat16
    scale = D ** -0.5
    starts = lens = None
    if mode == "padded":
        lens = [S, S - 17, S - 100, S - 1][:B]
        starts = [0, 7, min(130, S // 4), 3][:B]
    x = make_inputs(B, Hkv, G, L, S, D, dtype, c.get("q_gain", 1.0), starts, lens, c.get("strided", False))
    q, k, v = x["q"], x["k"], x["v"]
    if mode == "padded":
        key_start, key_len = mx.array(starts), mx.array(lens)
        offset = key_len - L
        j = mx.arange(S)
        m = (j >= key_start[:, None, None]) & (j < key_len[:, None, None]) & (j <= offset[:, None, None] + mx.arange(L)[None, :, None])
        ref_mask: Any = m[:, None]  # [B, 1, L, S]
    else:
        key_start = 0
        causal = mode in ("causal", "int") and S >= L
        key_len, offset = (S, S - L if causal else S) if mode == "int" else (mx.array(S), mx.array(S - L if causal else S))
        ref_mask = "causal" if causal else None
    out = ca.sdpa(q, k, v, scale, key_len, offset, key_start)
    sd = mx.fast.scaled_dot_product_attention(q, x["kc"], x["vc"], scale=scale, mask=ref_mask)
    r32 = ca.reference(q, k, v, scale, key_len, offset, key_start, dtype=mx.float32)
    of, sf = out.astype(mx.float32), sd.astype(mx.float32)
    top = mx.abs(r32).max()
    vals = [mx.isfinite(of).all(), mx.abs(of - sf).max(), mx.abs(of - r32).max(), mx.abs(sf - r32).max(), top]
    mx.eval(*vals)
    finite, e_sdpa, e_ref, sdpa_ref, top = (x.item() for x in vals)
    top = max(top, 1e-6)
    res = dict(c, Hq=HQ, Hkv=Hkv, s_alloc=x["s_alloc"], finite=bool(finite), scale_max_abs_ref=top,
               err_vs_sdpa=e_sdpa / top, err_vs_fp32=e_ref / top, sdpa_err_vs_fp32=sdpa_ref / top)
    res["pass"] = bool(finite) and res["err_vs_sdpa"] <= TOL and res["err_vs_fp32"] <= TOL
    if dtype == mx.bfloat16:  # the other kernel variants on the same inputs
        res["variants"] = {}
        for name in ca.VARIANTS:
            if name == ca.DEFAULT_VARIANT:
                continue
            try:
                ov = ca.sdpa(q, k, v, scale, key_len, offset, key_start, variant=name).astype(mx.float32)
                vv = [mx.isfinite(ov).all(), mx.abs(ov - sf).max(), mx.abs(ov - r32).max()]
                mx.eval(*vv)
                fin, es, er = (y.item() for y in vv)
                res["variants"][name] = dict(finite=bool(fin), err_vs_sdpa=es / top, err_vs_fp32=er / top,
                                             **{"pass": bool(fin) and es / top <= TOL and er / top <= TOL})
            except Exception as e:  # noqa: BLE001 - one variant's failure must not hide the others
                res["variants"][name] = {"error": f"{type(e).__name__}: {e}"[:2000], "pass": False}
    if not res["pass"]:  # where it goes wrong: by query, by query head, by 8-channel group
        d = mx.abs(of - r32) / top
        res["err_by_query"] = [round(x, 4) for x in d.max(axis=(0, 1, 3)).tolist()]
        res["err_by_head"] = [round(x, 4) for x in d.max(axis=(0, 2, 3)).tolist()]
        res["err_by_channel8"] = [round(x, 4) for x in d.reshape(B, HQ, L, D // 8, 8).max(axis=(0, 1, 2, 4)).tolist()]
    return res


def cases() -> List[Dict[str, Any]]:
    out = [dict(B=1, G=G, L=L, S=S, D=D, mode="causal" if S >= L else "none")
           for D in (64, 128, 256) for G in (1, 4, 8) for L in (2, 4, 8, 16, 32)
           for S in (1, 31, 256, 1000, 4096, 8191, 16384, 20000)]
    for L, S, D, G in ((16, 4096, 128, 4), (8, 1000, 64, 8), (32, 8191, 256, 4), (2, 256, 128, 1)):
        out.append(dict(B=4, G=G, L=L, S=S, D=D, mode="padded"))
    for L, S, D, G in ((16, 4096, 128, 4), (4, 20000, 256, 8)):
        out.append(dict(B=4, G=G, L=L, S=S, D=D, mode="causal"))
    for L, S, D, G in ([(L, S, 128, 4) for L in (2, 4, 8, 16, 32) for S in (1, 31, 256, 1000, 4096, 8191, 16384, 20000)]
                       + [(8, 1000, 64, 8), (32, 20000, 256, 4), (2, 31, 128, 1)]):
        out.append(dict(B=1, G=G, L=L, S=S, D=D, mode="int"))
    for L, S, D, G in ((16, 4096, 128, 4), (16, 1000, 256, 8), (32, 16384, 64, 1)):
        out.append(dict(B=1, G=G, L=L, S=S, D=D, mode="none"))
    for L, S, D, G in ((16, 4096, 128, 4), (32, 16384, 256, 8)):
        out.append(dict(B=1, G=G, L=L, S=S, D=D, mode="causal", q_gain=4.0))
    for L, S, D, G in ((16, 4096, 128, 4), (8, 1000, 64, 1), (4, 300, 256, 8)):
        out.append(dict(B=1, G=G, L=L, S=S, D=D, mode="causal", strided=True))
    for L, S, D, G in ((16, 4096, 128, 4), (4, 1000, 64, 8), (32, 20000, 256, 1), (2, 31, 128, 4)):
        out.append(dict(B=1, G=G, L=L, S=S, D=D, mode="causal" if S >= L else "none", dtype="float16"))
    return out


def per_call_ms(fn: Callable[[int], mx.array], iters: int = 200, warm: int = 10) -> float:
    """Median synchronous time of one call (graph built, launched and waited for), rotating inputs."""
    for i in range(warm):
        mx.eval(fn(i))
    ts = []
    for i in range(iters):
        t0 = time.perf_counter()
        mx.eval(fn(i))
        ts.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(ts)


def graph_ms(fn: Callable[[int], mx.array], n: int = 20, reps: int = 20) -> float:
    """Per-call time of n independent calls evaluated as one graph (the GPU may overlap them)."""
    mx.eval([fn(i) for i in range(n)])
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval([fn(i) for i in range(n)])
        ts.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(ts) / n


def chain_ms(fn: Callable[[mx.array, int], mx.array], q0: mx.array, n: int = 32, reps: int = 20) -> float:
    """Per-call time of n calls where each one's output is the next one's queries, as a forward's layers."""
    def run() -> mx.array:
        x = q0
        for i in range(n):
            x = fn(x, i)
        return x
    mx.eval(run())
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(run())
        ts.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(ts) / n


def timings(B: int, G: int, D: int, L: int, S: int, full: bool) -> Dict[str, Any]:
    Hkv = HQ // G
    scale = D ** -0.5
    sets = []
    for _ in range(4):
        q = mx.random.normal((B, HQ, L, D)).astype(mx.bfloat16)
        q1 = mx.random.normal((B, HQ, 1, D)).astype(mx.bfloat16)
        kb = mx.random.normal((B, Hkv, S + 256, D)).astype(mx.bfloat16)  # a buffer grown in steps
        vb = mx.random.normal((B, Hkv, S + 256, D)).astype(mx.bfloat16)
        k, v = kb[:, :, :S], vb[:, :, :S]
        mx.eval(q, q1, kb, vb, k, v)
        sets.append((q, q1, kb, vb, k, v))
    mask = mx.arange(S)[None] <= (S - L + mx.arange(L))[:, None]  # [L, S] bool
    dev_prm = ca.attention_params(B, mx.array(S) + 0, mx.array(S - L) + 0)  # on the device, built once
    mx.eval(mask, dev_prm)
    r: Dict[str, Any] = dict(B=B, Hq=HQ, Hkv=Hkv, D=D, L=L, keys=S,
                             splits={n: ca.num_splits(S, B * Hkv * -(-G * L // 64), D, None, n) for n in ca.VARIANTS})

    def kv(i: int):
        return sets[i % 4][4], sets[i % 4][5]

    # each method: (queries, call index) -> output; "1query" methods take [B, Hq, 1, D] queries
    meth: Dict[str, Callable[[mx.array, int], mx.array]] = {
        "kernel": lambda x, i: ca.sdpa(x, *kv(i), scale, S, S - L),
        "sdpa_causal": lambda x, i: mx.fast.scaled_dot_product_attention(x, *kv(i), scale=scale, mask="causal"),
    }
    for name in ca.VARIANTS:
        if name != ca.DEFAULT_VARIANT and full:
            meth[f"kernel_{name}"] = lambda x, i, name=name: ca.sdpa(x, *kv(i), scale, S, S - L, variant=name)
    if full:
        meth.update({
            "kernel_device_params_full_buffer": lambda x, i: ca.sdpa(x, sets[i % 4][2], sets[i % 4][3], scale,
                                                                     mx.array(S), mx.array(S - L), params=dev_prm),
            "kernel_host_array_params": lambda x, i: ca.sdpa(x, *kv(i), scale, mx.array(S), mx.array(S - L)),
            "sdpa_array_mask": lambda x, i: mx.fast.scaled_dot_product_attention(x, *kv(i), scale=scale, mask=mask),
            "sdpa_1query": lambda x, i: mx.fast.scaled_dot_product_attention(x, *kv(i), scale=scale),
        })
        for tb in (1, 66, 132, 528):
            meth[f"kernel_target_blocks_{tb}"] = lambda x, i, tb=tb: ca.sdpa(x, *kv(i), scale, S, S - L, target_blocks=tb)

    def queries(name: str, i: int) -> mx.array:
        return sets[i % 4][1 if name.endswith("1query") else 0]

    def guarded(f: Callable[[], float]) -> Optional[float]:
        try:
            return round(f(), 4)
        except Exception as e:  # noqa: BLE001
            r.setdefault("errors", []).append(f"{type(e).__name__}: {e}"[:500])
            return None

    r["per_call_ms"] = {name: guarded(lambda f=f, n=name: per_call_ms(lambda i: f(queries(n, i), i))) for name, f in meth.items()}
    if full:
        picked = [n for n in meth if n.startswith("kernel") and "params" not in n and "blocks_" not in n]
        picked += ["kernel_target_blocks_1", "sdpa_causal", "sdpa_array_mask", "sdpa_1query"]
        r["graph20_ms_per_call"] = {n: guarded(lambda n=n: graph_ms(lambda i: meth[n](queries(n, i), i))) for n in picked}
        r["chain32_ms_per_call"] = {n: guarded(lambda n=n: chain_ms(meth[n], queries(n, 0))) for n in picked}
    return r


def device() -> Dict[str, Any]:
    info: Dict[str, Any] = {"mlx_version": mx.__version__, "mlx_device_info": {k: str(v) for k, v in mx.device_info().items()}}
    try:
        info["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm",
                                             "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        info["nvidia_smi"] = f"unavailable: {e}"
    return info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--budget-s", type=float, default=200.0, help="stop starting correctness cases after this many seconds")
    args = ap.parse_args()
    if not ca.available():
        sys.exit("gpu_attention_check: needs MLX with CUDA and the GPU as default device; got " + str(mx.default_device()))
    t0 = time.time()
    report: Dict[str, Any] = {"device": device(), "tolerance": f"finite and max abs diff <= {TOL} x max|fp32 reference|, against SDPA and fp32 reference",
                              "settings": {"NUM_SMS": ca.NUM_SMS, "WARPS": ca.WARPS, "default_variant": ca.DEFAULT_VARIANT,
                                           "variants": {k: v._asdict() for k, v in ca.VARIANTS.items()}}, "cases": [], "timings": []}
    try:
        first_error = True
        for n, c in enumerate(cases()):
            if time.time() - t0 > args.budget_s:
                report["cases"].append(dict(c, skipped="time budget"))
                continue
            mx.random.seed(n)
            try:
                res = run_case(c)
            except Exception as e:  # noqa: BLE001 - a compile error must not lose the other results
                res = dict(c, error=f"{type(e).__name__}: {e}"[:4000], **{"pass": False})
                if first_error:
                    traceback.print_exc()
                    first_error = False
            report["cases"].append(res)
            if not res.get("pass"):
                print("FAIL", json.dumps(res)[:600], flush=True)
        report["correctness_s"] = round(time.time() - t0, 1)
        for S in (512, 4096, 16384):
            report["timings"].append(timings(1, 4, 128, 16, S, full=True))
        for B, G, D, L, S in ((1, 4, 64, 16, 4096), (1, 4, 256, 16, 4096), (1, 8, 256, 16, 16384), (4, 4, 128, 16, 4096), (1, 4, 128, 32, 16384), (1, 4, 128, 4, 4096)):
            report["timings"].append(timings(B, G, D, L, S, full=False))
    except Exception:  # noqa: BLE001
        report["fatal"] = traceback.format_exc()
        traceback.print_exc()
    finally:
        done = [c for c in report["cases"] if "skipped" not in c]
        report["summary"] = {"cases": len(report["cases"]), "run": len(done), "pass": sum(bool(c.get("pass")) for c in done),
                             "variants_pass": {n: f"{sum(bool(c['variants'][n].get('pass')) for c in done if n in c.get('variants', {}))}"
                                               f"/{sum(n in c.get('variants', {}) for c in done)}" for n in ca.VARIANTS if n != ca.DEFAULT_VARIANT},
                             "variants_worst_err_vs_fp32": {n: max((c["variants"][n].get("err_vs_fp32", 1.0) for c in done if n in c.get("variants", {})), default=None)
                                                            for n in ca.VARIANTS if n != ca.DEFAULT_VARIANT},
                             "worst_err_vs_sdpa": max((c.get("err_vs_sdpa", 0) for c in done), default=None),
                             "worst_err_vs_fp32": max((c.get("err_vs_fp32", 0) for c in done), default=None),
                             "worst_sdpa_err_vs_fp32": max((c.get("sdpa_err_vs_fp32", 0) for c in done), default=None),
                             "wall_s": round(time.time() - t0, 1)}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
    s = report["summary"]
    print(f"\ncases {s['cases']}, run {s['run']}, pass {s['pass']}; worst rel err vs SDPA {s['worst_err_vs_sdpa']}, "
          f"vs fp32 {s['worst_err_vs_fp32']} (SDPA vs fp32 {s['worst_sdpa_err_vs_fp32']}); {s['wall_s']} s")
    print("variants pass:", s["variants_pass"], "worst vs fp32:", s["variants_worst_err_vs_fp32"])
    for t in report["timings"]:
        print(f"B{t['B']} Hq{t['Hq']}/Hkv{t['Hkv']} D{t['D']} L{t['L']} keys {t['keys']} splits {t['splits']}: "
              + ", ".join(f"{k} {v}" for k, v in t["per_call_ms"].items())
              + ("; graph20 " + ", ".join(f"{k} {v}" for k, v in t["graph20_ms_per_call"].items()) if "graph20_ms_per_call" in t else "")
              + ("; chain32 " + ", ".join(f"{k} {v}" for k, v in t["chain32_ms_per_call"].items()) if "chain32_ms_per_call" in t else ""))


if __name__ == "__main__":
    main()
