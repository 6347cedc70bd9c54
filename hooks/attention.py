"""Routing a loaded model's attention and projections through a plugin's dispatchers, and masks that say what they hide.

mlx-lm's attention layers call ``scaled_dot_product_attention(queries, keys, values, cache=, scale=,
mask=)``, imported by name from ``mlx_lm.models.base``. A plugin may hand the host a dispatcher with
that signature (``Backend.attention``, hooks/backend.py); the host then calls ``route(model, dispatcher)`` when it
loads the target (and a drafter family for its own models, through ``route_policy``). ``route``
scopes the loaded model only (``hooks.scoping``): its attention instances get a subclass whose
methods are mlx-lm's code run over a private globals mapping in which that name is the dispatcher.
``mlx_lm.models.base`` and every other model keep mlx-lm's function.

A dispatcher may compute attention another way only where it can prove the result is the same
function of (queries, keys, values). ``None`` and ``"causal"`` masks say so by MLX's own rules; an
array mask says nothing by itself (reading it would stall the stream). So code that builds a mask
array may ``describe`` it: a ``MaskSpec`` is a promise that the array is exactly

    mask[b, ..., i, j] = key_start[b] <= j < key_len[b]  and  j <= offset[b] + i

over its last two axes (queries ``i`` < ``queries``, keys ``j`` < ``span``). The description travels
with the cache the mask is made for (mlx-lm passes that cache along with the mask): the cache keeps a
weak reference to the last mask it described and that mask's spec, valid for that very array only. The
plugin's caches (plugin/cuda/backend.py) and the DFlash drafter describe theirs; a dispatcher reads them
with ``described(mask, cache)`` and falls back to mlx-lm's function for any mask without a description.

Projections: a policy may also hand a dispatcher ``(x, weight) -> x @ weight.T or None``
(``Backend.projections``). ``route_projections(model, dispatcher)`` gives every ``nn.Linear``
instance of THAT model (exactly that class: quantized and other layers keep theirs) a subclass whose
``__call__`` asks the dispatcher first, for inputs of ``dispatcher.rows`` = (min, max) rows where it has
that attribute (``dispatcher.quantized_rows`` for quantized layers, where it has that), and runs
``nn.Linear.__call__`` when it answers None; the bias is added after the dispatcher's product. A dispatcher with ``many(x, weights)`` also gets sibling layers multiplying the
same x (q/k/v, gate/up: learned from the calls, see ``_Learner``; or named by model code, ``project_all``) in
one launch. A dispatcher whose
``routes_quantized`` is true also gets the model's ``nn.QuantizedLinear`` instances (exactly that class):
their ``__call__`` asks ``dispatcher.quantized(x, layer)`` first and runs ``nn.QuantizedLinear.__call__``
when it answers None. Nothing is assigned to ``mlx.nn`` or to any other model.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import mlx.core as mx
import mlx.nn as nn

from . import scoping

if TYPE_CHECKING:
    from .backend import Backend

NAME = "scaled_dot_product_attention"
IntOrArray = Union[int, mx.array]
Dispatcher = Callable[..., mx.array]  # mlx_lm.models.base.scaled_dot_product_attention's signature


@dataclass(frozen=True)
class MaskSpec:
    """What a boolean mask array holds, as bounds (each an int, or an int array of shape [B])."""

    queries: int  # rows of the mask (its axis -2)
    span: int  # keys of the mask (its axis -1)
    key_start: IntOrArray  # first key any query sees (left padding)
    key_len: IntOrArray  # keys at or past this are hidden (a buffer's padding or stale tail)
    offset: IntOrArray  # query i sees keys j <= offset + i (offset >= key_len - 1: no causal cut)
    keys: int  # an int bound on key_len over the rows (what a dispatcher's thresholds compare)
    kind: str = "array"


MASK_ATTR = "_spec_described_mask"  # on a cache: (weak reference to the last mask it described, its MaskSpec)


def describe(mask: mx.array, spec: MaskSpec, cache: Any) -> mx.array:
    """Record on ``cache`` (the cache ``mask`` is made for and travels with) what ``mask`` holds; return it.
    A cache keeps the record of its last described mask only; the record names that very array (a weak
    reference: it does not keep the mask alive, nor count among the arrays the cache holds)."""
    if tuple(mask.shape[-2:]) != (spec.queries, spec.span):
        raise ValueError(f"describe: mask of shape {tuple(mask.shape)}; expected its last axes to be "
                         f"(queries, span) = ({spec.queries}, {spec.span})")
    if cache is None:
        raise ValueError("describe: got no cache; expected the cache the mask is made for (it carries the description)")
    setattr(cache, MASK_ATTR, (weakref.ref(mask), spec))
    return mask


def described(mask: Any, cache: Any) -> Optional[MaskSpec]:
    """The ``MaskSpec`` ``cache`` recorded for this very array, or None."""
    entry = getattr(cache, MASK_ATTR, None)
    return entry[1] if entry is not None and entry[0]() is mask else None


# -- routing ----------------------------------------------------------------------------------

def _mlx_lm_function() -> Callable[..., mx.array]:
    from mlx_lm.models import base

    return getattr(base, NAME)


_scopes: Dict[int, Tuple[Dispatcher, scoping.Scope]] = {}


def scope_for(dispatcher: Dispatcher) -> scoping.Scope:
    """The scope routing attention through ``dispatcher`` (one per dispatcher, so classes are shared)."""
    entry = _scopes.get(id(dispatcher))
    if entry is not None and entry[0] is dispatcher:
        return entry[1]
    original = _mlx_lm_function()

    def replacements(fn: Any) -> Dict[str, Any]:
        if NAME in scoping.names_used(fn.__code__) and fn.__globals__.get(NAME) is original:
            return {NAME: dispatcher}
        return {}

    made = scoping.Scope("attention", replacements)
    _scopes[id(dispatcher)] = (dispatcher, made)
    return made


def route(model: nn.Module, dispatcher: Optional[Dispatcher]) -> int:
    """Route the attention of ``model`` (this instance only) through ``dispatcher``: its modules whose
    methods call mlx-lm's ``scaled_dot_product_attention`` call the dispatcher instead. Returns how many
    modules run under it; None routes nothing. Idempotent; a later dispatcher replaces an earlier one."""
    if dispatcher is None:
        return 0
    return scoping.scope_model(model, scope_for(dispatcher))


def unroute(model: nn.Module) -> int:
    """Give ``model``'s attention back to mlx-lm's function; returns how many modules changed."""
    return sum(scoping.unscope(m, "attention") for m in list(model.modules()))


def route_policy(model: nn.Module, policy: "Backend") -> int:
    """``route`` with a backend's attention dispatcher (``Backend.attention``) and ``route_projections`` with its
    projection dispatcher (``Backend.projections``); None routes nothing. Returns how many modules run under either."""
    return route(model, policy.attention) + route_projections(model, policy.projections)


def routed(model: nn.Module) -> int:
    """How many modules of ``model`` call a dispatcher for their attention."""
    return sum(1 for _ in scoping.scoped_modules(model, "attention"))


# -- projections ----------------------------------------------------------------------------

Projections = Callable[[mx.array, mx.array], Optional[mx.array]]  # (x [..., K], weight [N, K]) -> [..., N] | None
_routed_classes: Dict[Tuple[type, int], Tuple[Any, type]] = {}  # (base, id(dispatcher)) -> (dispatcher, class)


class _Siblings:
    """A routed layer's part in fused launches (a plain object: nn.Module files tuples as children)."""

    __slots__ = ("group", "seen", "held", "settled", "off")

    def __init__(self) -> None:
        self.group: Tuple[nn.Linear, ...] = ()  # the layers after this one whose products its launch makes
        self.seen: Optional[Tuple[nn.Linear, ...]] = None  # the followers of its last run of calls on one x
        self.held: Optional[Tuple[mx.array, mx.array, nn.Linear]] = None  # (x, x @ W.T, the leader) to take
        self.settled = False  # its part is known: its calls are no longer observed
        self.off = False  # a fused guess failed once: this layer launches alone from now on


class _Learner:
    """Which routed layers multiply the same x one after another (q/k/v, gate/up), learned from the
    calls: a run of calls on one x object seen twice alike makes its first layer launch for the rest
    (``Projections.many``) and settles them all (no longer observed); the followers then take their
    products (checked: the same x object), and a call that breaks the pattern (another x, or a product
    never taken) ends that layer's fusing. Fusing never changes a result, only the launches."""

    def __init__(self, dispatcher: Any):
        self.dispatcher = dispatcher
        self.most = getattr(dispatcher, "max_weights", 1) if hasattr(dispatcher, "many") else 1
        self.x: Optional[mx.array] = None  # the current run: its x and its layers
        self.run: list = []

    def project(self, layer: nn.Linear, x: mx.array) -> Optional[mx.array]:
        sib = layer._spec_sib
        held = sib.held
        if held is not None:
            sib.held = None
            if held[0] is x:
                return held[1]
            self.stop(held[2])
        if not sib.settled and self.most > 1:
            self.observe(layer, x)
        group = sib.group
        if group:
            ys = self.dispatcher.many(x, [layer["weight"]] + [f["weight"] for f in group])
            if ys is not None:
                for f, y in zip(group, ys[1:]):
                    if f._spec_sib.held is not None:  # an earlier product never taken
                        self.stop(layer)
                    f._spec_sib.held = (x, y, layer)
                return ys[0]
            self.stop(layer)
        return self.dispatcher(x, layer["weight"])

    def observe(self, layer: nn.Linear, x: mx.array) -> None:
        if self.x is x and not any(m is layer for m in self.run):
            self.run.append(layer)
            return
        if self.run:
            self.learn(self.run[0], tuple(self.run[1:]))
        self.x, self.run = x, [layer]

    def learn(self, leader: nn.Linear, followers: Tuple[nn.Linear, ...]) -> None:
        sib = leader._spec_sib
        if sib.settled:
            return
        if sib.seen is not None and _same(sib.seen, followers):
            sib.group = followers if len(followers) + 1 <= self.most else ()
            for m in (leader,) + followers:
                m._spec_sib.settled = True
        else:
            sib.seen = followers

    @staticmethod
    def stop(leader: nn.Linear) -> None:
        sib = leader._spec_sib
        for f in sib.group:
            held = f._spec_sib.held
            if held is not None and held[2] is leader:
                f._spec_sib.held = None
        sib.group, sib.off = (), True


def _same(a: Tuple[nn.Linear, ...], b: Tuple[nn.Linear, ...]) -> bool:
    # by identity: == on modules (dicts of arrays) would compare their weights
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def _routed_class(base: type, dispatcher: Any,
                  make_project: Callable[[], Callable[[nn.Module, mx.array], Optional[mx.array]]]) -> type:
    """The subclass of ``base`` (``nn.Linear`` or ``nn.QuantizedLinear``) asking ``project(layer, x)`` first
    and running ``base.__call__`` when it answers None (one per base and dispatcher; ``make_project`` is
    called when it is made)."""
    entry = _routed_classes.get((base, id(dispatcher)))
    if entry is not None and entry[0] is dispatcher:
        return entry[1]
    own, project = base.__call__, make_project()

    def __call__(self: nn.Module, x: mx.array) -> mx.array:
        # Calls outside the dispatcher's rows (one-token steps, prefill) pay one size check, not a
        # dispatch: x.size is rows x in_features, whose bounds route_projections set on the instance.
        if self._spec_min_size <= x.size <= self._spec_max_size:
            y = project(self, x)
            if y is not None:
                return y + self["bias"] if "bias" in self else y
        return own(self, x)

    made = type(base.__name__, (base,), {"__call__": __call__, "_spec_projections": dispatcher})
    made.__module__, made.__qualname__ = base.__module__, base.__qualname__
    _routed_classes[(base, id(dispatcher))] = (dispatcher, made)
    return made


def _routed_linear(dispatcher: Projections) -> type:
    """The ``nn.Linear`` subclass asking ``dispatcher`` first, sibling layers fused (``_Learner``)."""
    return _routed_class(nn.Linear, dispatcher, lambda: _Learner(dispatcher).project)


def _routed_quantized(dispatcher: Any) -> type:
    """The ``nn.QuantizedLinear`` subclass asking ``dispatcher.quantized`` first."""
    return _routed_class(nn.QuantizedLinear, dispatcher, lambda: lambda layer, x: dispatcher.quantized(x, layer))


def _routed(m: nn.Module) -> bool:
    return "_spec_projections" in vars(type(m))


def route_projections(model: nn.Module, dispatcher: Optional[Projections]) -> int:
    """Route the ``nn.Linear`` layers of ``model`` (this instance only) through ``dispatcher``; returns how
    many run under it; None routes nothing. Idempotent; a later dispatcher replaces an earlier one."""
    if dispatcher is None:
        return 0
    cls = _routed_linear(dispatcher)
    qcls = _routed_quantized(dispatcher) if getattr(dispatcher, "routes_quantized", False) else None
    lo, hi = getattr(dispatcher, "rows", (1, 1 << 40))
    qlo, qhi = getattr(dispatcher, "quantized_rows", (lo, hi))
    n = 0
    for m in model.modules():
        quantized = isinstance(m, nn.QuantizedLinear) and (type(m) is nn.QuantizedLinear or _routed(m))
        if quantized:
            if qcls is None:
                if _routed(m):  # routed by an earlier dispatcher: back to mlx's class
                    m.__class__ = nn.QuantizedLinear
                continue
            k = m["weight"].shape[1] * 32 // m.bits
        elif type(m) is nn.Linear or (_routed(m) and isinstance(m, nn.Linear)):
            k = m["weight"].shape[1]
        else:
            continue
        m._spec_min_size, m._spec_max_size = (qlo if quantized else lo) * k, (qhi if quantized else hi) * k  # ints
        m._spec_sib = _Siblings()
        m.__class__ = qcls if quantized else cls
        n += 1
    return n


def unroute_projections(model: nn.Module) -> int:
    """Give ``model``'s projections back to ``nn.Linear``; returns how many modules changed."""
    n = 0
    for m in model.modules():
        if _routed(m):
            m.__class__ = nn.QuantizedLinear if isinstance(m, nn.QuantizedLinear) else nn.Linear
            del m._spec_min_size, m._spec_max_size, m._spec_sib
            n += 1
    return n


def project_all(layers: Sequence[nn.Module], x: mx.array) -> List[mx.array]:
    """``[layer(x) for layer in layers]``, where the layers are routed ``nn.Linear`` under one dispatcher with
    ``many`` and x has its rows: in launches of up to ``dispatcher.max_weights`` weights each. For model code
    that knows which layers multiply the same x (a drafter's K/V of every layer from one context); the
    learned fusing (``_Learner``) sees only runs that recur alike. The same values either way."""
    first = layers[0]
    disp = vars(type(first)).get("_spec_projections")
    if disp is None or not hasattr(disp, "many") or not isinstance(first, nn.Linear) \
            or any(type(m) is not type(first) for m in layers) \
            or not first._spec_min_size <= x.size <= first._spec_max_size:
        return [m(x) for m in layers]
    most = max(1, getattr(disp, "max_weights", 1))
    out: List[mx.array] = []
    for i in range(0, len(layers), most):
        group = layers[i:i + most]
        ys = disp.many(x, [m["weight"] for m in group]) if len(group) > 1 else None
        out += [m(x) for m in group] if ys is None else [y + m["bias"] if "bias" in m else y for m, y in zip(group, ys)]
    return out


def routed_projections(model: nn.Module) -> int:
    """How many ``nn.Linear`` (and ``nn.QuantizedLinear``) layers of ``model`` ask a dispatcher first."""
    return sum(1 for m in model.modules() if _routed(m))
