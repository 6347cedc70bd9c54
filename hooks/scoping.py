"""Reaching into one loaded model's computation without touching any module: instance scoping.

The host (and a drafter family, for its own models) changes what a loaded model's layers call
here, and only here. A ``Scope`` names global names that the layers' methods look up (a shared
mlx-lm function such as ``scaled_dot_product_attention`` or ``gated_delta_update``, or ``mx``) and
the objects to use instead. ``scope_model(model, scope)`` gives every module instance of THAT model
whose methods use such a name a subclass of its class (made once per class and set of scopes), whose
methods are the original methods' code objects run over a private copy of their module's globals
with the names replaced. Nothing is assigned to any module or class: ``mlx``, ``mlx_lm``, the model's
own module and every other model in the process keep running the original code (tests/test_no_patching.py
compares every module's globals and every mlx / mlx-lm class's attributes before and after).

Users in this project:
- ``hooks.recurrent``: records the recurrence inputs of recurrent layers so that a transaction can
  keep part of a forward. Its scope is *gated*: ``__call__`` runs the recording code only while a
  transaction records the cache it receives, and the original method otherwise.
- ``hooks.attention``: routes the attention of a loaded model through a plugin's dispatcher
  (``Backend.attention``), e.g. a short-query kernel on MLX-CUDA.

Scopes compose: an instance scoped by both gets one subclass of its mlx-lm class whose methods see
both sets of replacements (a gated scope's only while its gate is open). Nested functions defined
inside a scoped method see the replacements too (they are made from the method's globals).
Scope a model when it is loaded, before hidden-state taps (``hooks.taps``) subclass its layers.
"""

from __future__ import annotations

import contextlib
import inspect
import types
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Dict, FrozenSet, Iterator, List, Optional, Set, Tuple

import mlx.nn as nn

# A method's replacements: global name -> the object the method sees under that name ({}: none).
Replacements = Callable[[types.FunctionType], Dict[str, Any]]
# Given the ``cache`` argument of a ``__call__``: a context to run the scoped call in, or None.
Gate = Callable[[Any], Optional[ContextManager[Any]]]


@dataclass(frozen=True, eq=False)
class Scope:
    """What one user replaces in the methods of a model's layers (compared by identity)."""

    name: str  # the scoped classes carry ``_spec_<name> = True``
    replacements: Replacements
    # None: always on. Otherwise the scope applies only to classes whose ``__call__`` takes a
    # ``cache`` argument, and ``__call__`` runs with this scope's replacements only while the gate
    # returns a context for the cache it receives.
    gate: Optional[Gate] = None


def names_used(code: types.CodeType) -> Set[str]:
    """Global names a code object (and the functions, lambdas and comprehensions inside it) looks up."""
    out = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            out |= names_used(const)
    return out


def rebound(fn: types.FunctionType, names: Dict[str, Any]) -> types.FunctionType:
    """``fn``'s code over a private copy of its globals with ``names`` replaced."""
    scope = dict(fn.__globals__)
    scope.update(names)
    new = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__qualname__, new.__doc__ = fn.__qualname__, fn.__doc__
    return new


def _methods(base: type) -> Dict[str, types.FunctionType]:
    """The plain functions ``base`` and its model-side bases define, the most derived first."""
    out: Dict[str, types.FunctionType] = {}
    for klass in base.__mro__:
        if klass is nn.Module or klass is object or klass is dict:
            break
        for name, fn in vars(klass).items():
            if isinstance(fn, types.FunctionType) and name not in out:
                out[name] = fn
    return out


def _call_params(base: type) -> List[str]:
    call = getattr(base, "__call__", None)
    return list(inspect.signature(call).parameters) if isinstance(call, types.FunctionType) else []


_applies: Dict[Tuple[type, Scope], bool] = {}
_classes: Dict[Tuple[type, Tuple[Scope, ...]], type] = {}


def applies(base: type, scope: Scope) -> bool:
    """Whether ``scope`` replaces anything in the methods of ``base`` (an unscoped class)."""
    key = (base, scope)
    if key not in _applies:
        found = any(scope.replacements(fn) for fn in _methods(base).values())
        if found and scope.gate is not None:
            found = "cache" in _call_params(base)
        _applies[key] = found
    return _applies[key]


def _merged(fn: types.FunctionType, scopes: Tuple[Scope, ...]) -> Dict[str, Any]:
    names: Dict[str, Any] = {}
    for s in scopes:
        names.update(s.replacements(fn))
    return names


def _scoped_class(base: type, scopes: Tuple[Scope, ...]) -> type:
    key = (base, scopes)
    if key in _classes:
        return _classes[key]
    methods = _methods(base)
    body: Dict[str, Any] = {}
    for name, fn in methods.items():
        if name == "__call__":
            continue
        names = _merged(fn, scopes)
        if names:
            body[name] = rebound(fn, names)
    gated = tuple(s for s in scopes if s.gate is not None)
    always = tuple(s for s in scopes if s.gate is None)
    call = methods.get("__call__")
    if call is not None:
        variants: Dict[FrozenSet[int], types.FunctionType] = {}

        def variant(active: FrozenSet[int]) -> types.FunctionType:
            """``__call__`` with the always-on scopes' replacements and those of the open gates."""
            if active not in variants:
                names = _merged(call, always + tuple(s for i, s in enumerate(gated) if i in active))
                variants[active] = rebound(call, names) if names else call
            return variants[active]

        if not gated:
            body["__call__"] = variant(frozenset())
        else:
            index = _call_params(base).index("cache") - 1  # positional index after self

            def __call__(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
                cache = kwargs.get("cache") if "cache" in kwargs else (args[index] if len(args) > index else None)
                contexts = [(i, s.gate(cache)) for i, s in enumerate(gated)] if cache is not None else []
                opened = [(i, c) for i, c in contexts if c is not None]
                if not opened:
                    return variant(frozenset())(self, *args, **kwargs)
                with contextlib.ExitStack() as stack:
                    for _, c in opened:
                        stack.enter_context(c)
                    return variant(frozenset(i for i, _ in opened))(self, *args, **kwargs)

            body["__call__"] = __call__
    body["_spec_base"] = base
    body["_spec_scopes"] = scopes
    for s in scopes:
        body[f"_spec_{s.name}"] = True
    sub = type(base.__name__, (base,), body)
    sub.__module__, sub.__qualname__ = base.__module__, base.__qualname__
    _classes[key] = sub
    return sub


def base_class(module: nn.Module) -> type:
    """The class the model's code made ``module`` with (its mlx-lm class), scoped or not."""
    cls = type(module)
    return vars(cls).get("_spec_base", cls)


def scopes_of(module: nn.Module) -> Tuple[Scope, ...]:
    return vars(type(module)).get("_spec_scopes", ())


def scope(module: nn.Module, new: Scope) -> bool:
    """Give one module instance ``new`` (beside the scopes it has; one of the same name is replaced).

    Returns whether the instance now runs under ``new``. Idempotent. An instance whose class was
    derived from a scoped class by something else (a tap) is left as it is.
    """
    cls = type(module)
    current = scopes_of(module)
    if new in current:
        return True
    if not current and any("_spec_base" in vars(k) for k in cls.__mro__[1:]):
        return False
    base = base_class(module)
    if not applies(base, new):
        return False
    scopes = tuple(s for s in current if s.name != new.name) + (new,)
    module.__class__ = _scoped_class(base, scopes)
    return True


def unscope(module: nn.Module, name: str) -> bool:
    """Remove the scope called ``name`` from one instance (its other scopes stay). Returns whether it had it."""
    current = scopes_of(module)
    kept = tuple(s for s in current if s.name != name)
    if kept == current:
        return False
    base = base_class(module)
    module.__class__ = _scoped_class(base, kept) if kept else base
    return True


def scope_model(model: nn.Module, new: Scope) -> int:
    """Scope every module instance of ``model`` that ``new`` applies to; returns how many run under it."""
    return sum(scope(m, new) for m in model.modules())


def scoped_modules(model: nn.Module, name: str) -> Iterator[nn.Module]:
    """The instances of ``model`` running under the scope called ``name``."""
    return (m for m in model.modules() if any(s.name == name for s in scopes_of(m)))
