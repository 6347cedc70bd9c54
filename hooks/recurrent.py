"""Exact rollback of recurrent layers (GatedDeltaNet, Mamba-2 SSM, short convolutions), scoped to one model.

An ArraysCache holds per layer a conv state (the last K-1 conv inputs) and/or a recurrent state,
and the layer writes only their final values. Keeping n < W positions of a W-position forward
needs the layer's inputs. This module records them, for the loaded model only:

- ``scope_model(model)`` (the host calls it for every model it loads) gives each recurrent layer
  instance of THAT model a subclass whose methods are the original methods' code run over a private
  globals mapping (``hooks.scoping``, a gated scope), in which the shared recurrence primitives of mlx-lm (``gated_delta_update``,
  ``ssm_update``: ``PRIMITIVES``) and ``mx`` (the layers build the conv input with
  ``mx.concatenate([conv_state, x], axis=1)``) are recording versions. ``__call__`` runs the
  original method itself unless a transaction has opened a recording on the cache it receives, and
  the recording versions pass straight through when no recording is active. No module is touched:
  ``mlx``, ``mlx_lm`` and any other model in the process run unchanged.
- While recorded, a call keeps the primitive's arguments (matched to its cache slot by the identity
  of the incoming ``state``: the array object the cache holds) and each conv input.
- ``commit(n)`` (n per row for a batch) then sets, per row: the conv state to
  ``conv_input[n : n + K-1]``; the recurrent state to the recorded output of a call kept whole, or
  the SAME primitive run again on the recorded inputs ``[:, :left]`` from that call's incoming
  state. Rows with the same n run together, and calls of primitives with independent heads
  (``ssm_update``) of all layers run as one call with their heads side by side. On the CPU the
  gated-delta ops path steps position by position, so this is bit-equal to one-token feeding;
  the SSD form of Mamba-2 agrees within ~4e-7. No projection, attention or MLP runs again.

Anything the recording cannot explain (a recurrence that is not a listed primitive, as jamba's and
mamba's own selective scans; ``lengths`` set; a slot changed by something unrecorded; an empty
cache) makes ``usable`` say why, and the transaction falls back to restoring every cache and
replaying the kept tokens through the model (``CacheTransaction(replay=...)``): exact, a forward.

Supporting a new recurrent layer type: if its recurrence calls a function of mlx-lm shared by
several models, add a ``Primitive`` row (its module, name, the arguments that run along time on
axis 1, the state argument, and head axes if its heads are independent); if its conv input is built
with ``mx.concatenate([conv_state, x], axis=1)`` nothing more is needed. Otherwise it is still exact,
through the replay.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import threading
import types
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from . import scoping
from .cache_ops import Lengths, handle
from .recurrent_state import apply_all


@dataclass(frozen=True)
class Primitive:
    """A shared recurrence function: where it lives, and which arguments run along time (axis 1)."""

    module: str
    name: str
    timed: Tuple[str, ...]
    state: str = "state"
    unsupported: Tuple[str, ...] = ()  # arguments that must be None in a recorded call
    # Head axes of the arguments and of the state, for primitives whose heads are independent:
    # re-runs of layers with the same shapes then run as ONE call, heads side by side.
    heads: Tuple[Tuple[str, int], ...] = ()
    state_heads: int = 1
    # Where its position-by-position path calls a step function returning (y, state), by global name:
    # (the function that loops, the step it calls). Private copies of both record each step's state,
    # so a partial commit picks the state after n positions instead of running anything again.
    steps: Optional[Tuple[str, str]] = None


PRIMITIVES: Tuple[Primitive, ...] = (
    # q, k: [B, T, Hk, Dk]; v: [B, T, Hv, Dv]; a, b: [B, T, Hv]; mask: [B, T]; state: [B, Hv, Dv, Dk]
    Primitive("mlx_lm.models.gated_delta", "gated_delta_update", ("q", "k", "v", "a", "b", "mask"),
              steps=("gated_delta_ops", "_gated_delta_step_ops")),
    # hidden_states: [B, T, H, Dh]; B, C: [B, T, G, N]; dt: [B, T, H]; mask: [B, T]; state: [B, H, Dh, N]
    # lengths (right padding) picks a per-row position inside the SSD form: not sliceable here.
    Primitive("mlx_lm.models.ssm", "ssm_update", ("hidden_states", "B", "C", "dt", "mask"),
              unsupported=("lengths",),
              heads=(("hidden_states", 2), ("B", 2), ("C", 2), ("dt", 2), ("A_log", 0), ("D", 0), ("dt_bias", 0),
                     ("state", 1))),
)

_local = threading.local()  # .current: the Recording of the scoped call under way; .steps: step states
# Step states are kept only while one call's fit in this many bytes (else the call is run again).
STEP_STATE_BUDGET = 1 << 26
_open: Dict[int, "Recording"] = {}  # id(cache) -> its open recording


def _current() -> Optional["Recording"]:
    return getattr(_local, "current", None)


def _originals() -> Dict[str, Tuple[Primitive, Callable[..., Any]]]:
    out = {}
    for prim in PRIMITIVES:
        try:
            out[prim.name] = (prim, getattr(importlib.import_module(prim.module), prim.name))
        except (ImportError, AttributeError):
            continue  # an mlx-lm without this primitive: its models replay
    return out


def _stepping(fn: types.FunctionType, prim: Primitive) -> types.FunctionType:
    """A private copy of the primitive whose looping path records each step's state (``_local.steps``)."""
    if prim.steps is None:
        return fn
    loop_name, step_name = prim.steps
    loop, step = fn.__globals__.get(loop_name), fn.__globals__.get(step_name)
    if not isinstance(loop, types.FunctionType) or not callable(step):
        return fn  # an mlx-lm without that path: partial calls are run again

    def recording_step(*args: Any, **kwargs: Any) -> Any:
        out = step(*args, **kwargs)
        steps = getattr(_local, "steps", None)
        if steps is not None:
            steps.append(out[1])
        return out

    return scoping.rebound(fn, {loop_name: scoping.rebound(loop, {step_name: recording_step})})


def _recording_primitive(prim: Primitive, fn: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(fn)
    stepping = _stepping(fn, prim) if isinstance(fn, types.FunctionType) else fn

    @functools.wraps(fn)
    def recording(*args: Any, **kwargs: Any) -> Any:
        rec = _current()
        if rec is None:
            return fn(*args, **kwargs)
        arguments = dict(signature.bind(*args, **kwargs).arguments)
        slot = rec.slot_of(arguments.get(prim.state))
        outer, _local.steps = getattr(_local, "steps", None), []
        try:
            out = stepping(*args, **kwargs)
            steps = _local.steps
        finally:
            _local.steps = outer
        rec.record_call(slot, prim, fn, arguments, out, steps)
        return out

    return recording


def _recording_concatenate(arrays: Any, *args: Any, **kwargs: Any) -> mx.array:
    out = mx.concatenate(arrays, *args, **kwargs)
    rec = _current()
    if rec is not None and isinstance(arrays, (list, tuple)) and arrays:
        slot = rec.slot_of(arrays[0])
        if slot is not None:
            rec.record_conv(slot, arrays[0], out, args[0] if args else kwargs.get("axis", 0))
    return out


def _scoped_mx() -> types.ModuleType:
    """A module object of our own: mlx.core's names, with a recording ``concatenate``."""
    module = types.ModuleType("mlx_speculative.hooks.recurrent.mx")
    module.__dict__.update({k: v for k, v in vars(mx).items() if not k.startswith("__")})
    module.concatenate = _recording_concatenate
    return module


_SCOPED_MX = _scoped_mx()


def _replacements(fn: types.FunctionType) -> Dict[str, Any]:
    """What a layer method sees instead: recording primitives for the ones it calls, our ``mx``
    where it concatenates (conv inputs)."""
    used = scoping.names_used(fn.__code__)
    names: Dict[str, Any] = {}
    for pname, (prim, original) in _PRIMS.items():
        if pname in used and fn.__globals__.get(pname) is original:
            names[pname] = _RECORDING[pname]
    if "concatenate" in used and fn.__globals__.get("mx") is mx:
        names["mx"] = _SCOPED_MX
    return names


@contextlib.contextmanager
def _recording(rec: "Recording") -> Iterator[None]:
    outer, _local.current = _current(), rec
    try:
        yield
    finally:
        _local.current = outer
        rec.after_call()


def _gate(cache: Any) -> Optional[ContextManager[None]]:
    """Record a layer call only while a transaction records the cache it receives."""
    rec = _open.get(id(cache))
    return _recording(rec) if rec is not None and rec.cache is cache else None


_PRIMS = _originals()
_RECORDING = {name: _recording_primitive(prim, fn) for name, (prim, fn) in _PRIMS.items()}
SCOPE = scoping.Scope("recurrent", _replacements, gate=_gate)


def scope_model(model: nn.Module) -> int:
    """Give the recurrent layers of ``model`` (this instance only) their recording subclass
    (``hooks.scoping``). Idempotent; returns the number of recurrent layers found (0 for
    attention-only models)."""
    return scoping.scope_model(model, SCOPE)


# -- recording -------------------------------------------------------------------------------

@dataclass
class _Call:
    fn: Callable[..., Any]  # the original primitive
    prim: Primitive
    arguments: Dict[str, Any]
    width: int  # positions fed (T)
    out: mx.array  # the state it returned
    steps: List[mx.array]  # the state after each position, when the primitive stepped through them


@dataclass
class _Conv:
    padded: mx.array  # [B, K-1+T, C]: the conv input, starting with the incoming conv state
    keep: int  # K-1

    @property
    def width(self) -> int:
        return self.padded.shape[1] - self.keep


class Recording:
    """What one ArraysCache's layer fed its recurrence and conv since the transaction began."""

    def __init__(self, cache: Any):
        self.cache = cache
        self.start: List[Any] = list(cache.cache)  # the handles the transaction placed at begin
        self.slots: List[Any] = list(cache.cache)  # what each slot holds now
        self.calls: Dict[int, List[_Call]] = {}
        self.convs: Dict[int, List[_Conv]] = {}
        self.fed = 0  # positions of the recorded layer calls
        self.broken: Optional[str] = None
        self._width = 0
        if cache.lengths is not None:
            self.broken = "lengths (right-padded rows) set"
        _open[id(cache)] = self

    def close(self) -> None:
        if _open.get(id(self.cache)) is self:
            del _open[id(self.cache)]

    def slot_of(self, x: Any) -> Optional[int]:
        return next((i for i, s in enumerate(self.slots) if s is not None and s is x), None)

    def record_call(self, slot: Optional[int], prim: Primitive, fn: Callable[..., Any],
                    arguments: Dict[str, Any], out: Any, steps: List[mx.array]) -> None:
        if slot is None:
            self.broken = f"{prim.name} was called on a state the cache does not hold (an empty cache?)"
            return
        if any(arguments.get(a) is not None for a in prim.unsupported):
            self.broken = f"{prim.name} called with {', '.join(prim.unsupported)}"
            return
        width = arguments[prim.timed[0]].shape[1]
        self._width = width
        if len(steps) != width or sum(x.nbytes for x in steps) > STEP_STATE_BUDGET:
            steps = []  # not a position-by-position run (a kernel), or too large to keep: run again
        self.calls.setdefault(slot, []).append(_Call(fn, prim, arguments, width, out[1], steps))

    def record_conv(self, slot: int, state: mx.array, out: mx.array, axis: int) -> None:
        if state.ndim != 3 or axis not in (1, -2):
            self.broken = f"slot {slot} concatenated along axis {axis} of a {state.ndim}-d array"
            return
        conv = _Conv(out, state.shape[1])
        self._width = self._width or conv.width
        self.convs.setdefault(slot, []).append(conv)

    def after_call(self) -> None:
        """A layer call ended: the next one reads what the cache holds now."""
        self.slots = list(self.cache.cache)
        self.fed += self._width
        self._width = 0

    def positions(self) -> Optional[int]:
        widths = {sum(c.width for c in calls) for calls in self.calls.values()}
        widths |= {sum(c.width for c in convs) for convs in self.convs.values()}
        return widths.pop() if len(widths) == 1 else None

    def usable(self, n: Lengths) -> Optional[str]:
        """None when ``apply(n)`` is exact, else why not (the transaction then replays)."""
        if self.broken:
            return self.broken
        if not self.calls and not self.convs:
            return "no recurrence or conv input was recorded"
        if self.cache.lengths is not None:
            return "lengths (right-padded rows) set"
        written = self.positions()
        if written is None:
            return "recorded recurrence and conv positions disagree"
        rows = [n] if isinstance(n, int) else list(n)
        if not all(0 <= v <= written for v in rows):
            return f"cannot keep {n} of {written} recorded positions"
        for i, now in enumerate(self.cache.cache):
            calls, convs = self.calls.get(i), self.convs.get(i)
            if calls and convs:
                return f"slot {i} is both a recurrent and a conv state"
            if calls:
                if now is not calls[-1].out:
                    return f"slot {i} does not hold the state its recurrence returned"
            elif convs:
                last = convs[-1]
                if not isinstance(now, mx.array) or now.shape != (last.padded.shape[0], last.keep, last.padded.shape[2]):
                    return f"slot {i} does not hold the last {last.keep} conv positions"
            elif now is not self.start[i]:
                return f"slot {i} was changed by something the recording does not see"
        return None


# -- the transaction handler -----------------------------------------------------------------

class ArraysState:
    """Begin state of an ArraysCache and the recording of the forwards since."""

    def __init__(self, start: tuple, recording: Recording):
        self.start = start
        self.recording = recording
        self.applied = False  # the commit's partial state was set (``commit_partial``)


class ArraysHandler:
    """ArraysCache: snapshot by reference; a partial commit from the recording, else a replay."""

    ragged = True

    def begin(self, cache: Any) -> ArraysState:
        start = (list(cache.cache), cache.left_padding, cache.lengths)
        cache.cache = [handle(c) for c in cache.cache]
        cache.left_padding, cache.lengths = handle(cache.left_padding), handle(cache.lengths)
        return ArraysState(start, Recording(cache))

    def written(self, cache: Any, token: ArraysState) -> Optional[int]:
        return token.recording.fed or token.recording.positions() or None

    def _partial(self, cache: Any, token: ArraysState, n: Lengths, written: Optional[int]) -> bool:
        written = written if written is not None else self.written(cache, token)
        rows = [n] if isinstance(n, int) else list(n)
        return not (all(v == 0 for v in rows) or (written is not None and all(v == written for v in rows)))

    def needs_replay(self, cache: Any, token: ArraysState, n: Lengths, written: Optional[int]) -> bool:
        return self._partial(cache, token, n, written) and token.recording.usable(n) is not None

    def partial(self, cache: Any, token: ArraysState, n: Lengths, written: Optional[int]) -> Optional[Recording]:
        """The recording to apply for this commit (a usable partial one), else None."""
        if self._partial(cache, token, n, written) and not token.applied:
            token.applied = True
            return token.recording
        return None

    def commit(self, cache: Any, token: ArraysState, n: Lengths) -> None:
        token.recording.close()
        rows = [n] if isinstance(n, int) else list(n)
        if all(v == 0 for v in rows):
            self.abort(cache, token)
        elif token.applied and token.start[1] is not None:
            # What ``advance`` does to left padding, for the kept positions only.
            cache.left_padding = token.start[1] - mx.array(rows)
        # A full commit keeps what the forward wrote; a partial one was applied by ``commit_partial``.

    def abort(self, cache: Any, token: ArraysState) -> None:
        token.recording.close()
        cache.cache, cache.left_padding, cache.lengths = list(token.start[0]), token.start[1], token.start[2]


def commit_partial(items: List[Tuple[Any, Any, Any]], n: Lengths, written: Optional[int]) -> int:
    """Apply the partial commits of every recurrent cache of a transaction together: their re-runs
    then share compiled calls. Returns how many caches took a partial state."""
    todo = [(rec, n) for h, c, t in items if (rec := h.partial(c, t, n, written)) is not None]
    apply_all(todo)
    return len(todo)
