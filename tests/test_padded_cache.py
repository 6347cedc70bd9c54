"""The shape-stable cache policy (plugin/cuda/backend.py) gives the same tokens as mlx-lm's KVCache (fp32, CPU).

Through the public host: loading a target with a drafter and ``MLX_SPEC_PADDED_CACHE=on`` makes the
speculative plugin's ``host_cache_policy`` return a ``ShapeStablePolicy``; requests alone then hold
``PaddedKVCache``s and batches ``RaggedBatchKVCache``s, and rounds and the host's plain steps on
them give the tokens of ``generate_step`` on plain caches. Prompts of ~250 tokens cross the
policy's 256-key bucket while decoding; the cache-level tests use a bucket of 16.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Set, Tuple

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from conftest import PROMPTS, encode, greedy_reference, make_host, no_stop
from mlx_speculative.hooks.prompt_cache import copy_caches
from mlx_speculative.hooks.scheduler import Scheduler
from mlx_speculative.hooks.api import CachePolicy
from mlx_speculative.hooks.transaction import HANDLERS, CacheTransaction, check_supported, handler_for
from mlx_speculative.plugin import cuda
from mlx_speculative.plugin.cuda import backend as cuda_backend
from mlx_speculative.plugin.cuda.backend import (
    PaddedKVCache,
    ShapeStablePolicy,
    make_padded_cache,
    pow2_width,
)
from mlx_speculative.plugin.cuda.ragged_cache import RaggedBatchKVCache

pytestmark = pytest.mark.integration

BUCKET = 16  # small, so that every sequence of the cache-level tests crosses several buckets
MAX_TOKENS = 40
LONG = (242, 236, 251)  # prompt lengths whose requests cross the 256-key bucket while decoding


@pytest.mark.parametrize("pad_steps", [False, True])
def test_logits_match_kvcache_through_chunks_and_trims(llama_pair: Dict[str, Any], pad_steps: bool) -> None:
    model = load(str(llama_pair["target"]))[0]
    ref, pad = make_prompt_cache(model), make_padded_cache(model, bucket=BUCKET, pad_steps=pad_steps)
    assert all(type(c) is PaddedKVCache for c in pad)
    # prefill chunk, 1-token steps, a block, a trim (rejected drafts), another block crossing a bucket
    feeds = [list(range(5, 18)), [3], [4], list(range(20, 27)), "trim4", list(range(30, 41)), [7], "trim1", [9]]
    for feed in feeds:
        if isinstance(feed, str):
            n = int(feed[4:])
            for a, b in zip(ref, pad):
                a.trim(n), b.trim(n)
            continue
        x = mx.array([feed], dtype=mx.uint32)
        la, lb = model(x, cache=ref), model(x, cache=pad)  # [1, n, V]
        assert mx.allclose(la, lb, atol=1e-5, rtol=1e-5).item(), feed
        assert (mx.argmax(la, -1) == mx.argmax(lb, -1)).all().item()
        assert pad[0].offset == ref[0].offset and pad[0].keys.shape[2] % BUCKET == 0


def test_mask_hides_padding_and_stale_tail() -> None:
    c = PaddedKVCache(bucket=8, pad_steps=True)
    k = mx.ones((1, 2, 5, 4))
    c.update_and_fetch(k, k)
    c.trim(2)  # positions 3, 4 are stale
    mask = c.make_mask(2)  # rows for positions 3, 4
    assert mask.shape == (2, 8)
    assert mask.tolist() == [[True] * 4 + [False] * 4, [True] * 5 + [False] * 3]
    keys, _ = c.update_and_fetch(mx.zeros((1, 2, 2, 4)), mx.zeros((1, 2, 2, 4)))
    assert keys.shape == (1, 2, 8, 4) and c.offset == 5
    assert ShapeStablePolicy(bucket=8).verify_width(5) == 8 and CachePolicy().verify_width(5) == 5
    assert [pow2_width(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
    assert c.make_mask(1).shape == (1, 8)
    single = PaddedKVCache(bucket=8)  # default: one-token steps keep exact lengths, no mask
    single.update_and_fetch(k, k)
    assert single.make_mask(1) is None
    assert single.update_and_fetch(k[:, :, :1], k[:, :, :1])[0].shape == (1, 2, 6, 4)


def test_transaction_handler_declared() -> None:
    """The padded caches declare their handler (no global table to register into)."""
    assert PaddedKVCache not in HANDLERS and RaggedBatchKVCache not in HANDLERS
    assert handler_for(PaddedKVCache(bucket=4)) is PaddedKVCache.transaction_handler
    assert handler_for(RaggedBatchKVCache([0, 1], bucket=4)) is RaggedBatchKVCache.transaction_handler
    check_supported([PaddedKVCache(bucket=4), RaggedBatchKVCache([0], bucket=4)])
    txn = CacheTransaction([PaddedKVCache(bucket=4)]).begin()
    txn.caches[0].update_and_fetch(mx.zeros((1, 1, 6, 2)), mx.zeros((1, 1, 6, 2)))
    txn.commit(2)
    assert txn.caches[0].offset == 2


def test_backend_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cuda.PADDED_ENV, raising=False)
    assert cuda.device() == "cpu"
    assert cuda.padded_on("auto") is False  # CPU: off
    assert cuda.padded_on("on") is True
    assert cuda.backend_for() is None and cuda_backend.policy_for() is None
    assert isinstance(cuda.backend_for("on"), ShapeStablePolicy)
    monkeypatch.setenv(cuda.PADDED_ENV, "off")
    assert cuda.padded_on() is False and cuda.backend_for() is None
    monkeypatch.setenv(cuda.PADDED_ENV, "on")
    assert isinstance(cuda.backend_for(), ShapeStablePolicy)
    with pytest.raises(ValueError, match="allowed: auto, on, off"):
        cuda.padded_on("sometimes")


# -- through the host ---------------------------------------------------------------------------

_REFS: Dict[Tuple[str, Tuple[int, ...], int], List[int]] = {}


def prompts_for(target: Any) -> List[List[int]]:
    """Short prompts, and long ones that cross the 256-key bucket while decoding."""
    short = [encode(target, t) for t in PROMPTS[:4]]
    text = " ".join(PROMPTS)
    stream = encode(target, " ".join([text] * 8))
    assert len(stream) > max(LONG)
    return short + [stream[i * 7 : i * 7 + n] for i, n in enumerate(LONG)]


def reference(pair_name: str, target: Any, prompt: List[int], n: int) -> List[int]:
    """generate_step on mlx-lm's KVCache, once per (target, prompt, length)."""
    key = (pair_name, tuple(prompt), n)
    if key not in _REFS:
        _REFS[key] = greedy_reference(target.model, prompt, n)
    return _REFS[key]


def decode(host: Any, target: Any, prompts: List[List[int]], n: int,
           options: Optional[Dict[str, Any]] = None) -> Tuple[List[List[int]], Set[type], List[Any]]:
    """Run ``prompts`` through the host's scheduler together: each request's tokens, the cache
    classes its prefill and its batches held, and each request's speculative stats (None when it ran no rounds)."""
    scheduler = Scheduler(host, target)
    requests = [scheduler.submit(p, no_stop(n, options=dict(options or {}))) for p in prompts]
    got: Dict[int, List[int]] = {r.id: [] for r in requests}
    seen: Set[type] = {type(c) for r in requests for c in r.caches}  # made for the prefill
    while scheduler.busy:
        for request, event in scheduler.step():
            if event.emitted:
                got[request.id].append(event.token)
        for batch in scheduler.batches():
            seen |= {type(c) for c in batch.cache}
    return [got[r.id] for r in requests], seen, [r.state.report.get("speculative") for r in requests]


def padded_host(monkeypatch: pytest.MonkeyPatch, speculative: Dict[str, Any], path: Any) -> Tuple[Any, Any]:
    monkeypatch.setenv(cuda.PADDED_ENV, "on")
    monkeypatch.setenv("MLX_SPEC_PREWARM_TOKENS", "512")
    host = make_host(speculative)
    target = host.load(str(path))
    assert isinstance(target.cache_policy, ShapeStablePolicy)
    assert target.cache_policy.bucket == cuda_backend.DEFAULT_BUCKET
    drafter = target.attachments["speculative"].drafter
    assert all(type(c) is PaddedKVCache for c in drafter.make_cache())  # the draft model's caches too
    return host, target


def _compare(pair_name: str, pair: Dict[str, Any], speculative: Dict[str, Any], monkeypatch: pytest.MonkeyPatch,
             lengths: Tuple[int, ...] = (MAX_TOKENS,), options: Optional[Dict[str, Any]] = None) -> Dict[str, int]:
    """Requests alone, then all together as one batch: tokens equal to KVCache decoding."""
    host, target = padded_host(monkeypatch, speculative, pair["target"])
    plain_kv = make_host(None, plugins=False)  # mlx-lm's caches
    totals = {"zero": 0, "partial": 0, "full": 0}

    def count(stats: List[Any]) -> None:
        for s in stats:
            if options and options.get("speculative") is False:
                assert s is None
                continue
            assert s is not None and s.fallback is None
            for key, c in s.rounds_by_acceptance.items():
                totals[key] += c

    prompts = prompts_for(target)
    for n in lengths:
        refs = [reference(pair_name, target, p, n) for p in prompts]
        for p, ref in zip(prompts, refs):
            tokens, seen, stats = decode(host, target, [p], n, options)
            assert tokens == [ref], (len(p), n)
            assert seen == {PaddedKVCache}, seen
            count(stats)
        for p, ref in zip(prompts[:2] + prompts[-1:], refs[:2] + refs[-1:]):
            assert plain_kv.generate(target, p, no_stop(n)).tokens == ref
        tokens, seen, stats = decode(host, target, prompts, n, options)
        assert tokens == refs, n
        assert not seen & {KVCache, BatchKVCache}, seen
        assert RaggedBatchKVCache in seen or n == 1, seen  # one token: every request ends at its prefill
        count(stats)
    return totals


@pytest.mark.parametrize("pair_name", ["llama_pair", "qwen3_pair"])
def test_round_loop_padded_equals_kvcache(pair_name: str, request: pytest.FixtureRequest,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    pair = request.getfixturevalue(pair_name)
    totals = _compare(pair_name, pair, {"draft_model": str(pair["drafter"]), "block_size": 6}, monkeypatch)
    assert totals["zero"] > 0 and totals["partial"] > 0 and totals["full"] > 0, totals


def test_plain_steps_padded_equal_kvcache(llama_pair: Dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests that turn rounds off decode with the host's plain step, on the policy's caches."""
    _compare("llama_pair", llama_pair, {"draft_model": str(llama_pair["drafter"]), "block_size": 6}, monkeypatch,
             lengths=(1, 9, MAX_TOKENS), options={"speculative": False})


def test_round_loop_padded_full_acceptance(llama_pair: Dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    totals = _compare("llama_pair", llama_pair, {"draft_model": str(llama_pair["target"]), "block_size": 5},
                      monkeypatch, lengths=(23,))
    assert totals["full"] > 0 and totals["zero"] == totals["partial"] == 0, totals


def test_round_loop_padded_zero_acceptance(qwen3_pair: Dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    totals = _compare("qwen3_pair", qwen3_pair, {"draft_model": str(qwen3_pair["random_drafter"]), "block_size": 4,
                                                 "adaptive": False}, monkeypatch, lengths=(17,))
    assert totals["zero"] > 0, totals


@pytest.mark.parametrize("mode", ["on", "off"])
def test_plain_decoding_takes_the_policy_where_it_is_on(llama_pair: Dict[str, Any], mode: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """With speculation off, plain decoding takes the padded policy where it is on (plugin/hookimpls.py
    ``plain_backend``), mlx-lm's caches where it is off; the tokens are mlx-lm's either way."""
    monkeypatch.setenv(cuda.PADDED_ENV, mode)
    host = make_host(None)
    target = host.load(str(llama_pair["target"]))
    assert type(target.cache_policy) is (ShapeStablePolicy if mode == "on" else CachePolicy)
    prompt = encode(target, PROMPTS[1])
    tokens, seen, stats = decode(host, target, [prompt], 9)
    assert tokens == [greedy_reference(target.model, prompt, 9)] and stats == [None]
    assert seen == ({PaddedKVCache} if mode == "on" else {KVCache})


def test_padded_rows_merge_decode_extract_and_commit_ragged(llama_pair: Dict[str, Any]) -> None:
    """PaddedKVCache rows merge into a RaggedBatchKVCache (each row at its own length); batched forwards equal
    each row alone; a ragged commit keeps each row's own length without moving a key; rows extract back to
    PaddedKVCache; a row leaving and one joining keep the others' lengths."""
    model = load(str(llama_pair["target"]))[0]
    prompts = [list(range(5, 18)), list(range(40, 45)), list(range(60, 81))]  # 13, 5 and 21 tokens
    alone = [make_padded_cache(model, bucket=BUCKET) for _ in prompts]
    for p, c in zip(prompts, alone):
        model(mx.array([p]), cache=c)
    rows = [make_padded_cache(model, bucket=BUCKET) for _ in prompts]
    for p, c in zip(prompts, rows):
        model(mx.array([p]), cache=c)
    batch = [PaddedKVCache.merge(list(layer)) for layer in zip(*rows)]
    assert all(type(c) is RaggedBatchKVCache for c in batch)
    assert batch[0].lengths == (13, 5, 21) and batch[0].offset.tolist() == [13, 5, 21]

    def same_logits(fed: List[List[int]]) -> None:
        got = model(mx.array(fed), cache=batch)  # [B, W, V]
        for b, c in enumerate(alone):
            want = model(mx.array([fed[b]]), cache=c)  # [1, W, V]
            assert mx.allclose(got[b : b + 1], want, atol=1e-5, rtol=1e-5).item(), (b, float(mx.abs(got[b] - want[0]).max()))
        keys, _ = batch[0].keys_and_values()  # what attention reads: whole buckets
        assert keys.shape[2] % BUCKET == 0 and keys.shape[2] >= max(batch[0].lengths)

    same_logits([[3, 4, 5, 6], [7, 8, 9, 10], [11, 12, 13, 14]])  # a block: keys 25 (bucket 32)
    for t in range(3):  # one-token steps
        same_logits([[20 + t], [30 + t], [40 + t]])
    # A round: every row verifies 6 positions and keeps its own count (1, 4 and 6), crossing a bucket.
    block = [[50, 51, 52, 53, 54, 55], [60, 61, 62, 63, 64, 65], [70, 71, 72, 73, 74, 75]]
    keep = [1, 4, 6]
    with CacheTransaction(batch) as txn:
        assert txn.ragged
        model(mx.array(block), cache=batch)
        buffers = [(c.keys, c.values) for c in batch]
        txn.commit(keep)
    assert txn.replayed == 0 and all(c.keys is k and c.values is v for c, (k, v) in zip(batch, buffers))
    for b, c in enumerate(alone):
        model(mx.array([block[b][: keep[b]]]), cache=c)
    assert batch[0].lengths == (13 + 4 + 3 + 1, 5 + 4 + 3 + 4, 21 + 4 + 3 + 6)
    for t in range(3):
        same_logits([[90 + t], [100 + t], [110 + t]])
    same_logits([[1, 2], [3, 4], [5, 6]])
    # Back to one row each: the row's own PaddedKVCache, holding the same positions.
    for b, c in enumerate(alone):
        mine = [layer.extract(b) for layer in batch]
        assert all(type(x) is PaddedKVCache for x in mine) and mine[0].offset == c[0].offset
        x = mx.array([[7, 8, 9]])
        assert mx.allclose(model(x, cache=mine), model(x, cache=copy_caches(c)), atol=1e-5, rtol=1e-5).item(), b
    # Row 1 leaves, a fresh row joins: the others keep their lengths and their logits.
    for c in batch:
        c.filter([0, 2])
    alone = [alone[0], alone[2]]
    newcomer = make_padded_cache(model, bucket=BUCKET)
    model(mx.array([list(range(200, 203))]), cache=newcomer)
    for c, n in zip(batch, newcomer):
        c.extend(RaggedBatchKVCache.merge([n]))
    alone.append(newcomer)
    assert batch[0].lengths == (alone[0][0].offset, alone[1][0].offset, 3)
    same_logits([[5, 6], [7, 8], [9, 10]])


def test_prewarm_covers_the_bucket_holding_the_last_key(llama_pair: Dict[str, Any]) -> None:
    model = load(str(llama_pair["target"]))[0]
    # 50 keys end in the 49..64 bucket: spans 16, 32, 48, 64 x widths 2 and 4, and 32 positions once (a batch's
    # rows x width in one projection launch) at the first span holding them
    assert cuda_backend.prewarm(model, 50, widths=[2, 4], bucket=16) == 8 + 1
    assert cuda_backend.prewarm(model, 48, widths=[2, 4], bucket=16) == 6 + 1
    assert cuda_backend.prewarm(model, 48, widths=[2, 32], bucket=16) == 3 + 2  # 32 among the widths: not again
