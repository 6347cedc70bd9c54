"""Cache-transaction contract (hooks/transaction.py) on every cache layout mlx-lm's models create
(tiny random weights, fp32).

After a verify block of k tokens and ``commit(n)`` (n = 1: nothing accepted, a middle n, n = k: all
accepted) the cache state and the next token's logits equal those of feeding the same n tokens one
at a time; ``abort()`` gives back the start state exactly. The models' recurrent layers are scoped
(``hooks.recurrent.scope_model``, as the host does at load), so recurrent caches keep partial blocks
from their recorded forward, with no model replay.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import mlx.core as mx
import pytest
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    ConcatenateKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from mlx_speculative.hooks import recurrent
from mlx_speculative.testing import tiny_models as tm
from mlx_speculative.hooks.transaction import HANDLERS, CacheTransaction, UnsupportedCache, check_supported, handler_for

pytestmark = pytest.mark.unit

ARCHS = tm.ARCH_CONFIGS
EXPECTED = {  # the cache types each architecture's make_cache creates
    "llama": {KVCache}, "qwen3": {KVCache}, "gemma3_text": {RotatingKVCache, KVCache},
    "qwen3_5": {ArraysCache, KVCache}, "falcon_h1": {CacheList}, "mamba2": {ArraysCache}, "deepseek_v3": {KVCache},
    "gpt_oss": {RotatingKVCache, KVCache},
}
K = 6  # verify block: the pending token and 5 draft tokens
ATOL = 5e-5  # observed: <= 1.1e-5 (gemma3_text), 0 for llama, qwen3, qwen3_5

_models: Dict[str, Any] = {}


def model_for(arch: str) -> Any:
    if arch not in _models:
        mx.random.seed(3)
        model = tm.build_model(ARCHS[arch]())
        mx.eval(model.parameters())
        recurrent.scope_model(model)  # what the host does for every model it loads
        _models[arch] = model
    return _models[arch]


def tokens(n: int, seed: int) -> List[int]:
    return [int(t) for t in mx.random.randint(3, 384, (n,), key=mx.random.key(seed)).tolist()]


def prefilled(model: Any, prompt: List[int], max_kv_size: Optional[int] = None) -> List[Any]:
    cache = make_prompt_cache(model)
    if max_kv_size is not None:  # what make_prompt_cache gives models without make_cache
        cache = [RotatingKVCache(max_size=max_kv_size, keep=4) for _ in cache]
    model(mx.array([prompt[:-3]]), cache=cache)
    for t in prompt[-3:]:  # the tail one token at a time, as decoding leaves it
        model(mx.array([[t]]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def view(cache: Any) -> List[mx.array]:
    """What a cache holds that decoding reads (layout aside): valid K/V in temporal order, states."""
    if isinstance(cache, CacheList):
        return [a for c in cache.caches for a in view(c)]
    if isinstance(cache, ArraysCache):
        return [c for c in cache.cache if c is not None]
    if isinstance(cache, RotatingKVCache):
        if cache.keys is None:
            return []
        size, keep = min(cache.offset, cache.max_size), cache.keep

        def window(x: mx.array) -> mx.array:  # the kept first tokens, then the most recent ones
            x = cache._temporal_order(x)
            return mx.concatenate([x[..., :keep, :], x[..., x.shape[2] - (size - keep) :, :]], axis=2)

        return [window(cache.keys), window(cache.values), mx.array(cache.offset)]
    if isinstance(cache, (KVCache, ConcatenateKVCache)):
        if cache.keys is None:
            return []
        return [cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :], mx.array(cache.offset)]
    raise AssertionError(type(cache))


def assert_close(a: List[Any], b: List[Any], atol: float = ATOL) -> None:
    va = [x for c in a for x in view(c)]
    vb = [x for c in b for x in view(c)]
    assert len(va) == len(vb)
    for x, y in zip(va, vb):
        assert x.shape == y.shape, (x.shape, y.shape)
        assert mx.allclose(x, y, atol=atol, rtol=1e-5).item(), float(mx.abs(x - y).max())


def exact_state(cache: List[Any]) -> List[Any]:
    """Every field of every cache (copied), to check that abort gives back the start state bit for bit."""
    out = _fields(cache)
    out = [mx.array(x) if isinstance(x, mx.array) else x for x in out]
    mx.eval([x for x in out if isinstance(x, mx.array)])
    return out


def _fields(cache: List[Any]) -> List[Any]:
    out = []
    for c in cache:
        if isinstance(c, CacheList):
            out += _fields(list(c.caches))
        elif isinstance(c, ArraysCache):
            out += list(c.cache)
        else:
            out += [c.offset, getattr(c, "_idx", None)] + [x[..., : c.offset, :] if isinstance(c, KVCache) else x
                                                             for x in (c.keys, c.values)]
    return out


def same(a: List[Any], b: List[Any]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if isinstance(x, mx.array):
            assert x.shape == y.shape and mx.array_equal(x, y).item()
        else:
            assert x == y


def replay_for(model: Any, cache: List[Any], block: List[int]) -> Callable[[int], Any]:
    return lambda n: model(mx.array([block[:n]]), cache=cache)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_architecture_makes_the_expected_caches(arch: str) -> None:
    cache = make_prompt_cache(model_for(arch))
    assert {type(c) for c in cache} == EXPECTED[arch]
    check_supported(cache)


# prompt lengths: 21 wraps the sliding window (8) of gemma3_text / gpt_oss several times; 5 + K
# crosses the window edge inside the verify block.
@pytest.mark.parametrize("prompt_len", [21, 5])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_commit_equals_one_token_feeding(arch: str, prompt_len: int) -> None:
    model = model_for(arch)
    prompt, block = tokens(prompt_len, 1), tokens(K + 1, 2)
    nxt = block[K]
    for n in (1, 3, K):
        spec = prefilled(model, prompt)
        with CacheTransaction(spec, replay=replay_for(model, spec, block)) as txn:
            model(mx.array([block[:K]]), cache=spec)
            txn.commit(n)
        # Recurrent caches keep partial blocks from their recorded forward: no model replay.
        recurrent = sum(isinstance(c, ArraysCache) or (isinstance(c, CacheList) and isinstance(c.caches[0], ArraysCache))
                        for c in spec)
        assert txn.replayed == 0
        assert txn.taped == (recurrent if n < K else 0)
        ref = prefilled(model, prompt)
        for t in block[:n]:
            model(mx.array([[t]]), cache=ref)
        assert_close(spec, ref)
        got = model(mx.array([[nxt]]), cache=spec)
        want = model(mx.array([[nxt]]), cache=ref)
        assert mx.allclose(got, want, atol=ATOL, rtol=1e-5).item(), float(mx.abs(got - want).max())
        assert_close(spec, ref)
        # And a second round on top of the committed state.
        with CacheTransaction(spec, replay=replay_for(model, spec, block)) as txn:
            model(mx.array([block[:K]]), cache=spec)
            txn.commit(2)
        for t in block[:2]:
            model(mx.array([[t]]), cache=ref)
        assert_close(spec, ref)


def test_max_kv_size_rotating_cache_with_keep() -> None:
    """``max_kv_size`` gives RotatingKVCache(keep=4). Within the window rounds are exact; past it
    mlx-lm's multi-token forward ignores ``keep`` and differs from one-token decoding, so the
    transaction refuses the forward (by name) and restores the start state."""
    model = model_for("llama")
    block = tokens(K + 1, 12)
    for n in (1, 3, K):
        spec = prefilled(model, tokens(4, 11), max_kv_size=10)
        with CacheTransaction(spec) as txn:
            model(mx.array([block[:K]]), cache=spec)  # 4 + 6 <= 10: inside the window
            txn.commit(n)
        ref = prefilled(model, tokens(4, 11), max_kv_size=10)
        for t in block[:n]:
            model(mx.array([[t]]), cache=ref)
        assert_close(spec, ref)
        got, want = model(mx.array([[block[K]]]), cache=spec), model(mx.array([[block[K]]]), cache=ref)
        assert mx.allclose(got, want, atol=ATOL, rtol=1e-5).item()
    spec = prefilled(model, tokens(21, 11), max_kv_size=10)
    start = exact_state(spec)
    with pytest.raises(UnsupportedCache, match="RotatingKVCache.*keep=4"):
        with CacheTransaction(spec):
            model(mx.array([block[:K]]), cache=spec)
    same(exact_state(spec), start)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_abort_restores_the_start_state(arch: str) -> None:
    model = model_for(arch)
    prompt, block = tokens(21, 4), tokens(K, 5)
    cache = prefilled(model, prompt)
    start = exact_state(cache)
    start_logits = model(mx.array([[block[0]]]), cache=prefilled(model, prompt))
    with pytest.raises(RuntimeError):
        with CacheTransaction(cache, replay=replay_for(model, cache, block)):
            model(mx.array([block]), cache=cache)
            model(mx.array([[block[0]]]), cache=cache)  # a one-token update too (in place)
            raise RuntimeError("drafter failed")
    same(exact_state(cache), start)
    assert mx.array_equal(model(mx.array([[block[0]]]), cache=cache), start_logits).item()
    # commit(0) is an abort as well.
    cache = prefilled(model, prompt)
    txn = CacheTransaction(cache).begin()
    model(mx.array([block]), cache=cache)
    txn.commit(0)
    same(exact_state(cache), start)


def test_draft_style_updates_on_a_wrapped_rotating_cache() -> None:
    """A draft model's pattern: a catch-up chunk, then one-token steps; keep a prefix of them."""
    model = model_for("gemma3_text")
    prompt, fed = tokens(19, 6), tokens(7, 7)
    for keep in (0, 1, 3, 4, 5, 7):
        spec = prefilled(model, prompt)
        txn = CacheTransaction(spec).begin()
        model(mx.array([fed[:3]]), cache=spec)
        for t in fed[3:]:
            model(mx.array([[t]]), cache=spec)
        txn.commit(keep)
        ref = prefilled(model, prompt)
        if keep >= 3:
            model(mx.array([fed[:3]]), cache=ref)
            for t in fed[3:keep]:
                model(mx.array([[t]]), cache=ref)
        else:
            for t in fed[:keep]:
                model(mx.array([[t]]), cache=ref)
        assert_close(spec, ref, atol=1e-5)
        got, want = model(mx.array([[5]]), cache=spec), model(mx.array([[5]]), cache=ref)
        assert mx.allclose(got, want, atol=1e-5).item()


def test_plain_kv_types_trim() -> None:
    """QuantizedKVCache, ConcatenateKVCache, ChunkedKVCache: commit keeps a prefix, abort restores."""
    mx.random.seed(0)
    for make in (lambda: QuantizedKVCache(group_size=32, bits=8), ConcatenateKVCache, lambda: ChunkedKVCache(6)):
        cache = make()
        k = mx.random.normal((1, 2, 5, 64))
        cache.update_and_fetch(k, k)
        if isinstance(cache, ChunkedKVCache):
            cache.maybe_trim_front()
        before = (cache.offset, getattr(cache, "start_position", 0))
        txn = CacheTransaction([cache]).begin()
        new = mx.random.normal((1, 2, 4, 64))
        if isinstance(cache, ChunkedKVCache):
            cache.maybe_trim_front()
        cache.update_and_fetch(new, new)
        txn.commit(1)
        assert cache.offset == before[0] + 1
        txn = CacheTransaction([cache]).begin()
        if isinstance(cache, ChunkedKVCache):
            cache.update_and_fetch(new, new)
            cache.maybe_trim_front()  # the model may drop the front inside the forward
            assert cache.start_position > before[1]
        else:
            cache.update_and_fetch(new, new)
        txn.abort()
        assert cache.offset == before[0] + 1 and getattr(cache, "start_position", 0) == before[1]


def test_unknown_cache_is_refused_by_name() -> None:
    class MyCache:
        offset = 0

    with pytest.raises(UnsupportedCache, match="MyCache"):
        CacheTransaction([KVCache(), MyCache()])
    with pytest.raises(UnsupportedCache, match="MyCache"):
        check_supported([CacheList(KVCache(), MyCache())])
    assert set(HANDLERS) >= {KVCache, RotatingKVCache, ArraysCache, CacheList}
    for t, h in HANDLERS.items():
        assert all(hasattr(h, m) for m in ("begin", "commit", "abort")), t
    assert handler_for(KVCache()) is HANDLERS[KVCache]


def test_recurrent_partial_commit_needs_no_replay_callback() -> None:
    """A scoped recurrent layer's recording keeps a partial block of its cache by itself (the refusal
    without a replay callback, when a layer's recurrence is not recorded: tests/test_commit_recurrent.py)."""
    model = model_for("qwen3_5")
    prompt, block = tokens(9, 8), tokens(K, 9)
    cache = prefilled(model, prompt)
    txn = CacheTransaction(cache).begin()
    model(mx.array([block]), cache=cache)
    txn.commit(2)
    assert txn.taped == 2 and txn.replayed == 0  # two GatedDeltaNet layers
    ref = prefilled(model, prompt)
    for t in block[:2]:
        model(mx.array([[t]]), cache=ref)
    assert_close(cache, ref, atol=0.0)
    # A full commit keeps the forward's state as it is.
    txn = CacheTransaction(cache).begin()
    model(mx.array([block]), cache=cache)
    txn.commit(K)
    assert txn.replayed == 0 and txn.taped == 0


def test_commit_longer_than_written_is_refused_and_restores() -> None:
    model = model_for("gemma3_text")
    cache = prefilled(model, tokens(21, 13))
    start = exact_state(cache)
    txn = CacheTransaction(cache).begin()
    model(mx.array([tokens(K, 14)]), cache=cache)
    with pytest.raises(ValueError, match=f"cannot keep {K + 1} positions: the forward wrote {K}"):
        txn.commit(K + 1)
    same(exact_state(cache), start)
