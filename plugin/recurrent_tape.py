"""Innovation tape: commit part of a verify forward on a recurrent cache without running the model.

An ArraysCache of a GatedDeltaNet layer (qwen3_5, qwen3_next, ...) or of a Mamba2-style SSM layer
(mamba2, falcon_h1, nemotron_h, ...) holds two things per layer, and both are updated from inputs
that the verify forward computes anyway:

- the recurrent state, updated by one of mlx-lm's SHARED recurrence primitives
  (``gated_delta.gated_delta_update``, ``ssm.ssm_update``) from per-position inputs
  (q, k, v, a, b / x, B, C, dt) and the incoming state;
- the conv state: the layer computes ``conv_input = mx.concatenate([cache[0], x], axis=1)`` and
  keeps its last K-1 positions, so after n positions the state is ``conv_input[:, n : n + K-1]``.

While a tape is open we record, per cache, the arguments of every call of a wrapped primitive
(matched to its cache by the identity of the incoming ``state``: the array object the cache holds)
and the output of every ``mx.concatenate`` whose first array is the cache's conv state (again by
identity). Keeping n < T positions then needs only the recurrence itself: whole calls keep their
recorded output state; for the partly kept call,

- when the primitive stepped position by position in Python (gated_delta's ops path, used on the
  CPU), the states its step function returned were recorded too (``STEP_STATE_BUDGET``): the state
  after n positions is simply picked, bit-equal to one-token feeding, at no cost;
- otherwise (Metal kernels, the SSD form of ``ssm_attn``) the SAME primitive runs again on the
  recorded inputs ``[:, :n]`` from the call's recorded incoming state: the computation a forward
  over those n positions does. It is compiled (the same ops, fewer launches), and calls of
  primitives with independent heads (ssm_update) run as one call for all layers, heads side by
  side (tested bit-equal to each call alone).

Either way the projections, attention, MLPs and logits of every layer are skipped.

Identity is re-established after each layer forward: the layers call ``cache.advance(S)`` last,
where the tape re-keys every slot to what the cache now holds, so several forwards inside one
transaction (a draft model feeding one token at a time) chain. Anything the tape cannot explain
(a slot changed by something it did not record, a state stored that is not the primitive's
output, ``lengths`` set, positions that do not add up) makes ``usable`` say why, and the cache
transaction falls back to restoring the snapshot and replaying the kept tokens through the model.

The wrappers are installed once (``install``, at the first tape): ``mx.concatenate`` (process-wide:
the conv input has no primitive of its own; the wrapper costs one dict check while no tape is
open), the primitives in every loaded module that binds them by name (``from .gated_delta import
gated_delta_update``; an alias is not found, and its layers take the replay) and gated_delta's step
function in its own module. They record nothing unless a tape is open, i.e. only inside a cache
transaction over an ArraysCache, and only calls on that cache's own arrays.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import mlx.core as mx


@dataclass(frozen=True)
class Primitive:
    """A shared recurrence function: where it lives, and which arguments run along time (axis 1)."""

    module: str
    name: str
    timed: Tuple[str, ...]
    state: str = "state"
    unsupported: Tuple[str, ...] = ()  # arguments that must be None for a recorded call
    # A per-position step function (returning (y, state)) that the primitive's ops path calls by
    # its module-global name: its states are the state after each position, recorded as they come.
    step: Optional[Tuple[str, str]] = None
    # Head axes of the arguments and of the state, for primitives whose heads are independent:
    # partial calls of layers with the same shapes then run as ONE call over their heads side by
    # side (one launch for all layers). Arguments without a head axis must be the same object.
    heads: Tuple[Tuple[str, int], ...] = ()
    state_heads: int = 1


PRIMITIVES: Tuple[Primitive, ...] = (
    # q, k: [B, T, Hk, Dk]; v: [B, T, Hv, Dv]; a, b: [B, T, Hv]; mask: [B, T]; state: [B, Hv, Dv, Dk]
    Primitive("mlx_lm.models.gated_delta", "gated_delta_update", ("q", "k", "v", "a", "b", "mask"),
              step=("mlx_lm.models.gated_delta", "_gated_delta_step_ops")),
    # hidden_states: [B, T, H, Dh]; B, C: [B, T, G, N]; dt: [B, T, H]; mask: [B, T]; state: [B, H, Dh, N]
    # lengths (right padding) picks a per-row position inside the SSD form: not sliceable here.
    Primitive("mlx_lm.models.ssm", "ssm_update", ("hidden_states", "B", "C", "dt", "mask"),
              unsupported=("lengths",),
              heads=(("hidden_states", 2), ("B", 2), ("C", 2), ("dt", 2), ("A_log", 0), ("D", 0), ("dt_bias", 0),
                     ("state", 1))),
)


@dataclass
class _Call:
    fn: Callable[..., Any]  # the original primitive
    prim: Primitive
    arguments: Dict[str, Any]
    width: int  # positions fed (T)
    out: mx.array  # the state it returned
    steps: List[mx.array]  # the state after each position when the primitive stepped through them
    group: Tuple[Any, ...]  # see _group


@dataclass
class _Conv:
    padded: mx.array  # [B, K-1+T, C]: the conv input, starting with the incoming conv state
    keep: int  # K-1

    @property
    def width(self) -> int:
        return self.padded.shape[1] - self.keep


# id(array) -> (array, tape, slot): the arrays the open tapes expect to see as incoming states.
_KEYS: Dict[int, Tuple[mx.array, "Tape", int]] = {}
_originals: Dict[Tuple[str, str], Callable[..., Any]] = {}
_wrappers: Dict[Tuple[str, str], Callable[..., Any]] = {}
_concatenate: Optional[Callable[..., Any]] = None
_scanned = 0
_local = threading.local()  # .steps: the list the running recorded call collects step states into
_compiled: Dict[Tuple[Any, ...], Callable[..., mx.array]] = {}
# Step states are kept only while one call's fit in this many bytes (else the call is re-run).
STEP_STATE_BUDGET = 1 << 26


def _lookup(x: Any) -> Optional[Tuple["Tape", int]]:
    hit = _KEYS.get(id(x))
    return (hit[1], hit[2]) if hit is not None and hit[0] is x else None


def _recording_concatenate(arrays: Any, *args: Any, **kwargs: Any) -> mx.array:
    out = _concatenate(arrays, *args, **kwargs)
    if _KEYS and isinstance(arrays, (list, tuple)) and arrays:
        hit = _lookup(arrays[0])
        if hit is not None:
            axis = args[0] if args else kwargs.get("axis", 0)
            hit[0].record_conv(hit[1], arrays[0], out, axis)
    return out


def _make_wrapper(prim: Primitive, fn: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def recording(*args: Any, **kwargs: Any) -> Any:
        if not _KEYS:
            return fn(*args, **kwargs)
        arguments = signature.bind(*args, **kwargs).arguments
        hit = _lookup(arguments.get(prim.state))
        if hit is None:
            return fn(*args, **kwargs)
        outer, _local.steps = getattr(_local, "steps", None), []
        try:
            out = fn(*args, **kwargs)
            steps = _local.steps
        finally:
            _local.steps = outer
        hit[0].record_call(hit[1], prim, fn, dict(arguments), out, steps)
        return out

    recording._spec_tape_original = fn  # type: ignore[attr-defined]
    return recording


def _make_step_wrapper(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def stepping(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        steps = getattr(_local, "steps", None)
        if steps is not None:
            steps.append(out[1])
        return out

    stepping._spec_tape_original = fn  # type: ignore[attr-defined]
    return stepping


def _group(prim: Primitive, fn: Callable[..., Any], arguments: Dict[str, Any]) -> Tuple[Any, ...]:
    """(compile key, batch tag): a re-run is compiled per function, argument names and constants
    (mx.compile retraces per shape); calls run as one when they also have the same shapes apart
    from the head axis and the very same head-less arrays (the mask). A primitive without head
    axes runs each call alone."""
    heads = dict(prim.heads)
    names = tuple(sorted(k for k, v in arguments.items() if isinstance(v, mx.array)))
    consts = tuple(sorted((k, repr(v)) for k, v in arguments.items() if not isinstance(v, mx.array)))
    if heads and all(k in heads or arguments[k].ndim <= 2 for k in names):
        tag: Tuple[Any, ...] = tuple(
            (k, arguments[k].dtype, tuple(d for a, d in enumerate(arguments[k].shape) if a != heads.get(k)),
             None if k in heads else id(arguments[k])) for k in names)
    else:
        tag = (object(),)
    return ((fn, prim, names, consts), tag)


def _states_after(requests: List[Tuple[_Call, int]]) -> List[mx.array]:
    """The state of each call after its first n positions: the recorded step state, or the
    primitive run again on the recorded inputs [:, :n] from the call's incoming state. Re-runs are
    compiled (the same ops, fewer launches) and, where the primitive declares head axes, calls of
    the same layout run as one call with the layers' heads side by side."""
    out: List[Optional[mx.array]] = [None] * len(requests)
    groups: Dict[Tuple[Any, ...], List[Tuple[int, _Call]]] = {}
    for j, (call, n) in enumerate(requests):
        if len(call.steps) == call.width:
            out[j] = call.steps[n - 1]
        else:
            groups.setdefault((call.group, n), []).append((j, call))
    for ((key, _), n), members in groups.items():
        fn, prim, names = key[:3]
        first = members[0][1].arguments
        run = _compiled_run(key, {k: v for k, v in first.items() if k not in names}, len(members))
        timed = set(prim.timed)
        states = run(*(c.arguments[k][:, :n] if k in timed else c.arguments[k] for _, c in members for k in names))
        for (j, _), state in zip(members, states):
            out[j] = state
    return out  # type: ignore[return-value]


def _compiled_run(key: Tuple[Any, ...], consts: Dict[str, Any], layers: int) -> Callable[..., Tuple[mx.array, ...]]:
    run = _compiled.get((key, layers))
    if run is not None:
        return run
    fn, prim, names = key[:3]
    heads, width = dict(prim.heads), len(names)

    def states(*flat: mx.array) -> Tuple[mx.array, ...]:
        per = [flat[i * width : (i + 1) * width] for i in range(layers)]
        merged = {k: per[0][j] if k not in heads or layers == 1 else _concatenate([p[j] for p in per], axis=heads[k])
                  for j, k in enumerate(names)}
        state = fn(**merged, **consts)[1]
        return tuple(mx.split(state, layers, axis=prim.state_heads)) if layers > 1 else (state,)

    run = _compiled[(key, layers)] = mx.compile(states)
    return run


def install() -> None:
    """Wrap ``mx.concatenate`` and the primitives wherever they are bound by name (idempotent;
    rescans the loaded modules when new ones were imported, e.g. a model loaded later)."""
    global _concatenate, _scanned
    if _concatenate is None:
        _concatenate = mx.concatenate
        mx.concatenate = _recording_concatenate
    if len(sys.modules) == _scanned:
        return
    for prim in PRIMITIVES:
        key = (prim.module, prim.name)
        if key not in _originals:
            try:
                fn = getattr(importlib.import_module(prim.module), prim.name)
            except (ImportError, AttributeError):
                continue  # an mlx-lm without this primitive: its models replay
            fn = getattr(fn, "_spec_tape_original", fn)
            _originals[key] = fn
            _wrappers[key] = _make_wrapper(prim, fn)
        if prim.step is not None and prim.step not in _originals:
            try:
                module = importlib.import_module(prim.step[0])
                step = getattr(module, prim.step[1])
            except (ImportError, AttributeError):
                continue  # no step states: partial calls are run again
            step = getattr(step, "_spec_tape_original", step)
            _originals[prim.step] = step
            _wrappers[prim.step] = _make_step_wrapper(step)
            setattr(module, prim.step[1], _wrappers[prim.step])  # called by its global name there only
    # By the name mlx-lm's models import them under; an alias is not wrapped (its calls replay).
    for mod in list(sys.modules.values()):
        namespace = getattr(mod, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for key, fn in _originals.items():
            if namespace.get(key[1]) is fn:
                namespace[key[1]] = _wrappers[key]
    _scanned = len(sys.modules)


class Tape:
    """What one ArraysCache's layer fed its recurrence and conv since ``open`` (see the module doc)."""

    def __init__(self, cache: Any):
        self.cache = cache
        self.start: List[Any] = list(cache.cache)  # the handles the transaction placed at begin
        self.calls: Dict[int, List[_Call]] = {}
        self.convs: Dict[int, List[_Conv]] = {}
        self.broken: Optional[str] = None
        self._keys: Dict[int, int] = {}  # slot -> id of its current key
        self._verdicts: Dict[Tuple[int, ...], Optional[str]] = {}  # usable(), asked at least twice per commit
        if cache.lengths is not None:
            self.broken = "lengths (right-padded rows) set"
        for i, x in enumerate(self.start):
            self._key(i, x)

    def _key(self, slot: int, x: Any) -> None:
        old = self._keys.pop(slot, None)
        if old is not None:
            _KEYS.pop(old, None)
        if isinstance(x, mx.array):
            _KEYS[id(x)] = (x, self, slot)
            self._keys[slot] = id(x)

    def close(self) -> None:
        for k in self._keys.values():
            _KEYS.pop(k, None)
        self._keys.clear()

    def record_call(self, slot: int, prim: Primitive, fn: Callable[..., Any], arguments: Dict[str, Any],
                    out: Any, steps: List[mx.array]) -> None:
        if any(arguments.get(a) is not None for a in prim.unsupported):
            self.broken = f"{prim.name} called with {', '.join(prim.unsupported)}"
            return
        width = arguments[prim.timed[0]].shape[1]
        if len(steps) != width or sum(x.nbytes for x in steps) > STEP_STATE_BUDGET:
            steps = []  # not a position-by-position run (e.g. a Metal kernel): re-run at commit
        group = _group(prim, fn, arguments) if not steps else ()
        self.calls.setdefault(slot, []).append(_Call(fn, prim, arguments, width, out[1], steps, group))

    def record_conv(self, slot: int, state: mx.array, out: mx.array, axis: int) -> None:
        if state.ndim != 3 or axis not in (1, -2):
            self.broken = f"slot {slot} concatenated along axis {axis} of a {state.ndim}-d array"
            return
        self.convs.setdefault(slot, []).append(_Conv(out, state.shape[1]))

    def rekey(self) -> None:
        """After a layer forward (``cache.advance``): the next forward reads what the cache holds now."""
        for i, x in enumerate(self.cache.cache):
            self._key(i, x)

    def positions(self) -> Optional[int]:
        widths = {sum(c.width for c in calls) for calls in self.calls.values()}
        widths |= {sum(c.width for c in convs) for convs in self.convs.values()}
        return widths.pop() if len(widths) == 1 else None

    def usable(self, n: int, fed: int) -> Optional[str]:
        """None when ``apply(n)`` is exact, else why not (the transaction then replays)."""
        key = (n, fed, sum(len(c) for c in self.calls.values()), sum(len(c) for c in self.convs.values()))
        if key not in self._verdicts:
            self._verdicts[key] = self._usable(n, fed)
        return self._verdicts[key]

    def _usable(self, n: int, fed: int) -> Optional[str]:
        if self.broken:
            return self.broken
        if not self.calls:
            return "no call of a wrapped recurrence primitive was recorded"
        if self.cache.lengths is not None:
            return "lengths (right-padded rows) set"
        written = self.positions()
        if written is None:
            return "recorded recurrence and conv positions disagree"
        if fed and fed != written:
            return f"the layer reported {fed} positions, the tape recorded {written}"
        if not 0 < n <= written:
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
                return f"slot {i} was changed by something the tape does not record"
        return None

    def plan(self, n: int) -> List[Tuple[int, _Call, int]]:
        """The partly kept call of each recurrent slot: (slot, call, positions kept of it)."""
        todo = []
        for i, calls in self.calls.items():
            left = n
            for call in calls:
                if left < call.width:
                    if left > 0:
                        todo.append((i, call, left))
                    break
                left -= call.width
        return todo

    def apply(self, n: int, partial: Optional[Dict[int, mx.array]] = None) -> None:
        """Set the cache to its state after the first n recorded positions (``usable(n)`` was None).
        ``partial``: the states of ``plan(n)``'s calls when computed already (``apply_all``)."""
        cache = self.cache
        if partial is None:
            todo = self.plan(n)
            partial = dict(zip((i for i, _, _ in todo), _states_after([(c, m) for _, c, m in todo])))
        for i, calls in self.calls.items():
            left = n
            for call in calls:
                if left >= call.width:
                    cache[i] = call.out  # a whole call: the state it returned
                    left -= call.width
                    continue
                if left > 0:
                    cache[i] = partial[i]
                break
        for i, convs in self.convs.items():
            left = n
            for conv in convs:
                if left <= conv.width:
                    # The conv state after `left` more positions: K-1 positions starting there.
                    cache[i] = conv.padded[:, left : left + conv.keep, :]
                    break
                left -= conv.width


def apply_all(items: List[Tuple[Tape, int]]) -> None:
    """``tape.apply(n)`` for each item, with the partial calls of all of them computed together."""
    plans = [(tape, n, tape.plan(n)) for tape, n in items]
    states = iter(_states_after([(call, m) for _, _, todo in plans for _, call, m in todo]))
    for tape, n, todo in plans:
        tape.apply(n, {i: next(states) for i, _, _ in todo})


def open_tape(cache: Any) -> Tape:
    install()
    return Tape(cache)
