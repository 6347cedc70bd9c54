"""PaddedKVCache gives the same tokens as KVCache (fp32, CPU): plain decoding and the round loop."""

from __future__ import annotations

from typing import Any, Dict

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, make_prompt_cache

from conftest import PROMPTS, encode, greedy_reference, make_host, no_stop
from mlx_speculative.plugin import commit, padded_cache
from mlx_speculative.plugin.padded_cache import PaddedKVCache, make_padded_cache, verify_width

BUCKET = 16  # small, so that every request crosses several buckets


def _pad(target: Any) -> None:
    assert padded_cache.install(target, mode="on", prewarm_tokens=64, bucket=BUCKET)


@pytest.mark.parametrize("pad_steps", [False, True])
def test_logits_match_kvcache_through_chunks_and_trims(llama_pair: Dict[str, Any], pad_steps: bool) -> None:
    host = make_host(None, plugins=False)
    model = host.load(str(llama_pair["target"])).model
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
    assert verify_width(make_prompt_cache_like(c), 5) == 8 and verify_width([KVCache()], 5) == 5
    assert c.make_mask(1).shape == (1, 8)
    single = PaddedKVCache(bucket=8)  # default: one-token steps keep exact lengths, no mask
    single.update_and_fetch(k, k)
    assert single.make_mask(1) is None
    assert single.update_and_fetch(k[:, :, :1], k[:, :, :1])[0].shape == (1, 2, 6, 4)


def make_prompt_cache_like(c: Any) -> list:
    return [c]


def test_transaction_handler_registered() -> None:
    assert PaddedKVCache in commit.HANDLERS
    txn = commit.CacheTransaction([PaddedKVCache(bucket=4)]).begin()
    txn.caches[0].update_and_fetch(mx.zeros((1, 1, 6, 2)), mx.zeros((1, 1, 6, 2)))
    txn.commit(2)
    assert txn.caches[0].offset == 2


def test_backend_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(padded_cache.ENV, raising=False)
    assert padded_cache.resolve_mode("auto") is False  # CPU: off
    assert padded_cache.resolve_mode("on") is True
    monkeypatch.setenv(padded_cache.ENV, "off")
    assert padded_cache.resolve_mode() is False
    with pytest.raises(ValueError, match="allowed: auto, on, off"):
        padded_cache.resolve_mode("sometimes")


def _compare(pair: Dict[str, Any], speculative: Dict[str, Any] | None, lengths=(1, 9, 40)) -> Dict[str, int]:
    host = make_host(speculative)
    target = host.load(str(pair["target"]))
    assert "cache_factory" not in target.attachments  # auto is off on the CPU
    plain_kv = make_host(None, plugins=False)
    kv_results = {}
    for text in PROMPTS[:8]:
        prompt = encode(target, text)
        for n in lengths:
            kv_results[text, n] = host.generate(target, prompt, no_stop(n)).tokens
            assert kv_results[text, n] == greedy_reference(target.model, prompt, n)
    _pad(target)
    totals = {"zero": 0, "partial": 0, "full": 0}
    for text in PROMPTS[:8]:
        prompt = encode(target, text)
        for n in lengths:
            holder: list = []
            tokens = [e.token for e in host.stream(target, prompt, no_stop(n), state_out=holder)]
            assert tokens == kv_results[text, n], (text, n)
            assert isinstance(holder[0].cache[0], PaddedKVCache)
            assert plain_kv.generate(target, prompt, no_stop(n)).tokens == kv_results[text, n]
            stats = holder[0].report.get("speculative")
            if stats is not None:
                assert stats.fallback is None
                for key, count in stats.rounds_by_acceptance.items():
                    totals[key] += count
    return totals


def test_plain_decoding_padded_equals_kvcache(llama_pair: Dict[str, Any]) -> None:
    _compare(llama_pair, None)


@pytest.mark.parametrize("arch", ["llama_pair", "qwen3_pair"])
def test_round_loop_padded_equals_kvcache(arch: str, request: pytest.FixtureRequest) -> None:
    pair = request.getfixturevalue(arch)
    totals = _compare(pair, {"draft_model": str(pair["drafter"]), "block_size": 6})
    assert totals["zero"] > 0 and totals["partial"] > 0 and totals["full"] > 0, totals


def test_round_loop_padded_full_acceptance(llama_pair: Dict[str, Any]) -> None:
    totals = _compare(llama_pair, {"draft_model": str(llama_pair["target"]), "block_size": 5}, lengths=(23,))
    assert totals["full"] > 0 and totals["zero"] == totals["partial"] == 0, totals


def test_round_loop_padded_zero_acceptance(qwen3_pair: Dict[str, Any]) -> None:
    totals = _compare(qwen3_pair, {"draft_model": str(qwen3_pair["random_drafter"]), "block_size": 4}, lengths=(17,))
    assert totals["zero"] > 0, totals


def test_prewarm_covers_the_bucket_holding_the_last_key(llama_pair: Dict[str, Any]) -> None:
    model = make_host(None, plugins=False).load(str(llama_pair["target"])).model
    # 50 keys end in the 49..64 bucket: spans 16, 32, 48, 64 x widths 2 and 4
    assert padded_cache.prewarm(model, 50, widths=[2, 4], bucket=16) == 8
    assert padded_cache.prewarm(model, 48, widths=[2, 4], bucket=16) == 6
