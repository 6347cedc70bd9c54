"""The attention dispatcher on the CPU: what it sends to a kernel is exact, everything else is mlx-lm's path.

A stand-in kernel (``cuda_attention.reference``: the CUDA kernel's contract in pure MLX, float32) takes
the place of the CUDA kernel, so the dispatcher's argument derivation (key length, offset, left padding
from the mask kind and the masks' descriptions) runs here. Checked: every described mask is exactly what
its description says; for each mask kind the dispatcher accepts, its output equals MLX's; every case it
must refuse (one query, more than 32, quantized caches, sinks, K/V head dims that differ, undescribed
arrays, too few keys, the real kernel's dtypes and head dims) runs mlx-lm's function itself; a wrong bound
changes a real forward's logits (so the greedy-equality tests can fail); scopes compose and come off.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import base
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

from mlx_speculative.drafters.dflash.model import Attention as DFlashAttention, ModelArgs as DFlashArgs
from mlx_speculative.hooks import attention as host_attention
from mlx_speculative.hooks import recurrent, scoping
from mlx_speculative.testing import tiny_models as tm
from mlx_speculative.hooks.attention import MaskSpec, described
from mlx_speculative.plugin import cuda
from mlx_speculative.plugin.cuda import attention, backend as cuda_backend, projections
from mlx_speculative.plugin.cuda import cuda_attention as ca
from mlx_speculative.plugin.cuda.backend import PaddedKVCache

pytestmark = pytest.mark.unit


class StandIn:
    """``cuda_attention.sdpa``'s contract computed by its float32 reference; records each call's bounds."""

    def __init__(self, shift: int = 0):
        self.calls: List[Tuple[int, Any, Any, Any]] = []
        self.shift = shift  # added to the offset: a deliberately wrong bound

    def __call__(self, q: mx.array, k: mx.array, v: mx.array, scale: float, key_len: Any, offset: Any,
                 key_start: Any = 0) -> mx.array:
        self.calls.append((q.shape[2], key_start, key_len, offset))
        return ca.reference(q, k, v, scale, key_len + self.shift, offset + self.shift, key_start)


def dispatcher(kernel: Optional[StandIn] = None, **kw: Any) -> Tuple[attention.Dispatcher, StandIn]:
    kernel = kernel or StandIn()
    kw.setdefault("min_keys", {"mlx-mask": 0, "array": 0})
    return attention.Dispatcher(attention.Kernel("stand-in", kernel, None, None), **kw), kernel


def materialize(spec: MaskSpec) -> mx.array:
    """[B|1, queries, span]: the boolean mask a description promises."""
    per = lambda x: (x if isinstance(x, mx.array) else mx.array(x)).reshape(-1, 1, 1)  # noqa: E731
    i, j = mx.arange(spec.queries)[:, None], mx.arange(spec.span)[None]
    return (j >= per(spec.key_start)) & (j < per(spec.key_len)) & (j <= per(spec.offset) + i)


def assert_described(mask: mx.array, cache: Any) -> MaskSpec:
    spec = described(mask, cache)
    assert spec is not None
    B = mask.shape[0] if mask.ndim == 4 else 1
    got = mask.reshape(B, *mask.shape[-2:]) if mask.ndim == 4 else mask[None]
    want = mx.broadcast_to(materialize(spec), got.shape)
    assert mx.array_equal(got, want).item(), spec
    return spec


def _kv(B: int, H: int, n: int, D: int = 16, seed: int = 0) -> Tuple[mx.array, mx.array]:
    mx.random.seed(seed)
    return mx.random.normal((B, H, n, D)), mx.random.normal((B, H, n, D))


# -- masks say what they hold -----------------------------------------------------------------

@pytest.mark.parametrize("bucket,prefill,N", [(4, 5, 3), (8, 8, 1), (16, 3, 16), (4, 0, 4)])
def test_padded_masks_are_what_they_describe(bucket: int, prefill: int, N: int) -> None:
    cache = PaddedKVCache(bucket, pad_steps=True)
    if prefill:
        cache.update_and_fetch(*_kv(1, 2, prefill))
    spec = assert_described(cache.make_mask(N), cache)
    assert (spec.key_start, spec.key_len, spec.offset) == (0, prefill + N, prefill)
    rows = [PaddedKVCache(bucket) for _ in range(3)]
    for c, n in zip(rows, (prefill + 2, 1, prefill + 5)):
        c.update_and_fetch(*_kv(1, 2, n))
    batch = PaddedKVCache.merge(rows)
    spec = assert_described(batch.make_mask(N), batch)
    lengths = [prefill + 2, 1, prefill + 5]
    assert spec.key_start == 0 and spec.offset.tolist() == lengths and spec.key_len.tolist() == [n + N for n in lengths]


def test_dflash_blocks_are_one_range_of_keys_in_any_cache() -> None:
    """The DFlash block's K/V go right after the context in its cache (then are trimmed off): context and
    block are one range of keys in plain, batched and padded caches, described, and the dispatcher's
    kernel computes the layer's output from the bounds (per-row widths and left padding)."""
    args = DFlashArgs.from_dict({"hidden_size": 32, "num_hidden_layers": 1, "intermediate_size": 64,
                                 "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
                                 "vocab_size": 64, "rms_norm_eps": 1e-6, "block_size": 4, "num_target_layers": 4,
                                 "mask_token_id": 63, "max_position_embeddings": 128})
    layer = DFlashAttention(args, 0)
    padded = PaddedKVCache(16)
    spec = assert_described(layer.mask(4, 16, 6, 6, None, mx.array([3]), padded), padded)  # 16 slots
    assert (spec.queries, spec.key_start, spec.offset) == (1, 0, 16) and spec.key_len.tolist() == [9]
    assert layer.mask(4, 10, 6, 6, None, None, KVCache()) is None  # plain cache, whole block: every key is real
    disp, kernel = dispatcher()
    mx.random.seed(5)
    context, x = mx.random.normal((1, 6, 32)), mx.random.normal((2, 4, 32))

    def caches() -> List[Any]:
        plain, padded = KVCache(), PaddedKVCache(16)
        rows = [KVCache(), KVCache()]
        for c in (plain, padded):
            layer.append(context, c)
        ragged = [PaddedKVCache(16), PaddedKVCache(16)]  # rows at their own lengths (plugin/cuda/ragged_cache.py)
        for c, n in zip(rows + ragged, (6, 3, 6, 3)):
            layer.append(context[:, :n], c)
        return [plain, padded, KVCache.merge(rows), PaddedKVCache.merge(ragged)]

    def run(cs: List[Any]) -> List[mx.array]:
        return [layer(x[:1], c, mx.array([3])) for c in cs[:2]] + [layer(x, c, mx.array([4, 2])) for c in cs[2:]]

    want = run(caches())
    assert mx.abs(want[2] - want[3]).max().item() < 1e-5  # left-padded rows and rows at their own lengths
    host_attention.route(layer, disp)
    got_caches = caches()
    got = run(got_caches)
    for w, g in zip(want, got):
        assert mx.abs(w - g).max().item() < 1e-5
    assert disp.counts["kernel"] == 4 and isinstance(kernel.calls[-2][1], mx.array)  # left padding [0, 3]
    assert [c.size() for c in got_caches[:3]] == [6, 6, 6]  # the blocks were trimmed off again
    assert got_caches[3].lengths == (6, 3) and kernel.calls[-1][2].tolist() == [10, 5]  # per-row key lengths


# -- what the dispatcher takes is exact --------------------------------------------------------

def _mlx(q: mx.array, k: Any, v: Any, cache: Any, mask: Any, sinks: Any = None) -> mx.array:
    return scaled_dot_product_attention(q, k, v, cache=cache, scale=0.25, mask=mask, sinks=sinks)


def test_every_mask_kind_taken_equals_mlx() -> None:
    disp, kernel = dispatcher()
    mx.random.seed(3)
    cases = []
    q = mx.random.normal((1, 4, 5, 16))
    k, v = _kv(1, 2, 12)
    cases += [(q, k, v, None, None), (q, k, v, None, "causal")]
    cache = PaddedKVCache(8)
    cache.update_and_fetch(*_kv(1, 2, 9, seed=1))
    mask = cache.make_mask(5)
    cases.append((q, *cache.update_and_fetch(*_kv(1, 2, 5, seed=2)), cache, mask))  # 14 real keys of 16 slots
    rows = [PaddedKVCache(8) for _ in range(3)]
    for i, (c, n) in enumerate(zip(rows, (9, 2, 5))):
        c.update_and_fetch(*_kv(1, 2, n, seed=4 + i))
    batch = PaddedKVCache.merge(rows)
    qb = mx.random.normal((3, 4, 5, 16))
    mask = batch.make_mask(5)
    cases.append((qb, *batch.update_and_fetch(*_kv(3, 2, 5, seed=7)), batch, mask))
    for q, k, v, c, mask in cases:  # c: the cache that made the mask (it carries the description)
        got = disp(q, k, v, cache=c, scale=0.25, mask=mask)
        assert mx.abs(got - _mlx(q, k, v, None, mask)).max().item() < 1e-5, mask if isinstance(mask, str) else type(mask)
    assert disp.counts == {"kernel": 4} and len(kernel.calls) == 4
    assert kernel.calls[-1][1] == 0 and kernel.calls[-1][3].tolist() == [9, 2, 5]  # each row at its own offset


def test_the_refused_cases_run_mlx_lm_s_function() -> None:
    disp, kernel = dispatcher(min_keys={"mlx-mask": 64, "array": 0})
    q5, (k, v) = mx.random.normal((1, 4, 5, 16)), _kv(1, 2, 12)
    quant = QuantizedKVCache(group_size=32, bits=8)
    qk, qv = quant.update_and_fetch(*_kv(1, 2, 12, D=32))
    free = mx.ones((5, 12), dtype=mx.bool_)  # built by nobody who described it
    cases = [
        ((mx.random.normal((1, 4, 1, 16)), k, v, None, None), "queries"),
        ((mx.random.normal((1, 4, 33, 16)), *_kv(1, 2, 40), None, "causal"), "queries"),
        ((mx.random.normal((1, 4, 5, 32)), qk, qv, quant, "causal"), "quantized"),
        ((q5, k, v, None, "causal", mx.zeros((4,))), "sinks"),
        ((q5, k, v[..., :8], None, "causal"), "shapes"),
        ((q5, k, v, None, free), "mask"),
        ((mx.random.normal((1, 4, 16, 16)), k, v, None, "causal"), "mask"),  # fewer keys than queries
        ((q5, k, v, None, "causal"), "keys"),  # 12 keys < 64
    ]
    for args, why in cases:
        fresh = lambda: (args[0] + 0,) + args[1:]  # noqa: E731 - mlx-lm's quantized path scales queries in place
        got = disp(*fresh()[:4], scale=0.25, mask=args[4], sinks=args[5] if len(args) > 5 else None)
        assert mx.array_equal(got, _mlx(*fresh())).item(), why
        assert disp.counts[f"mlx: {why}"] >= 1, (why, disp.counts)
    assert kernel.calls == [] and "kernel" not in disp.counts
    real = attention.Dispatcher(attention.Kernel("cuda-shaped", StandIn()), min_keys={"mlx-mask": 0, "array": 0})
    assert real.plan(q5, k, v, None, "causal", None) == (None, "dtype")  # float32: the CUDA kernel is bf16/fp16
    half = lambda x: x.astype(mx.bfloat16)  # noqa: E731
    assert real.plan(half(q5), half(k), half(v), None, "causal", None) == (None, "head dim")  # 16: not 64/128/256
    wide = [half(mx.zeros((1, 4, 5, 64)))] + [half(mx.zeros((1, 2, 12, 64)))] * 2
    assert real.plan(*wide, None, "causal", None)[0] is not None
    real.enabled = False
    assert real.plan(*wide, None, "causal", None) == (None, "off")


def test_a_wrong_bound_changes_a_real_forward() -> None:
    """A kernel handed offset and key_len one too far reads a padding key: the logits move (so the
    greedy-equality tests can fail)."""
    model = tm.build_model(tm.llama_config(num_hidden_layers=2))
    tokens = mx.array([[5, 6, 7, 8, 9, 10, 11, 12, 13]])
    outs = []
    for shift in (0, 1):
        disp, kernel = dispatcher(StandIn(shift))
        assert host_attention.route(model, disp) == 2
        cache = cuda_backend.make_padded_cache(model, bucket=16)
        model(tokens[:, :6], cache=cache)
        outs.append(model(tokens[:, 6:], cache=cache))  # 3 queries over 9 of 16 slots
        assert len(kernel.calls) == 4
    host_attention.unroute(model)
    cache = cuda_backend.make_padded_cache(model, bucket=16)
    model(tokens[:, :6], cache=cache)
    want = model(tokens[:, 6:], cache=cache)
    assert mx.abs(outs[0] - want).max().item() < 1e-4
    assert mx.abs(outs[1] - want).max().item() > 1e-3


def test_kernel_params_are_built_once_per_forward() -> None:
    """A kernel's ``params`` (the CUDA kernel's per-row bounds array) is built once per mask and shared by
    the layers of a forward; the next forward's mask builds its own."""
    seen: List[Any] = []

    def fn(q: mx.array, k: mx.array, v: mx.array, scale: float, key_len: Any, offset: Any, key_start: Any = 0,
           params: Any = None) -> mx.array:
        seen.append(params)
        assert params[1:] == (key_len, offset, key_start)
        return ca.reference(q, k, v, scale, key_len, offset, key_start)

    kernel = attention.Kernel("stand-in", fn, None, None, params=lambda B, *bounds: (object(), *bounds))
    disp = attention.Dispatcher(kernel, min_keys={"mlx-mask": 0, "array": 0})
    model = tm.build_model(tm.llama_config(num_hidden_layers=3))
    host_attention.route(model, disp)
    rows = [cuda_backend.make_padded_cache(model, bucket=16) for _ in range(2)]
    for c, n in zip(rows, (7, 3)):
        model(mx.array([list(range(5, 5 + n))]), cache=c)
    batch = [PaddedKVCache.merge(list(layer)) for layer in zip(*rows)]
    seen.clear()  # the prefills' (one mask each, too)
    for _ in range(2):
        model(mx.array([[20, 21, 22], [30, 31, 32]]), cache=batch)
    assert len(seen) == 6 and len({id(p) for p in seen[:3]}) == 1 and seen[3] is not seen[0]
    assert all(p is seen[3] for p in seen[3:])


@pytest.mark.parametrize("arch,why", [("deepseek_v3", "mask"), ("gpt_oss", "sinks")])  # MLA adds its rope scores as a float mask
def test_real_layers_the_kernel_cannot_take(arch: str, why: str) -> None:
    model = tm.build_model(tm.EXTRA_CONFIGS[arch]())
    tokens = mx.array([[5, 6, 7, 8, 9, 10]])
    want = model(tokens, cache=make_prompt_cache(model))
    disp, kernel = dispatcher()
    assert host_attention.route(model, disp) > 0
    assert mx.array_equal(model(tokens, cache=make_prompt_cache(model)), want).item()
    assert kernel.calls == [] and disp.counts[f"mlx: {why}"] > 0, disp.counts


# -- the mechanism ------------------------------------------------------------------------------

class Mixer(nn.Module):
    """A layer with an attention call and a conv input built by concatenation (both scopes apply)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def __call__(self, x: mx.array, cache: Any = None) -> mx.array:
        h = mx.concatenate([x, self.proj(x)], axis=1)[:, None]  # [B, 1, 2L, 8]
        return scaled_dot_product_attention(h, h, h, cache=None, scale=1.0, mask=None)


def test_scopes_compose_per_instance_and_come_off() -> None:
    a, b = Mixer(), Mixer()
    x = mx.random.normal((1, 3, 8))
    want = a(x)
    assert recurrent.scope_model(a) == 1
    disp, kernel = dispatcher()
    assert host_attention.route(a, disp) == 1 and host_attention.route(a, disp) == 1  # idempotent
    cls = type(a)
    assert cls.__mro__[1] is Mixer and cls._spec_recurrent and cls._spec_attention
    assert [s.name for s in scoping.scopes_of(a)] == ["recurrent", "attention"]
    assert type(b) is Mixer and Mixer.__call__.__globals__["scaled_dot_product_attention"] is base.scaled_dot_product_attention
    assert mx.abs(a(x) - want).max().item() < 1e-5 and len(kernel.calls) == 1  # 6 queries, no mask
    b(x)
    assert len(kernel.calls) == 1  # the other instance: mlx-lm's function
    assert host_attention.routed(a) == 1 and host_attention.unroute(a) == 1 and host_attention.routed(a) == 0
    assert type(a).__mro__[1] is Mixer and getattr(type(a), "_spec_recurrent", False)
    assert not getattr(type(a), "_spec_attention", False)


def test_off_on_the_cpu_and_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(attention.ENV, raising=False)
    monkeypatch.delenv(attention.ENV_MIN_KEYS, raising=False)
    monkeypatch.delenv(cuda.PADDED_ENV, raising=False)
    assert not ca.available() and attention.resolve_mode() is False and attention.dispatcher_for() is None
    assert cuda_backend.policy_for() is None
    assert cuda_backend.policy_for("on").attention is None
    monkeypatch.setenv(attention.ENV, "off")
    assert attention.dispatcher_for() is None
    monkeypatch.setenv(attention.ENV, "on")
    with pytest.raises(ValueError, match="MLX_SPEC_ATTENTION_KERNEL on: the attention kernel needs MLX built with "
                                         "CUDA.*allowed here: auto, off"):
        cuda_backend.policy_for()
    monkeypatch.setenv(attention.ENV, "always")
    with pytest.raises(ValueError, match="allowed: auto, on, off"):
        attention.resolve_mode()
    monkeypatch.setenv(attention.ENV_MIN_KEYS, "0")
    assert attention.min_keys_from_env() == {"mlx-mask": 0, "array": 0}
    monkeypatch.setenv(attention.ENV_MIN_KEYS, "many")
    with pytest.raises(ValueError, match="non-negative integer"):
        attention.min_keys_from_env()
    disp = attention.Dispatcher(attention.cuda_kernel())
    assert disp.min_keys == attention.MIN_KEYS and disp.kernel.fn is ca.sdpa
    assert isinstance(cuda_backend.RoutedPolicy(disp).make_cache(tm.build_model(tm.llama_config()))[0], KVCache)


def test_thresholds_follow_the_cache_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Behind the padded caches the kernel keeps its measured crossovers; behind mlx-lm's caches (exact key
    lengths, where MLX's path compiles per length) it takes every call it can; the environment wins."""
    for env in (attention.ENV, attention.ENV_MIN_KEYS, cuda.PADDED_ENV, projections.ENV):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setattr(cuda, "available", lambda: True)  # the package's own check: the backends' wiring only
    padded, routed = cuda_backend.policy_for("on"), cuda_backend.policy_for("off")
    assert isinstance(padded, cuda_backend.ShapeStablePolicy) and padded.attention.min_keys == attention.MIN_KEYS
    assert isinstance(routed, cuda_backend.RoutedPolicy) and routed.attention.min_keys == attention.ROUTED_MIN_KEYS
    assert attention.ROUTED_MIN_KEYS == {"mlx-mask": 0, "array": 0} != attention.MIN_KEYS
    monkeypatch.setenv(attention.ENV_MIN_KEYS, "512")
    for policy in (cuda_backend.policy_for("on"), cuda_backend.policy_for("off")):
        assert policy.attention.min_keys == {"mlx-mask": 512, "array": 512}
    # The projection dispatcher rides along where its kernel runs (the same check), and stands alone.
    assert isinstance(padded.projections, projections.Projections) and isinstance(routed.projections, projections.Projections)
    monkeypatch.setenv(attention.ENV, "off")
    alone = cuda_backend.policy_for("off")
    assert isinstance(alone, cuda_backend.RoutedPolicy) and alone.attention is None and alone.projections is not None
    monkeypatch.setenv(projections.ENV, "off")
    assert isinstance(cuda_backend.policy_for("on"), cuda_backend.ShapeStablePolicy) and cuda_backend.policy_for("off") is None
