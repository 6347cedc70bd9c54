"""Writing K/V into cache buffers that a queued forward still reads (verifying ahead, plugin/cuda/verify_ahead.py).

    python bench/queued_write_cost.py      # on the GPU machine; one line per (buffer length, regime)

64 buffers [1, 8, S, 128] bf16 (the Llama-3-8B shape's K and V over 32 layers) each take 16 positions per call
through ``mx.put_along_axis`` at a device-scalar offset (plugin/cuda/compiled.py's write, compiled), and a reader
then reads each whole buffer (as attention does). 20 calls per regime, each call's buffers the last call's:
"serial" reads each call's result before building the next (the round as it is); "queued" builds the next call
while the last one's reader is still queued and held (a verify queued ahead); "queued, released" drops the
reader before building the next call, still queued. MLX writes a buffer in place only where nothing holds it;
ms per call (wall, after a warm-up) and the peak memory over the buffers' own show where it copies instead.
Output: bench/results/kernels/h200-queued-write.txt.
"""

from __future__ import annotations

import sys
import time
from typing import List, Tuple

import mlx.core as mx

H, D, L, W, CALLS = 8, 128, 32, 16, 20


def step(off: mx.array, u: mx.array, *bufs: mx.array) -> List[mx.array]:
    idx = (off + mx.arange(W, dtype=mx.int32))[None, None, :, None]
    return [mx.put_along_axis(b, mx.broadcast_to(idx, u.shape), u, axis=2) for b in bufs]


write = mx.compile(step)
pos = mx.arange(1 << 16, dtype=mx.int32)
u = mx.random.normal((1, H, W, D)).astype(mx.bfloat16)
mx.eval(pos, u)


def run(S: int, regime: str) -> Tuple[float, float, List[mx.array]]:
    bufs = [mx.zeros((1, H, S, D), dtype=mx.bfloat16) for _ in range(2 * L)]
    mx.eval(bufs)
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    held = None
    t = 0.0
    for i in range(CALLS + 2):
        if i == 2:
            mx.synchronize()
            t = time.perf_counter()
        bufs = write(pos[S // 2 + (i % 4) * W], u, *bufs)
        reader = mx.stack([b.sum() for b in bufs])  # reads every buffer whole
        mx.async_eval(bufs, reader)
        if regime == "serial":
            mx.eval(reader)
        elif regime == "queued":
            if held is not None:
                mx.eval(held)  # the last call's reader, read after the next call is queued
            held = reader
        else:
            del reader
    mx.eval(bufs, held if held is not None else [])
    mx.synchronize()
    ms = (time.perf_counter() - t) * 1e3 / CALLS
    extra = (mx.get_peak_memory() - base) / 2**20
    return ms, extra, bufs


for S in ([int(s) for s in sys.argv[1].split(",")] if len(sys.argv) > 1 else (1024, 5120, 17408)):
    size = 2 * L * H * S * D * 2 / 2**20
    ref = None
    for regime in ("serial", "queued", "queued, released"):
        run(S, regime)  # warm-up: traces and allocations
        ms, extra, bufs = run(S, regime)
        same = "" if ref is None else ("same" if all(mx.array_equal(a, b).item() for a, b in zip(bufs, ref)) else "DIFFERENT")
        ref = ref or bufs
        print(f"S={S} buffers {size:.0f} MiB  {regime:17s} ms/call {ms:.3f}  peak over buffers {extra:.0f} MiB {same}",
              flush=True)
