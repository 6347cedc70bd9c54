"""Compiled verify forwards (plugin/cuda/compiled.py) compute the plain forward's function, token for token.

Direct: for llama and qwen3 targets (fp32, CPU) the compiled forward over a padded cache gives the plain
forward's logits, tapped hidden states and cache contents bit for bit, at widths 1..32 and offsets that
cross the buffer's growth steps, one trace serving every offset; with the attention routed through the
kernel's stand-in the described bounds (device scalars) reach it. Over a batch's rows at their own lengths
(plugin/cuda/ragged_cache.py) it gives the plain forward's logits and caches bit for bit too, one trace serving
every set of lengths. It declines what it cannot take (one position, other widths, rows other than the
caches', other caches, uneven offsets, switched off), and a model whose code needs an int offset falls back
with its caches untouched. Rounds: greedy speculative decoding with the policy's compiled forward (draft
model, n-gram, DFlash with its tapped layers; alone and batched) equals mlx-lm's plain decoding with zero,
partial and full acceptance.
"""

from __future__ import annotations

import copy
import itertools
from pathlib import Path
from typing import Any, Dict, List, Tuple

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache

from conftest import make_host, no_stop
from mlx_speculative.hooks import attention as host_attention
from mlx_speculative.hooks import taps
from mlx_speculative.hooks.batch import forward
from mlx_speculative.hooks.scheduler import Scheduler
from mlx_speculative.plugin import cuda
from mlx_speculative.plugin.cuda import backend as cuda_backend, compiled
from mlx_speculative.plugin.adaptive import BlockSizeController
from test_attention_dispatch import dispatcher
from test_attention_rounds import MAX_TOKENS, PROMPTS, decode, long_prompt, models  # noqa: F401 - models: the fixture

pytestmark = pytest.mark.integration


def prefilled(model: Any, n: int, bucket: int = 16) -> List[Any]:
    cache = cuda_backend.make_padded_cache(model, bucket=bucket)
    prompt = mx.array([[7 + i % 40 for i in range(n)]], dtype=mx.uint32)
    mx.eval(forward(model, prompt, cache, [])[0])
    return cache


def same_cache(a: List[Any], b: List[Any]) -> bool:
    """Equal offsets and equal keys/values at every position up to them (the buffers' lengths may differ)."""
    for x, y in zip(a, b):
        if x.offset != y.offset:
            return False
        n = x.offset
        if not (mx.array_equal(x.keys[..., :n, :], y.keys[..., :n, :]) and
                mx.array_equal(x.values[..., :n, :], y.values[..., :n, :])):
            return False
    return True


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_compiled_equals_plain_forward(arch: str, models: Dict[str, Any]) -> None:
    model = models[arch]["plain"]
    layers = [0, 2]
    taps.install_taps(model, layers)
    fwd = compiled.CompiledForward(cuda_backend.PaddedKVCache, (1, *compiled.DEFAULT_WIDTHS), grow=32)
    plain_cache = prefilled(model, 21)
    comp_cache = [copy.copy(c) for c in plain_cache]
    for step, W in enumerate([2, 16, 4, 32, 8, 16, 16, 1]):  # offsets 21 .. 116: across growth steps of 32
        toks = mx.array([[3 + (step * 7 + i) % 50 for i in range(W)]], dtype=mx.uint32)
        want, want_h = forward(model, toks, plain_cache, layers)
        got, got_h = fwd(model, toks, comp_cache, layers)
        assert mx.array_equal(got, want), (arch, W, mx.abs(got - want).max().item())
        assert sorted(got_h) == layers and all(mx.array_equal(got_h[i], want_h[i]) for i in layers)
        assert same_cache(comp_cache, plain_cache)
        assert comp_cache[0].keys.shape[2] % 32 == 0
        if step == 3:  # a rejected tail: both trimmed alike, the next forward overwrites it
            for c in plain_cache + comp_cache:
                c.trim(5)
    assert fwd.counts["compiled"] == 8 and not fwd.failed
    assert len(fwd._fns) == 1  # one compiled function per (model, layers): mx.compile keeps each shape's trace


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_compiled_equals_plain_forward_over_ragged_rows(arch: str, models: Dict[str, Any]) -> None:
    """Rows at their own lengths: the compiled forward's per-row offsets (a device array [B]) write, rope and mask
    each row as the plain forward does, across ragged commits and buffer growth; one trace per shape."""
    model = models[arch]["plain"]
    layers = [1]
    taps.install_taps(model, layers)
    fwd = compiled.CompiledForward(cuda_backend.PaddedKVCache, (1, *compiled.DEFAULT_WIDTHS), grow=32)
    rows = [prefilled(model, n) for n in (21, 5, 30)]
    plain_cache = [cuda_backend.PaddedKVCache.merge(list(layer)) for layer in zip(*rows)]
    comp_cache = [copy.copy(c) for c in plain_cache]
    for step, (W, keep) in enumerate([(4, [4, 1, 2]), (16, [3, 16, 0]), (8, [8, 8, 8]), (1, [1, 1, 1]), (16, [5, 2, 9])]):
        toks = mx.array([[3 + (b * 11 + step * 7 + i) % 50 for i in range(W)] for b in range(3)], dtype=mx.uint32)
        starts = plain_cache[0].lengths
        want, want_h = forward(model, toks, plain_cache, layers)
        got, got_h = fwd(model, toks, comp_cache, layers)
        assert mx.array_equal(got, want), (arch, W, mx.abs(got - want).max().item())
        assert mx.array_equal(got_h[1], want_h[1])
        for c in plain_cache + comp_cache:  # a round's ragged commit
            c.set_lengths([s + k for s, k in zip(starts, keep)])
        for x, y in zip(comp_cache, plain_cache):
            assert x.lengths == y.lengths and x.keys.shape[2] % 32 == 0
            for b, n in enumerate(x.lengths):
                assert mx.array_equal(x.keys[b, :, :n], y.keys[b, :, :n]) and mx.array_equal(x.values[b, :, :n], y.values[b, :, :n])
    assert fwd.counts["compiled"] == 5 and not fwd.failed and len(fwd._fns) == 1


def test_bounds_reach_the_attention_kernel_as_device_scalars(models: Dict[str, Any]) -> None:
    """The routed attention takes the compiled forward's described masks: key length and offset are arrays
    in the trace, and the kernel's stand-in computes the plain forward's logits from them."""
    model, _ = load(str(models["llama"]["target"]))
    disp, kernel = dispatcher()
    host_attention.route(model, disp)
    fwd = compiled.CompiledForward(cuda_backend.PaddedKVCache, grow=64)
    plain_cache = prefilled(model, 40)
    comp_cache = [copy.copy(c) for c in plain_cache]
    for W in (16, 16, 8, 16):  # buffers 48 -> 64 -> 128 (grown in steps of 64), the last call replays (16, 128)
        toks = mx.array([[5 + i for i in range(W)]], dtype=mx.uint32)
        want = forward(model, toks, plain_cache, [])[0]
        got = fwd(model, toks, comp_cache, [])[0]
        assert mx.allclose(got, want, atol=1e-5), mx.abs(got - want).max().item()
    traced = [c for c in kernel.calls if isinstance(c[2], mx.array)]
    assert traced and all(isinstance(c[3], mx.array) for c in traced)  # key_len and offset: device scalars
    assert len(traced) == 4 * 3  # traced once per shape (16, 64), (16, 128), (8, 128), four layers each


def test_declines_what_it_cannot_take(models: Dict[str, Any]) -> None:
    model = models["llama"]["plain"]
    fwd = compiled.CompiledForward(cuda_backend.PaddedKVCache)
    cache = prefilled(model, 10)
    toks = lambda w, b=1: mx.zeros((b, w), dtype=mx.uint32)  # noqa: E731
    assert fwd(model, toks(1), cache, []) is None and fwd(model, toks(3), cache, []) is None
    assert fwd(model, toks(4, 2), cache, []) is None
    assert fwd(model, toks(4), [KVCache() for _ in cache], []) is None
    uneven = [copy.copy(c) for c in cache]
    uneven[1].offset -= 1
    assert fwd(model, toks(4), uneven, []) is None
    fwd.enabled = False
    assert fwd(model, toks(4), cache, []) is None
    assert fwd.counts == {"plain: width": 2, "plain: rows": 1, "plain: caches": 2, "plain: off": 1}, fwd.counts
    assert all(c.offset == 10 for c in cache)
    with pytest.raises(ValueError, match="grow: got 0"):
        compiled.CompiledForward(cuda_backend.PaddedKVCache, grow=0)


class IntOffsetModel(llama.Model):
    """A model whose code needs its cache offset as a Python int (what a trace cannot follow)."""

    def __call__(self, inputs: mx.array, cache: Any = None, **kw: Any) -> mx.array:
        if cache is not None and int(cache[0].offset) < 0:
            raise AssertionError("unreachable")
        return super().__call__(inputs, cache=cache, **kw)


def test_trace_failure_falls_back_untouched(models: Dict[str, Any]) -> None:
    model = models["llama"]["plain"]
    odd = IntOffsetModel(model.args)
    odd.update(model.parameters())
    fwd = compiled.CompiledForward(cuda_backend.PaddedKVCache)
    cache = prefilled(odd, 12)
    before = [(c.keys, c.values, c.offset) for c in cache]
    toks = mx.zeros((1, 4), dtype=mx.uint32)
    assert fwd(odd, toks, cache, []) is None
    assert all(k is c.keys and v is c.values and n == c.offset for (k, v, n), c in zip(before, cache))
    assert id(odd) in fwd.failed and "eval" in fwd.failed[id(odd)].lower()
    assert fwd(odd, toks, cache, []) is None and fwd.counts["plain: trace failed"] == 2
    assert fwd(model, toks, prefilled(model, 12), []) is not None  # another model still compiles


def test_modes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(compiled.ENV, "off")
    assert compiled.forward_for(cuda_backend.PaddedKVCache) is None
    monkeypatch.setenv(compiled.ENV, "on")
    assert isinstance(compiled.forward_for(cuda_backend.PaddedKVCache), compiled.CompiledForward)
    assert compiled.forward_for(cuda_backend.PaddedKVCache, widths=[1, 16]).widths == {1, 16}
    with pytest.raises(ValueError, match=r"compiled forward widths: got \[0, 64\]; allowed: integers from 1 to 32"):
        compiled.forward_for(cuda_backend.PaddedKVCache, widths=[0, 64])
    monkeypatch.setenv(compiled.ENV, "auto")  # CPU: off
    assert compiled.forward_for(cuda_backend.PaddedKVCache) is None
    monkeypatch.setenv(compiled.ENV, "fast")
    with pytest.raises(ValueError, match="MLX_SPEC_COMPILED_FORWARD: got 'fast'; allowed: auto, on, off"):
        compiled.forward_for(cuda_backend.PaddedKVCache)


def compiled_host(monkeypatch: pytest.MonkeyPatch, speculative: Dict[str, Any], path: Path) -> Tuple[Any, Any]:
    monkeypatch.setenv(cuda.PADDED_ENV, "on")
    monkeypatch.setenv(compiled.ENV, "on")
    monkeypatch.setenv("MLX_SPEC_PREWARM_TOKENS", "0")
    host = make_host(dict(speculative, block_size=5, adaptive=False))
    target = host.load(str(path))
    assert isinstance(target.cache_policy.forward, compiled.CompiledForward)
    return host, target


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_draft_model_rounds_equal_plain_decoding(arch: str, models: Dict[str, Any],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    m = models[arch]
    host, target = compiled_host(monkeypatch, {"draft_model": str(m["drafter"])}, m["target"])
    fwd = target.cache_policy.forward
    refs = [m["refs"][tuple(p)] for p in PROMPTS]
    totals = {"zero": 0, "partial": 0, "full": 0}
    tokens, t = decode(host, target, PROMPTS, batch=False)
    assert tokens == refs and fwd.counts["compiled"] == t["rounds"] > 0, (fwd.counts, t)
    for key in totals:
        totals[key] += t[key]
    assert totals["zero"] > 0 and totals["partial"] > 0 and totals["full"] > 0, totals
    before = dict(fwd.counts)
    tokens, t = decode(host, target, PROMPTS, batch=True)  # batches: rows at their own lengths, compiled too
    declined = {k: v - before.get(k, 0) for k, v in fwd.counts.items() if k.startswith("plain") and k != "plain: width"}
    assert tokens == refs and fwd.counts["compiled"] > before["compiled"] and not any(declined.values()), fwd.counts
    assert not fwd.failed


def test_ngram_and_dflash_rounds_equal_plain_decoding(models: Dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    m = models["llama"]
    host, target = compiled_host(monkeypatch, {"kind": "ngram"}, m["target"])
    prompt = long_prompt()
    tokens, totals = decode(host, target, [prompt], batch=False)
    assert tokens == [m["refs"][tuple(prompt)]] and target.cache_policy.forward.counts["compiled"] == totals["rounds"] > 0
    host, target = compiled_host(monkeypatch, {"draft_model": str(models["dflash"]), "kind": "dflash"}, m["target"])
    fwd = target.cache_policy.forward
    tokens, totals = decode(host, target, PROMPTS, batch=False)  # the verify also taps layers 0 and 2
    assert tokens == [m["refs"][tuple(p)] for p in PROMPTS]
    assert fwd.counts["compiled"] == totals["rounds"] > 0 and not fwd.failed, fwd.counts
    # the drafter's rounds too, each in one call (block, head and argmax; drafting ahead, the round's context
    # first): each request's first block is drafted in place, every later one during the round before (the last
    # one drafted ahead is left unused when the request ends)
    assert fwd.counts["compiled dflash draft"] == len(PROMPTS), fwd.counts
    assert fwd.counts["compiled dflash draft ahead"] == totals["rounds"] and fwd.counts["compiled dflash block"] == 0
    # blocks of 5 padded to 8 (per-row widths); near a request's end the block keeps its size (no new shape)
    assert {k[1][:2] for k in fwd._fns} == {("forward", (0, 2)), ("dflash draft", True)}
    # a batch: its verify forwards and its drafts (one call for every row: the first in place, the later ones
    # ahead, each with the round's context) compile too
    before = dict(fwd.counts)
    tokens, totals = decode(host, target, PROMPTS, batch=True)
    assert tokens == [m["refs"][tuple(p)] for p in PROMPTS] and not fwd.failed
    grew = {k: v - before.get(k, 0) for k, v in fwd.counts.items()}
    assert grew["compiled"] > 0 and grew["compiled dflash draft"] > 0 and grew["compiled dflash draft ahead"] > 0, grew
    assert grew.get("plain: rows", 0) == 0 and grew.get("plain: caches", 0) <= len(PROMPTS), grew  # each row's first
    # context, appended to its empty caches, is plain


def test_prewarm_traces_every_shape_at_load(models: Dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """The host taps the policy's capture layers before ``prepare``, which traces each (width, buffer length)
    up to the prewarm tokens with them: a DFlash request within them meets no new trace."""
    m = models["llama"]
    monkeypatch.setenv(cuda.PADDED_ENV, "on")
    monkeypatch.setenv(compiled.ENV, "on")
    monkeypatch.setenv("MLX_SPEC_PREWARM_TOKENS", "256")  # the padded cache's first bucket: 256 positions
    monkeypatch.setattr(compiled, "DEFAULT_GROW", 128)
    host = make_host({"draft_model": str(models["dflash"]), "kind": "dflash", "block_size": 5, "adaptive": False})
    target = host.load(str(m["target"]))
    fwd = target.cache_policy.forward
    assert tuple(target.cache_policy.capture_layers) == (0, 2) and fwd.grow == 128
    assert all(getattr(type(taps.decoder_layers(target.model)[i]), "_spec_tapped", False) for i in (0, 2))
    # the target: widths 2, 4, 8 (block 5 -> 8) at buffer lengths 128 and 256; the drafter (its own calls,
    # plugin/cuda/compiled.py's call; its block 16 prewarms): appends of 1..16 and blocks of 2..16 with and without
    # widths, at each, as blocks (sampled rows), greedy drafts and drafts ahead
    assert fwd.counts["compiled"] == 6 and fwd.counts["compiled dflash block"] == 16, fwd.report()
    assert fwd.counts["compiled dflash draft"] == fwd.counts["compiled dflash draft ahead"] == 16, fwd.report()
    assert fwd.counts["compiled dflash context"] == 10 and len(fwd.trace_ms) == 6 + 3 * 16 + 10 and not fwd.failed
    tokens, totals = decode(host, target, [PROMPTS[0]], batch=False)  # 7 + 20 positions: buffers of 256
    assert tokens == [m["refs"][tuple(PROMPTS[0])]] and totals["rounds"] > 0
    assert len(fwd.trace_ms) == 64 and fwd.counts["compiled"] == 6 + totals["rounds"], fwd.report()
    # the first round's block in place, every later one drafted ahead (the last left unused): no trace of their own
    assert fwd.counts["compiled dflash draft"] == 16 + 1 and fwd.counts["compiled dflash draft ahead"] == 16 + totals["rounds"]


def test_adaptive_blocks_meet_no_new_trace(models: Dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Adaptive blocks change width between rounds (here the controller's sizes cycle): a block is drafted ahead
    for as many drafts as the round before it verifies (one the next round wants more of is dropped), so each
    call's widths are a pair prewarm traced, and such requests too meet no new trace."""
    m = models["llama"]
    monkeypatch.setenv(cuda.PADDED_ENV, "on")
    monkeypatch.setenv(compiled.ENV, "on")
    monkeypatch.setenv("MLX_SPEC_PREWARM_TOKENS", "256")
    monkeypatch.setattr(compiled, "DEFAULT_GROW", 128)
    sizes = itertools.cycle([16, 5, 3, 9, 12, 2])
    monkeypatch.setattr(BlockSizeController, "update", lambda self, accepted, drafted: setattr(self, "size", next(sizes)))
    host = make_host({"draft_model": str(models["dflash"]), "kind": "dflash", "block_size": 16, "adaptive": False})
    target = host.load(str(m["target"]))
    fwd = target.cache_policy.forward
    traced = len(fwd.trace_ms)
    widths = []
    original = compiled.CompiledForward.call

    def call(self: compiled.CompiledForward, key: Any, owner: Any, fn: Any, cache: Any, arrays: Any, *args: Any,
             **kw: Any) -> Any:
        if key[0] == "dflash draft" and key[2]:  # drafting ahead: (verified positions, block width)
            widths.append((arrays[-2].shape[1], arrays[0].shape[1]))
        return original(self, key, owner, fn, cache, arrays, *args, **kw)

    monkeypatch.setattr(compiled.CompiledForward, "call", call)
    tokens, totals = decode(host, target, PROMPTS, batch=False)
    assert tokens == [m["refs"][tuple(p)] for p in PROMPTS] and totals["rounds"] > 0
    assert len(set(widths)) > 2 and all(v == w for v, w in widths), widths  # widths changed between rounds
    assert len(fwd.trace_ms) == traced, fwd.report()


def test_a_row_joins_a_batch_after_compiled_rounds(models: Dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """A request decoding alone (compiled verify forwards, its buffers grown by them) is joined by a second
    one: the batch merges its caches (rows at their own lengths) and its rounds compile too; both equal plain
    decoding."""
    m = models["llama"]
    host, target = compiled_host(monkeypatch, {"draft_model": str(m["drafter"])}, m["target"])
    scheduler = Scheduler(host, target)
    first = scheduler.submit(PROMPTS[1], no_stop(MAX_TOKENS))
    got: Dict[int, List[int]] = {first.id: []}
    for _ in range(4):
        for request, event in scheduler.step():
            got[request.id].append(event.token)
    assert target.cache_policy.forward.counts["compiled"] > 0
    second = scheduler.submit(PROMPTS[0], no_stop(MAX_TOKENS))
    got[second.id] = []
    while scheduler.busy:
        for request, event in scheduler.step():
            got[request.id].append(event.token)
    assert got[first.id] == m["refs"][tuple(PROMPTS[1])] and got[second.id] == m["refs"][tuple(PROMPTS[0])]
    assert target.cache_policy.forward.counts["plain: rows"] == 0 and target.cache_policy.forward.counts["compiled"] > 4


def test_the_layers_of_a_call_share_their_write_positions() -> None:
    """The stand-in caches of one call (one per layer, the same offset) compute the write positions and the next
    offset once: every layer writes at the same index array, the offset after the write is one array, and each
    cache holds what it would alone (a cache written twice, or trimmed, computes them again from its own offset)."""
    offset = mx.array(5, dtype=mx.int32)
    shared: Dict[Any, Any] = {}
    buffers = [(mx.zeros((1, 2, 16, 4)), mx.zeros((1, 2, 16, 4))) for _ in range(3)]
    caches = [compiled.TraceCache(k, v, offset, shared) for k, v in buffers]
    new = [(mx.random.normal((1, 2, 3, 4)), mx.random.normal((1, 2, 3, 4))) for _ in caches]
    for c, (k, v) in zip(caches, new):
        c.update_and_fetch(k, v)
    assert len(shared) == 1 and len({id(c.offset) for c in caches}) == 1 and caches[0].offset.item() == 8
    for (k0, v0), c, (k, v) in zip(buffers, caches, new):
        alone = compiled.TraceCache(k0, v0, offset)
        alone.update_and_fetch(k, v)
        assert mx.array_equal(c.keys, alone.keys) and mx.array_equal(c.values, alone.values)
        assert mx.array_equal(c.keys[:, :, 5:8], k) and not mx.any(c.keys[:, :, 8:]).item()
    caches[0].trim(1)
    caches[0].update_and_fetch(*new[0])  # its own offset (7) now: new positions
    assert len(shared) == 2 and caches[0].offset.item() == 10 and mx.array_equal(caches[0].keys[:, :, 7:10], new[0][0])


def test_trimming_the_last_write_gives_back_the_offset_before_it() -> None:
    """A drafter's block writes its K/V and trims them off in every layer: the trimmed offset is the array it was
    before (so the next layer's writes and masks are keyed alike), and any other trim subtracts."""
    offset = mx.array(5, dtype=mx.int32)
    shared: Dict[Any, Any] = {}
    caches = [compiled.TraceCache(mx.zeros((1, 2, 16, 4)), mx.zeros((1, 2, 16, 4)), offset, shared) for _ in range(2)]
    kv = (mx.ones((1, 2, 3, 4)), mx.ones((1, 2, 3, 4)))
    for c in caches:
        c.update_and_fetch(*kv)
        c.trim(3)
        assert c.offset is offset
    assert len(shared) == 1  # the second layer wrote at the first one's positions
    caches[0].update_and_fetch(*kv)
    caches[0].trim(2)  # not the whole write: 8 - 2
    assert caches[0].offset is not offset and caches[0].offset.item() == 6
    caches[0].trim(1)  # no write since: 6 - 1
    assert caches[0].offset.item() == 5
