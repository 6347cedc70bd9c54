"""Batched caches: rows with different accepted lengths in one verify forward.

Each row then goes on (more one-token steps, another ragged round) and must equal its own
unbatched greedy decoding token for token. Every batched cache commits ragged rows: BatchKVCache
and BatchRotatingKVCache through mlx-lm's right-padding path, ArraysCache (qwen3_5's GatedDeltaNet,
falcon_h1's and mamba2's Mamba-2 layers, models scoped as the host scopes them) from the recorded
forward, rows grouped by length, with no model replay.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Tuple

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.models.cache import ArraysCache, BatchKVCache, BatchRotatingKVCache, CacheList, make_prompt_cache

from mlx_speculative.hooks import recurrent
from mlx_speculative.testing import tiny_models as tm
from mlx_speculative.hooks.transaction import CacheTransaction

pytestmark = pytest.mark.unit

K = 5  # draft tokens per round
CONFIGS = {"llama": tm.llama_config(), "gemma3_text": tm.gemma3_text_config(), "qwen3_5": tm.qwen3_5_config(),
           "falcon_h1": tm.falcon_h1_config(), "mamba2": tm.mamba2_config()}
STEPS = 20  # one-token steps between and after the rounds (gemma3_text's window is 8)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Dict[str, Any]:
    out = {}
    for i, (arch, config) in enumerate(CONFIGS.items()):
        path = tm.make_checkpoint(tmp_path_factory.mktemp(arch) / "m", config, seed=20 + i,
                                  tokenizer_dir=tokenizer_dir, logit_scale=3.0)
        model = load(str(path))[0]
        recurrent.scope_model(model)  # as the host does at load
        out[arch] = model
    return out


def recurrent_caches(cache: List[Any]) -> int:
    return sum(recurrent_caches(list(c.caches)) if isinstance(c, CacheList) else isinstance(c, ArraysCache)
               for c in cache)


def argmax(logits: mx.array) -> List[int]:
    return mx.argmax(logits[:, -1, :], axis=-1).tolist()  # [B]


def unbatched(model: Any, prompt: List[int], n: int) -> List[int]:
    """Greedy one-token decoding of one row: the first n generated tokens."""
    cache = make_prompt_cache(model)
    out = [argmax(model(mx.array([prompt]), cache=cache))[0]]
    while len(out) < n:
        out.append(argmax(model(mx.array([[out[-1]]]), cache=cache))[0])
    return out


def batched_prefill(model: Any, prompts: List[List[int]]) -> Tuple[List[Any], List[int]]:
    """Per-row prefill, merged into batched caches (left padding), and each row's first token."""
    rows, firsts = [], []
    for p in prompts:
        cache = make_prompt_cache(model)
        firsts.append(argmax(model(mx.array([p]), cache=cache))[0])
        rows.append(cache)
    merged = [type(rows[0][layer]).merge([r[layer] for r in rows]) for layer in range(len(rows[0]))]
    return merged, firsts


def step(model: Any, cache: List[Any], pending: List[int]) -> List[int]:
    return argmax(model(mx.array([[t] for t in pending]), cache=cache))


def ragged_round(model: Any, cache: List[Any], pending: List[int],
                 drafts: List[List[int]]) -> Tuple[List[List[int]], List[int]]:
    """One batched round: verify [pending, drafts] for every row, accept greedily, commit per row."""
    block = mx.array([[p, *d] for p, d in zip(pending, drafts)])  # [B, K+1]
    fed = block.tolist()
    with CacheTransaction(cache, replay=lambda n: model(block[:, :n], cache=cache)) as txn:
        assert txn.ragged
        target = mx.argmax(model(block, cache=cache), axis=-1).tolist()  # [B, K+1]
        accepted = []
        for d, t in zip(drafts, target):
            a = 0
            while a < len(d) and d[a] == t[a]:
                a += 1
            accepted.append(a)
        keep = [a + 1 for a in accepted]
        txn.commit(keep)
    # Recurrent caches keep each row's part from the recorded forward: no model replay.
    assert txn.replayed == 0
    assert txn.taped == (recurrent_caches(cache) if min(keep) < K + 1 else 0)
    emitted = [fed[i][1 : keep[i]] + [target[i][keep[i] - 1]] for i in range(len(keep))]
    return emitted, accepted


def run(model: Any, prompts: List[List[int]], wrong_at: List[List[int]]) -> None:
    total = (len(wrong_at) + 1) * STEPS + len(wrong_at) * (K + 1) + 1
    refs = [unbatched(model, p, total) for p in prompts]
    cache, pending = batched_prefill(model, prompts)
    got = [[p] for p in pending]
    for wrong in wrong_at:
        for _ in range(STEPS):
            pending = step(model, cache, pending)
            for g, t in zip(got, pending):
                g.append(t)
        # Drafts: each row's true continuation with a wrong token at its own position.
        drafts = []
        for i, (g, w) in enumerate(zip(got, wrong)):
            d = refs[i][len(g) : len(g) + K]
            if w < K:
                d[w] = (d[w] + 1) % 384
            drafts.append(d)
        emitted, accepted = ragged_round(model, cache, [g[-1] for g in got], drafts)
        assert accepted == [min(w, K) for w in wrong]
        for g, e in zip(got, emitted):
            g.extend(e)
        pending = [g[-1] for g in got]
    for _ in range(STEPS):
        pending = step(model, cache, pending)
        for g, t in zip(got, pending):
            g.append(t)
    for g, ref in zip(got, refs):
        assert g == ref[: len(g)]


# Rows accept 0, 2 and all 5 drafts in the first round (keep 1, 3 and 6 positions), then 4, 0 and 1.
WRONG = [[0, 2, K], [4, 0, 1]]
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41]]
BATCHED = {  # the cache types the merged rows hold
    "llama": {BatchKVCache}, "gemma3_text": {BatchRotatingKVCache, BatchKVCache},
    "qwen3_5": {ArraysCache, BatchKVCache}, "falcon_h1": {CacheList}, "mamba2": {ArraysCache},
}


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_ragged_rounds_equal_each_row_alone(arch: str, models: Dict[str, Any]) -> None:
    model = models[arch]
    cache = batched_prefill(model, PROMPTS)[0]
    assert {type(c) for c in cache} == BATCHED[arch]
    if arch == "falcon_h1":
        assert all({type(x) for x in c.caches} == {ArraysCache, BatchKVCache} for c in cache)
    run(model, PROMPTS, WRONG)
