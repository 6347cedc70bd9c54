"""Mask descriptions travel with the cache that made the mask, not in a global keyed by an array's id.

A check over the syntax tree of every .py file under hooks/, plugin/ and drafters/: a module-level dict
(``{}``, ``dict()``, ``OrderedDict()``, ``defaultdict()``, a ``Dict`` annotation) read or written with a key
built from ``id(...)`` (directly, in a tuple, or through a local name assigned from it) is reported as
file:line, unless its key is listed in ``NOT_ARRAYS`` with what it is (dispatchers and caches: objects
that live as long as the models that use them). The checker is run on the old pattern too, so it can fail.
Then what the description promises: only the very array its cache recorded is described, the dispatcher
gives a forward's later layers (their own caches, the same mask) the same spec, and nothing outlives it.
"""

from __future__ import annotations

import ast
import gc
from pathlib import Path
from typing import Dict, List, Set, Tuple

import mlx.core as mx
import pytest

from mlx_speculative.hooks import attention as host_attention
from mlx_speculative.hooks.attention import MaskSpec, describe, described
from mlx_speculative.plugin.cuda import attention, ragged_cache
from mlx_speculative.plugin.cuda import cuda_attention as ca
from mlx_speculative.plugin.cuda.backend import PaddedKVCache

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("hooks", "plugin", "drafters")
# (file, dict, the argument of id()) whose key is not an array, and what it is
NOT_ARRAYS = {
    ("hooks/attention.py", "_scopes", "dispatcher"): "an attention dispatcher (one per cache policy)",
    ("hooks/attention.py", "_routed_classes", "dispatcher"): "a projection dispatcher (one per cache policy)",
    ("hooks/recurrent.py", "_open", "cache"): "a recurrent layer's cache, while its recording is open",
    ("hooks/recurrent.py", "_open", "self.cache"): "the same, from the recording",
    ("hooks/openai_output.py", "_STOP_CACHE", "tokenizer"): "a tokenizer (with the stop words)",
}
DICT_CALLS = {"dict", "OrderedDict", "defaultdict", "WeakValueDictionary"}

pytestmark = pytest.mark.unit


def _is_dict(value: ast.AST, annotation: ast.AST = None) -> bool:
    if isinstance(value, (ast.Dict, ast.DictComp)):
        return True
    if isinstance(value, ast.Call):
        f = value.func
        return (f.id if isinstance(f, ast.Name) else getattr(f, "attr", "")) in DICT_CALLS
    return annotation is not None and "Dict" in ast.unparse(annotation)


def _module_dicts(tree: ast.Module) -> Set[str]:
    names: Set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and _is_dict(node.value):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None \
                and _is_dict(node.value, node.annotation):
            names.add(node.target.id)
    return names


def _ids(expr: ast.AST, derived: Dict[str, List[str]]) -> List[str]:
    """The arguments of ``id(...)`` a key expression is built from (directly, or through local names)."""
    found: List[str] = []
    for n in ast.walk(expr):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "id" and n.args:
            found.append(ast.unparse(n.args[0]))
        elif isinstance(n, ast.Name) and n.id in derived:
            found += derived[n.id]
    return found


def _scope(node: ast.AST):
    """The nodes of one scope: ``node``'s, not those of the functions and classes defined in it."""
    for child in ast.iter_child_nodes(node):
        yield child
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield from _scope(child)


def id_keyed(source: str, name: str) -> List[Tuple[int, str, str]]:
    """(line, dict, id's argument) for every use of a module-level dict with an id()-built key in ``source``."""
    tree = ast.parse(source, name)
    dicts = _module_dicts(tree)
    found: List[Tuple[int, str, str]] = []
    scopes = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    for fn in [tree] + [n for n in ast.walk(tree) if isinstance(n, scopes)]:
        derived: Dict[str, List[str]] = {}  # local names assigned from id(...): key = id(mask); d[key] = ...
        for n in _scope(fn):
            if isinstance(n, ast.Assign) and _ids(n.value, derived):
                derived.update({t.id: _ids(n.value, derived) for t in n.targets if isinstance(t, ast.Name)})
            if isinstance(n, ast.arguments):  # lambda r, key=key: ... defaults derived from id()
                for a, d in zip(n.args[len(n.args) - len(n.defaults):], n.defaults):
                    if isinstance(d, ast.Name) and d.id in derived:
                        derived[a.arg] = derived[d.id]
        for n in _scope(fn):
            keys: List[Tuple[str, ast.AST]] = []
            if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name) and n.value.id in dicts:
                keys.append((n.value.id, n.slice))
            elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name) \
                    and n.func.value.id in dicts and n.func.attr in ("get", "setdefault", "pop") and n.args:
                keys.append((n.func.value.id, n.args[0]))
            elif isinstance(n, ast.Compare) and any(isinstance(o, (ast.In, ast.NotIn)) for o in n.ops) \
                    and isinstance(n.comparators[-1], ast.Name) and n.comparators[-1].id in dicts:
                keys.append((n.comparators[-1].id, n.left))
            for d, key in keys:
                found += [(n.lineno, d, arg) for arg in _ids(key, derived)]
    return sorted(set(found))


def test_no_module_level_dict_is_keyed_by_an_array_s_id() -> None:
    bad, allowed_seen = [], set()
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for line, d, arg in id_keyed(path.read_text(), rel):
                if (rel, d, arg) in NOT_ARRAYS:
                    allowed_seen.add((rel, d, arg))
                else:
                    bad.append(f"{rel}:{line}: {d} keyed by id({arg})")
    assert not bad, "module-level dicts keyed by id() (an array's id names another array once it is freed):\n" \
        + "\n".join(bad)
    assert allowed_seen == set(NOT_ARRAYS), set(NOT_ARRAYS) - allowed_seen  # stale entries go
    assert not hasattr(host_attention, "_described") and not hasattr(ragged_cache, "_WRITES")


def test_the_check_finds_the_old_pattern() -> None:
    old = (
        "from typing import Dict\n"
        "_described: Dict[int, tuple] = {}\n"
        "def describe(mask, spec):\n"
        "    key = id(mask)\n"
        "    ref = weakref.ref(mask, lambda r, key=key: _forget(key, r))\n"
        "    _described[key] = (ref, spec)\n"
        "def described(mask):\n"
        "    entry = _described.get(id(mask))\n"
        "_WRITES = OrderedDict()\n"
        "def write_index(offset, width):\n"
        "    if (id(offset), width) in _WRITES:\n"
        "        return _WRITES[(id(offset), width)]\n"
    )
    assert id_keyed(old, "old.py") == [(6, "_described", "mask"), (8, "_described", "mask"),
                                       (11, "_WRITES", "offset"), (12, "_WRITES", "offset")]
    assert id_keyed("class A:\n    def f(self, x):\n        self.d = {}\n        self.d[id(x)] = x\n", "a.py") == []


def test_a_description_holds_for_its_array_and_cache_only() -> None:
    cache, other = PaddedKVCache(8, pad_steps=True), PaddedKVCache(8, pad_steps=True)
    mask = cache.make_mask(3)
    spec = described(mask, cache)
    assert spec is not None and (spec.queries, spec.span, spec.key_len, spec.offset) == (3, 8, 3, 0)
    assert described(mask, other) is None and described(mask, None) is None
    assert described(mx.array(mask), cache) is None  # the same values in another array: not described
    newer = cache.make_mask(3)
    assert described(newer, cache) is not None and described(mask, cache) is None  # the last mask only
    try:
        describe(mx.zeros((2, 5), mx.bool_), MaskSpec(2, 5, 0, 5, 4, 5), None)
    except ValueError as e:
        assert "expected the cache" in str(e)
    else:
        raise AssertionError("a description needs a cache")


def test_the_dispatcher_gives_later_layers_the_same_spec() -> None:
    """mlx-lm makes one mask per forward from its first layer's cache and passes it to every layer with that
    layer's own cache: the kernel takes them all, with one spec object; a freed mask is forgotten."""
    calls = []

    def kernel(q, k, v, scale, key_len, offset, key_start=0):  # noqa: ANN001
        calls.append((key_len, offset))
        return ca.reference(q, k, v, scale, key_len, offset, key_start)

    disp = attention.Dispatcher(attention.Kernel("stand-in", kernel, None, None), min_keys={"mlx-mask": 0, "array": 0})
    layers = [PaddedKVCache(8) for _ in range(3)]
    mx.random.seed(0)
    for c in layers:
        c.update_and_fetch(mx.random.normal((1, 2, 5, 16)), mx.random.normal((1, 2, 5, 16)))
    mask = layers[0].make_mask(4)
    q = mx.random.normal((1, 4, 4, 16))
    specs = []
    for c in layers:
        k, v = c.update_and_fetch(mx.random.normal((1, 2, 4, 16)), mx.random.normal((1, 2, 4, 16)))
        want = attention._MLX(q, k, v, cache=c, scale=0.25, mask=mask)
        assert mx.abs(disp(q, k, v, cache=c, scale=0.25, mask=mask) - want).max().item() < 1e-5
        specs.append(disp.described(mask, c))
    assert disp.counts == {"kernel": 3} and calls == [(9, 5)] * 3 and all(s is specs[0] for s in specs)
    fresh = mx.array(mask)  # never described: MLX's path in every layer
    assert disp.plan(q, k, v, layers[1], fresh, None) == (None, "mask")
    del mask, specs
    gc.collect()
    assert all(ref() is None for ref, _ in disp._recent)  # weak: the dispatcher keeps no mask alive
