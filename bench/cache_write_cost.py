"""Writing a verify's keys/values into a cache buffer at a device-scalar offset on MLX-CUDA (plugin/cuda/compiled.py).

    python bench/cache_write_cost.py      # on the GPU machine; prints one line per (buffer length, way)

64 buffers [1, 8, S, 128] bf16 (the Llama-3-8B shape's K and V over 32 layers) each take 16 positions per call,
at S = 5120 and 17408, timed synchronised (median of 12): a static slice assignment (the plain forward's, the
offset a Python int), ``mx.slice_update`` with an array start, an index-array assignment (Scatter) and
``mx.put_along_axis``, the last three compiled with the offset a device scalar; each result compared with the
static one. Output: bench/results/kernels/h200-cache-write.txt.
"""

import time, mlx.core as mx
H, D, L, W = 8, 128, 32, 16
def dyn(u, off, *bufs):
    return [mx.slice_update(b, u, off.reshape(1), axes=(2,)) for b in bufs]
def scat(u, off, *bufs):
    idx = off + mx.arange(W, dtype=mx.int32)
    out = []
    for b in bufs:
        b[:, :, idx, :] = u
        out.append(b)
    return out
def put(u, off, *bufs):
    idx = (off + mx.arange(W, dtype=mx.int32))[None, None, :, None]
    return [mx.put_along_axis(b, mx.broadcast_to(idx, u.shape), u, axis=2) for b in bufs]
def static(u, o, bufs):
    out = []
    for b in bufs:
        b[..., o:o + W, :] = u
        out.append(b)
    return out
fns = {"dynamic": mx.compile(dyn), "scatter": mx.compile(scat), "put_along": mx.compile(put)}
pos = mx.arange(1 << 16, dtype=mx.int32); mx.eval(pos)
u = mx.random.normal((1, H, W, D)).astype(mx.bfloat16)
for S in (5120, 17408):
    ref = None
    for name in ("static", "dynamic", "scatter", "put_along"):
        bufs = [mx.zeros((1, H, S, D), dtype=mx.bfloat16) for _ in range(2 * L)]
        mx.eval(bufs, u); mx.synchronize()
        ts = []
        for i in range(12):
            o = S - 1100 + (i % 4) * 16
            t = time.perf_counter()
            bufs = static(u, o, bufs) if name == "static" else fns[name](u, pos[o], *bufs)
            mx.eval(bufs); mx.synchronize()
            ts.append((time.perf_counter() - t) * 1e3)
        ts.sort()
        same = "" if ref is None else ("same" if all(mx.array_equal(a, b).item() for a, b in zip(bufs, ref)) else "DIFFERENT")
        ref = ref or bufs
        print(f"S={S} {name:10s} median ms {ts[6]:.3f} {same}", flush=True)
