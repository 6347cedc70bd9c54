"""The state a recurrent cache keeps after part of a recorded forward (``hooks.recurrent``'s commits).

Per row group (rows keeping the same n positions): the conv state is cut from the recorded conv
input; the recurrent state is the recorded output of a call kept whole, the step state the
primitive recorded on its way (its position-by-position path), or the SAME primitive run again on
the recorded inputs ``[:, :left]`` from that call's incoming state. Re-runs are compiled, and calls
of primitives whose heads are independent (``ssm_update``) run as one call for all layers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from .cache_ops import Lengths, uniform

if TYPE_CHECKING:
    from .recurrent import Primitive, Recording, _Call

_compiled: Dict[Tuple[Any, ...], Callable[..., Tuple[mx.array, ...]]] = {}


def _locate(items: Sequence[Any], n: int) -> Tuple[Optional[Any], int, Optional[Any]]:
    """(the item holding position n, positions of it kept, the item before it) for calls or convs."""
    left, before = n, None
    for item in items:
        if left < item.width:
            return item, left, before
        left -= item.width
        before = item
    return None, 0, before


def _rows(x: Any, rows: Optional[List[int]]) -> Any:
    """The given rows of a batched array (all of it for rows None)."""
    return x if rows is None or x is None else x[mx.array(rows)]


def _groups(n: Lengths, batch: int) -> List[Tuple[int, Optional[List[int]]]]:
    """(n, rows) for each distinct per-row length; rows None when every row keeps the same n."""
    if uniform(n) is not None:
        return [(uniform(n), None)]
    found: Dict[int, List[int]] = {}
    for b, v in enumerate(n):
        found.setdefault(int(v), []).append(b)
    return sorted(found.items())


def _assemble(parts: List[Tuple[Optional[List[int]], mx.array]], batch: int) -> mx.array:
    """Rows of several groups back in batch order."""
    if len(parts) == 1 and parts[0][0] is None:
        return parts[0][1]
    order = [b for rows, _ in parts for b in rows]  # type: ignore[union-attr]
    joined = mx.concatenate([x for _, x in parts], axis=0)
    inverse = [0] * batch
    for i, b in enumerate(order):
        inverse[b] = i
    return joined[mx.array(inverse)]


def apply_all(items: List[Tuple[Recording, Lengths]]) -> None:
    """Set each recording's cache to its state after the kept positions (``usable`` said None).

    Partial calls of all caches are computed together (``_states_after``)."""
    plans: List[Tuple[Recording, int, Dict[int, List[Tuple[Optional[List[int]], Any]]]]] = []
    reruns: List[Tuple[_Call, int, Optional[List[int]]]] = []
    for rec, n in items:
        batch = next(x.shape[0] for x in rec.cache.cache if isinstance(x, mx.array))
        slots: Dict[int, List[Tuple[Optional[List[int]], Any]]] = {}
        for m, rows in _groups(n, batch):
            for i, calls in rec.calls.items():
                call, left, before = _locate(calls, m)
                if call is None or left == 0:  # kept whole: the output of the last kept call
                    state = before.out if before is not None else calls[0].arguments[calls[0].prim.state]
                    slots.setdefault(i, []).append((rows, _rows(state, rows)))
                elif call.steps:  # the state it reached after ``left`` positions, recorded on the way
                    slots.setdefault(i, []).append((rows, _rows(call.steps[left - 1], rows)))
                else:
                    slots.setdefault(i, []).append((rows, len(reruns)))
                    reruns.append((call, left, rows))
            for i, convs in rec.convs.items():
                conv, left, before = _locate(convs, m)
                if conv is None:  # everything kept: the last conv's window
                    conv, left = before, before.width
                slots.setdefault(i, []).append((rows, _rows(conv.padded, rows)[:, left : left + conv.keep, :]))
        plans.append((rec, batch, slots))
    states = _states_after(reruns)
    for rec, batch, slots in plans:
        for i, parts in slots.items():
            rec.cache[i] = _assemble([(rows, states[x] if isinstance(x, int) else x) for rows, x in parts], batch)


def _states_after(requests: List[Tuple[_Call, int, Optional[List[int]]]]) -> List[mx.array]:
    """The state of each call after its first n positions (of the given rows): the primitive run
    again on the recorded inputs [:, :n] from the call's incoming state. Compiled (the same ops,
    fewer launches); calls of primitives with head axes and the same layout run as one call."""
    out: List[Optional[mx.array]] = [None] * len(requests)
    groups: Dict[Tuple[Any, ...], List[Tuple[int, Dict[str, Any]]]] = {}
    for j, (call, n, rows) in enumerate(requests):
        timed = set(call.prim.timed)
        # Timed arguments and the state are batched; the rest (A_log, dt_bias, D) are per head.
        args = {k: (_rows(v, rows)[:, :n] if k in timed else _rows(v, rows) if k == call.prim.state else v)
                if isinstance(v, mx.array) else v for k, v in call.arguments.items()}
        groups.setdefault(_group(call.prim, call.fn, args), []).append((j, args))
    for key, members in groups.items():
        fn, prim, names = key[0][:3]
        first = members[0][1]
        run = _compiled_run(key[0], {k: v for k, v in first.items() if k not in names}, len(members))
        states = run(*(a[k] for _, a in members for k in names))
        for (j, _), state in zip(members, states):
            out[j] = state
    return out  # type: ignore[return-value]


def _group(prim: Primitive, fn: Callable[..., Any], arguments: Dict[str, Any]) -> Tuple[Any, ...]:
    """(compile key, batch tag): compiled per function, argument names, constants and shapes;
    calls run as one when they also have the same shapes apart from the head axis and the very same
    head-less arrays (the mask). A primitive without head axes runs each call alone."""
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


def _compiled_run(key: Tuple[Any, ...], consts: Dict[str, Any], layers: int) -> Callable[..., Tuple[mx.array, ...]]:
    run = _compiled.get((key, layers))
    if run is not None:
        return run
    fn, prim, names = key[:3]
    heads, width = dict(prim.heads), len(names)

    def states(*flat: mx.array) -> Tuple[mx.array, ...]:
        per = [flat[i * width : (i + 1) * width] for i in range(layers)]
        merged = {k: per[0][j] if k not in heads or layers == 1 else mx.concatenate([p[j] for p in per], axis=heads[k])
                  for j, k in enumerate(names)}
        state = fn(**merged, **consts)[1]
        return tuple(mx.split(state, layers, axis=prim.state_heads)) if layers > 1 else (state,)

    run = _compiled[(key, layers)] = mx.compile(states)
    return run
