"""Compiled verify forwards: the target's own forward traced by ``mx.compile``, one trace per shape.

    policy.forward(model, inputs, cache, layers) -> (logits [1, W, V], {layer: [1, W, H]}) or None

Why: on MLX-CUDA a speculative round waits for the host to build the verify forward's graph (Python
runs the model's code op by op) and to encode it; nothing hides that time, since the next round
depends on this round's outcome. Measured on the H200 (Llama-3-8B shape, bench/results/kernels/
h200-host-split*.json) the build alone is ~4.9 ms of a ~13 ms 16-position forward at 4k keys. A
compiled function builds nothing in Python once traced: MLX replays the recorded graph in C++.

How: ``CompiledForward`` traces the model's ordinary ``__call__`` (no copied model code) over stand-in
caches (``TraceCache``) holding the ``PaddedKVCache`` buffers, whose ``offset`` is a device scalar: the
model's rope reads it, the new keys and values go into the buffers at it (``put_along_axis``), and
the mask is built and described from it (``hooks.attention.MaskSpec``, so the attention kernel takes it
from its bounds). So one trace serves every offset; ``mx.compile`` traces again for a new input width or
buffer length and keeps each. Buffers grow in steps of ``grow`` positions here (the plain path's bucket
is 256), so that long requests meet few new lengths. The offset reaches the device as a view into a
device-resident ``arange`` (no host array: a fresh one costs a managed-memory migration on MLX-CUDA).
After the call the real caches take the updated buffers and ``offset += W``: the state the plain forward
leaves (positions past the offset are never read, as after ``trim``).

``call`` does the same for any function over padded caches: the DFlash drafter's block and context appends
(drafters/dflash, through its policy). ``plugin/cuda/backend.prewarm_compiled`` traces at load.

Takes: ``widths`` positions (the verify widths) over one row, every cache a ``PaddedKVCache`` at one offset, or
over a batch, every cache a ``RaggedBatchKVCache`` at the same per-row lengths (plugin/cuda/ragged_cache.py: the offset
is then a device array [B], each row's writes, rope and mask at its own); anything else answers None and the
host's own forward runs. A trace that raises (model code that needs
an int offset) marks that model as not compiled, with the reason in ``failed``, and it runs plainly from
then on: nothing is lost, as the real caches are written only after a successful call.

Exactness: the same primitives on the same values (fp32 on the CPU: bit-equal to the plain forward, the
tests); fused elementwise kernels keep each op's dtype. Off by default on CPU and Metal (nothing to
gain where the host is not the bottleneck); ``MLX_SPEC_COMPILED_FORWARD`` = auto | on | off.
"""

from __future__ import annotations

import logging
import statistics
import time
import weakref
from collections import Counter
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn

from ...hooks.api import MaskSpec, describe, knobs, taps
from . import MODES
from .probe import available
from .ragged_cache import lengths_array, row_lengths

ENV = "MLX_SPEC_COMPILED_FORWARD"
DEFAULT_WIDTHS = (2, 4, 8, 16, 32)  # the padded policy's verify widths (powers of two)
DEFAULT_GROW = 1024
log = logging.getLogger("mlx_speculative")

Forward = Tuple[mx.array, Dict[int, mx.array]]


class TraceCache:
    """A ``PaddedKVCache``'s buffers as the model's code sees them inside the trace; ``offset`` is a device scalar.
    ``shared``: what the caches of one call compute alike (the write positions and the offset after them), made
    once for all their layers: MLX-CUDA encodes each operation of a forward from the host, one by one."""

    def __init__(self, keys: mx.array, values: mx.array, offset: mx.array, shared: Optional[Dict[Any, Any]] = None):
        self.keys, self.values, self.offset = keys, values, offset
        self._shared: Dict[Any, Any] = {} if shared is None else shared
        self._written: Optional[Tuple[mx.array, int, mx.array]] = None  # (offset after, W, offset before) of the last write

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Tuple[mx.array, mx.array]:
        # put_along_axis at offset + arange(W), not slice_update with an array start: on MLX-CUDA 0.32 the
        # dynamic slice update costs ~86 us a call at 17k positions (64 calls a forward: 5.5 ms against 0.57 ms,
        # bench/cache_write_cost.py -> bench/results/kernels/h200-cache-write.txt); the same values either way
        key = (id(self.offset), tuple(keys.shape))
        if key not in self._shared:  # the offset array is held in the entry, so its id names it for the call
            W = mx.arange(keys.shape[2], dtype=mx.int32)
            if self.offset.ndim:  # rows at their own offsets (plugin/cuda/ragged_cache.py): [B, 1, W, 1]
                base = (self.offset[:, None] + W[None])[:, None, :, None]
            else:
                base = (self.offset + W)[None, None, :, None]  # [1, 1, W, 1]
            self._shared[key] = (self.offset, base, mx.broadcast_to(base, keys.shape), self.offset + keys.shape[2])
        _, base, idx, after = self._shared[key]
        self.keys = mx.put_along_axis(self.keys, idx, keys, axis=2)  # [1, H, S, D]
        vidx = idx if values.shape == keys.shape else mx.broadcast_to(base, values.shape)
        self.values = mx.put_along_axis(self.values, vidx, values, axis=2)
        self._written = (after, keys.shape[2], self.offset)
        self.offset = after
        return self.keys, self.values

    def size(self) -> mx.array:
        return self.offset

    def trim(self, n: int) -> int:
        # Trimming the last write gives back the offset before it (the same array): the next layer's writes and
        # masks are then keyed alike (a drafter's block writes its K/V and trims them off in every layer).
        w = self._written
        self.offset = w[2] if w is not None and w[0] is self.offset and w[1] == n else self.offset - n
        self._written = None
        return n

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None) -> mx.array:
        if window_size is not None:
            raise ValueError("a compiled forward does not support sliding-window attention")
        span = self.keys.shape[2]
        end = self.offset + N
        if self.offset.ndim:  # rows at their own offsets: [B, 1, N, span]
            rows = self.offset[:, None] + mx.arange(N, dtype=mx.int32)[None]  # [B, N]
            mask = (mx.arange(span, dtype=mx.int32)[None, None] <= rows[:, :, None])[:, None]
        else:
            rows = (self.offset + mx.arange(N))[:, None]
            mask = rows >= mx.arange(span)[None]  # [N, span]: the buffer's tail is "future" positions
        return describe(mask, MaskSpec(N, span, 0, end, self.offset, span), self)


def grown(buffer: mx.array, end: int, step: int) -> mx.array:
    """``buffer`` [B, H, S, D] padded with zeros to the multiple of ``step`` that holds ``end`` positions (itself
    when it is one): the lengths this path meets are multiples of ``step`` (the plain path's are of its bucket)."""
    have = buffer.shape[2]
    want = -(-max(have, end) // step) * step
    if have == want:
        return buffer
    B, H, _, D = buffer.shape
    return mx.concatenate([buffer, mx.zeros((B, H, want - have, D), buffer.dtype)], axis=2)


def _forward_fn(layers: Tuple[int, ...]) -> Callable[..., List[mx.array]]:
    """The traced function: the model's own forward, its logits and the tapped layers' outputs."""

    def fn(m: nn.Module, caches: List[TraceCache], tokens: mx.array) -> List[mx.array]:
        with taps.record(layers) as rec:
            logits = m(tokens, cache=caches)
        missing = [i for i in layers if not rec[i]]
        if missing:
            raise ValueError(f"tapped layers {missing} recorded nothing")
        return [logits] + [mx.concatenate(rec[i], axis=1) if len(rec[i]) > 1 else rec[i][0] for i in layers]

    return fn


_POSITIONS: List[mx.array] = []


def positions(n: int) -> mx.array:
    """A device-resident int32 ``arange`` of at least ``n`` entries (doubled as needed)."""
    if not _POSITIONS or _POSITIONS[0].shape[0] < n:
        size = max(n, 2 * _POSITIONS[0].shape[0] if _POSITIONS else 1 << 16)
        made = mx.arange(size, dtype=mx.int32)
        mx.eval(made)
        _POSITIONS[:] = [made]
    return _POSITIONS[0]


class CompiledForward:
    """The policy's forward for verify-width calls: ``mx.compile`` of the model's own forward, per (model, layers);
    ``call`` compiles any function over padded caches the same way (drafters: their blocks and context appends)."""

    def __init__(self, cache_type: type, widths: Sequence[int] = DEFAULT_WIDTHS, grow: Optional[int] = None):
        grow = DEFAULT_GROW if grow is None else grow
        if grow < 1:
            raise ValueError(f"compiled forward grow: got {grow}; expected a positive integer")
        self.cache_type = cache_type  # the caches it takes (plugin/cuda/backend.py's PaddedKVCache)
        self.widths = frozenset(widths)
        self.grow = grow
        self.enabled = True  # False: every call answers None (the bench's on/off in one process)
        # False: a batch's calls (rows at their own lengths) run plainly; one row's stay compiled. Each new
        # (rows, width, buffer) shape traces and compiles anew on the device ($MLX_SPEC_COMPILED_BATCHES=off).
        self.batches = bool(knobs.value("compiled_batches"))  # runtime.compiled_batches (hooks/knobs.py)
        self.counts: Counter = Counter()
        self.failed: Dict[int, str] = {}  # id(owner model) -> why its trace failed
        self._failed_refs: Dict[int, Any] = {}  # id(owner) -> its weakref (an id is reused once an owner is freed)
        self.trace_ms: List[float] = []  # host time of each call that traced a new shape
        self._shapes: set = set()  # (id(owner), key, input shapes, buffer length) traced
        self._fns: Dict[tuple, Tuple[Any, Callable[..., List[mx.array]]]] = {}  # (id(owner), key, n) -> (weakref, fn)

    def __call__(self, model: nn.Module, inputs: mx.array, cache: Sequence[Any], layers: Sequence[int]) -> Optional[Forward]:
        if not self._takes(inputs, cache):
            return None
        W = inputs.shape[1]
        out = self.call(("forward", tuple(layers)), model, _forward_fn(tuple(layers)), cache, [inputs.astype(mx.uint32)],
                        W, W, "compiled")
        return None if out is None else (out[0], dict(zip(layers, out[1:])))

    def forward_ahead(self, model: nn.Module, inputs: mx.array, cache: Sequence[Any], layers: Sequence[int], base: int,
                      shift: mx.array) -> Optional[Tuple[mx.array, Dict[int, mx.array], List[Tuple[mx.array, mx.array]]]]:
        """The forward built at the device offset base + shift (verifying ahead, plugin/cuda/verify_ahead.py), the caches
        left as they are: (logits, captured, [(keys, values)] per cache: its buffers with the W positions written
        past that offset, for the round to install when it adopts the forward), or None as ``__call__``."""
        if not self._takes(inputs, cache):
            return None
        W, here = inputs.shape[1], cache[0].offset if cache else 0
        if not 0 <= base <= here:
            raise ValueError(f"forward_ahead: base offset {base}, past the caches' offset {here}")
        # Bounded by the caches' offset plus W: the shift is at most the positions written past base.
        out = self.call(("forward", tuple(layers)), model, _forward_fn(tuple(layers)), cache, [inputs.astype(mx.uint32)],
                        here - base + W, here - base, "compiled ahead", shift, base, install=False)
        if out is None:
            return None
        n = len(out) - 2 * len(cache)
        return out[0], dict(zip(layers, out[1:n])), [(out[n + 2 * i], out[n + 2 * i + 1]) for i in range(len(cache))]

    def _takes(self, inputs: mx.array, cache: Sequence[Any]) -> bool:
        if not isinstance(inputs, mx.array) or inputs.ndim != 2 or inputs.shape[1] not in self.widths:
            self.counts["plain: width"] += 1
            return False
        lengths = row_lengths(cache)
        if inputs.shape[0] != (1 if lengths is None else len(lengths)):
            self.counts["plain: rows"] += 1
            return False
        return True

    def call(self, key: Hashable, owner: nn.Module, fn: Callable[..., List[mx.array]], cache: Sequence[Any],
             arrays: Sequence[mx.array], writes: int, advance: int, name: str,
             shift: Optional[mx.array] = None, base: Optional[int] = None, install: bool = True
             ) -> Optional[List[mx.array]]:
        """``fn(owner, caches, *arrays) -> [arrays]`` compiled per (owner, key), run over ``cache``'s buffers
        (stand-ins whose offset is a device scalar): its outputs, or None where it declines (counted under
        "plain: <why>"; an owner whose trace failed runs plainly from then on). ``writes``: positions past the
        caches' offset ``fn`` writes (the buffers grow to hold them); ``advance``: positions the caches keep.
        ``shift``: a device scalar added to the caches' offset for this call (one the host has not read yet:
        drafting ahead, plugin/round.py); ``writes`` then bounds how far past the caches' offset it may write.
        ``base``: the host offset ``writes``, ``advance`` and ``shift`` count from (default: the caches').
        ``install`` False: the caches are left as they are and the buffers follow the outputs (2 per cache)."""
        why = self.declines(owner, cache)
        if why:
            self.counts[f"plain: {why}"] += 1
            return None
        lengths = row_lengths(cache)  # rows at their own offsets, or None: one row
        if lengths is not None and (shift is not None or base is not None):
            self.counts["plain: rows"] += 1
            return None
        offset = (max(lengths) if lengths is not None else cache[0].offset) if base is None else base
        buffers = [grown(a, offset + writes, self.grow) for c in cache for a in (c.keys, c.values)]
        compiled = self._compiled(owner, key, fn, len(arrays))
        shape = (id(owner), key, tuple(tuple(a.shape) for a in arrays), buffers[0].shape[2])
        t = time.perf_counter()
        try:
            # [] one row's offset (a view into a device-resident arange), or [B] each row's
            start = positions(offset + 1)[offset] if lengths is None else lengths_array(lengths)
            out = compiled(start if shift is None else start + shift.astype(mx.int32), *arrays, *buffers)
        except Exception as e:  # noqa: BLE001 - model code the trace cannot follow: plain from now on
            self.failed[id(owner)] = f"{type(e).__name__}: {e}"
            self._failed_refs[id(owner)] = weakref.ref(owner)
            self.counts["plain: trace failed"] += 1
            log.warning("compiled forward off for %s: %s", type(owner).__name__, self.failed[id(owner)])
            return None
        self.counts[name] += 1
        if shape not in self._shapes:
            self._shapes.add(shape)
            self.trace_ms.append((time.perf_counter() - t) * 1e3)
        if not install:
            return out
        n = len(out) - len(buffers)
        for i, c in enumerate(cache):
            c.keys, c.values = out[n + 2 * i], out[n + 2 * i + 1]
            if lengths is None:
                c.offset = offset + advance
            else:
                c.set_lengths([m + advance for m in lengths])
        return out[:n]

    def declines(self, owner: nn.Module, cache: Sequence[Any]) -> str:
        """Why a call over ``cache`` runs plainly ("" where the compiled path takes it)."""
        if not self.enabled:
            return "off"
        if id(owner) in self.failed and self._failed_refs[id(owner)]() is owner:
            return "trace failed"
        if cache and row_lengths(cache) is not None:  # a batch's rows, each at its own offset
            if not self.batches:
                return "batches off"
            return "" if all(c.keys is not None for c in cache) else "caches"
        if not cache or any(type(c) is not self.cache_type or c.keys is None for c in cache):
            return "caches"
        offset = cache[0].offset
        if any(c.offset != offset or c.keys.shape[0] != 1 for c in cache):
            return "caches"
        return ""

    def _compiled(self, owner: nn.Module, key: Hashable, fn: Callable[..., List[mx.array]], n: int
                  ) -> Callable[..., List[mx.array]]:
        full = (id(owner), key, n)
        entry = self._fns.get(full)
        if entry is not None and entry[0]() is owner:
            return entry[1]
        ref = weakref.ref(owner)

        def run(offset: mx.array, *flat: mx.array) -> List[mx.array]:
            arrays, buffers = flat[:n], flat[n:]
            shared: Dict[Any, Any] = {}
            caches = [TraceCache(buffers[2 * i], buffers[2 * i + 1], offset, shared) for i in range(len(buffers) // 2)]
            outs = fn(ref(), caches, *arrays)
            return [*outs, *(a for c in caches for a in (c.keys, c.values))]

        made = mx.compile(run)
        self._fns[full] = (ref, made)
        return made

    def report(self) -> Dict[str, Any]:
        total = sum(self.counts.values())
        return {"enabled": self.enabled, "widths": sorted(self.widths), "grow": self.grow, "calls": dict(self.counts),
                "compiled_share": round((self.counts["compiled"] + self.counts["compiled ahead"]) / total, 4)
                if total else None,
                "traces": len(self.trace_ms),
                "trace_ms_median": round(statistics.median(self.trace_ms), 2) if self.trace_ms else None,
                "trace_ms_max": round(max(self.trace_ms), 2) if self.trace_ms else None,
                "failed": list(self.failed.values())}


def resolve_mode(mode: Optional[str] = None, source: str = ENV) -> bool:
    """Whether verify forwards are compiled: ``mode``, else ``runtime.compiled_forward`` / $MLX_SPEC_COMPILED_FORWARD
    (hooks/knobs.py); auto = on MLX-CUDA."""
    if not mode:
        mode, _, source = knobs.setting("compiled_forward")
    mode = mode.strip().lower()
    if mode not in MODES:
        raise ValueError(f"{source}: got {mode!r}; allowed: {', '.join(MODES)}")
    return available() if mode == "auto" else mode == "on"


def forward_for(cache_type: type, mode: Optional[str] = None, source: str = ENV,
                widths: Sequence[int] = DEFAULT_WIDTHS) -> Optional[CompiledForward]:
    """A ``CompiledForward`` over ``cache_type`` caches where the mode says so, else None (the host's own forward).
    ``widths``: the input widths it takes (1 too: the host's one-token plain steps compiled)."""
    check_widths(widths)
    return CompiledForward(cache_type, widths) if resolve_mode(mode, source) else None


def check_widths(widths: Sequence[int], source: str = "compiled forward widths") -> None:
    """The input widths a ``CompiledForward`` may take: 1 to 32 (the verify widths and one-token steps)."""
    if not widths or not all(1 <= w <= 32 for w in widths):
        raise ValueError(f"{source}: got {list(widths)}; allowed: integers from 1 to 32")
