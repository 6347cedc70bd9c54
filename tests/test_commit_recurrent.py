"""Recurrent caches keep part of a forward from its recording (hooks/recurrent.py), with no model replay.

For GatedDeltaNet (qwen3_5) and Mamba-2 SSM layers (falcon_h1, mamba2, nemotron_h) of a model given
its scoped layers (``scope_model``, as the host does at load), after a verify block of K tokens and
``commit(n)`` for n = 1, a middle n, K-1 and K, the caches must equal feeding the same n tokens one
at a time. The tolerances are tight enough that a conv window off by one position, or a recurrent
state one step early or late, fails (the mutation tests check that the comparison does catch
those). Also: several forwards in one transaction (a draft model's pattern), left-padded batches
with equal and ragged per-row lengths, and the fallback to a model replay for a model whose layers
were not scoped.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, BatchKVCache, CacheList

from mlx_speculative.hooks import recurrent, recurrent_state
from mlx_speculative.testing import tiny_models as tm
from mlx_speculative.hooks.transaction import CacheTransaction, UnsupportedCache, leaves
from test_commit_contract import ARCHS, K, exact_state, model_for, prefilled, replay_for, same, tokens, view

pytestmark = pytest.mark.unit

RECURRENT = ["qwen3_5", "falcon_h1", "mamba2", "nemotron_h"]
# Nemotron-H (Mamba-2, attention and MLP blocks): only here, a test-local tiny config.
NEMOTRON_H = {
    "model_type": "nemotron_h", "vocab_size": 384, "hidden_size": 64, "intermediate_size": 128,
    "max_position_embeddings": 4096, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "attention_bias": False, "mamba_num_heads": 8, "mamba_head_dim": 16, "mamba_proj_bias": False,
    "ssm_state_size": 16, "conv_kernel": 4, "n_groups": 1, "mlp_bias": False, "layer_norm_epsilon": 1e-5,
    "use_bias": False, "use_conv_bias": True, "hybrid_override_pattern": ["M", "*", "M", "-"],
    "time_step_limit": [0.0, 1e4], "tie_word_embeddings": False,
}
_nemotron: List[Any] = []
_unscoped: Dict[str, Any] = {}


def model_of(arch: str) -> Any:
    if arch != "nemotron_h":
        return model_for(arch)
    if not _nemotron:
        mx.random.seed(3)
        _nemotron.append(tm.build_model(NEMOTRON_H))
        mx.eval(_nemotron[0].parameters())
        recurrent.scope_model(_nemotron[0])
    return _nemotron[0]


def unscoped_model(arch: str) -> Any:
    """The same architecture built without ``scope_model``: mlx-lm's layer classes, nothing recorded."""
    if arch not in _unscoped:
        mx.random.seed(3)
        _unscoped[arch] = tm.build_model(ARCHS[arch]())
        mx.eval(_unscoped[arch].parameters())
    return _unscoped[arch]


# qwen3_5: the gated-delta recurrence steps position by position, so the recorded state is the one
# one-token feeding reaches, bit for bit. The SSD form of Mamba-2 (ssm_attn) sums a block at once:
# its states differ from one-token feeding by rounding (observed <= 3.6e-7, the same for a full
# commit, which keeps the verify forward's own state). A window or state one position off differs
# by > 1e-2 (see the mutation tests).
ATOL = {"qwen3_5": 0.0, "falcon_h1": 2e-6, "mamba2": 2e-6, "nemotron_h": 2e-6}


def recurrent_caches(cache: List[Any]) -> int:
    return sum(recurrent_caches(list(c.caches)) if isinstance(c, CacheList) else isinstance(c, ArraysCache)
               for c in cache)


def max_diff(a: List[Any], b: List[Any]) -> float:
    va = [x for c in a for x in view(c)]
    vb = [x for c in b for x in view(c)]
    assert len(va) == len(vb) and all(x.shape == y.shape for x, y in zip(va, vb))
    return max(float(mx.abs(x - y).max()) for x, y in zip(va, vb))


def one_token(model: Any, prompt: List[int], fed: List[int]) -> List[Any]:
    ref = prefilled(model, prompt)
    for t in fed:
        model(mx.array([[t]]), cache=ref)
    return ref


def recorded(model: Any, prompt: List[int], block: List[int], n: int) -> CacheTransaction:
    spec = prefilled(model, prompt)
    with CacheTransaction(spec, replay=replay_for(model, spec, block)) as txn:
        model(mx.array([block]), cache=spec)
        txn.commit(n)
    txn.cache_after = spec  # type: ignore[attr-defined]
    return txn


@pytest.mark.parametrize("arch", RECURRENT)
def test_recorded_commit_equals_one_token_feeding(arch: str) -> None:
    model = model_of(arch)
    prompt, block = tokens(21, 31), tokens(K + 1, 32)
    for n in (1, 3, K - 1, K):
        txn = recorded(model, prompt, block[:K], n)
        spec = txn.cache_after
        assert txn.replayed == 0
        assert txn.taped == (recurrent_caches(spec) if n < K else 0)
        assert recurrent._open == {}  # no recording stays open after the transaction
        ref = one_token(model, prompt, block[:n])
        assert max_diff(spec, ref) <= ATOL[arch], (n, max_diff(spec, ref))
        got, want = model(mx.array([[block[K]]]), cache=spec), model(mx.array([[block[K]]]), cache=ref)
        assert mx.allclose(got, want, atol=1e-5, rtol=1e-5).item()
        assert max_diff(spec, ref) <= ATOL[arch]


@pytest.mark.parametrize("arch", RECURRENT)
def test_recording_equals_model_replay(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The recording and the fallback (restore + replay of the kept tokens) reach the same state."""
    model = model_of(arch)
    prompt, block = tokens(13, 33), tokens(K, 34)
    kept = recorded(model, prompt, block, 3).cache_after
    monkeypatch.setattr(recurrent.Recording, "usable", lambda self, n: "disabled by the test")
    txn = recorded(model, prompt, block, 3)
    assert txn.replayed == 3 and txn.taped == 0
    assert max_diff(kept, txn.cache_after) <= 2e-6


def _mutant(shift_conv: bool) -> Callable[[Any], None]:
    apply = recurrent.apply_all

    def wrong(items: Any) -> None:  # one part right, the other one position late
        apply(items)
        for rec, n in items:
            calls, convs = rec.calls, rec.convs
            rec.calls, rec.convs = ({}, convs) if shift_conv else (calls, {})
            apply([(rec, n + 1)])
            rec.calls, rec.convs = calls, convs

    return wrong


@pytest.mark.parametrize("shift_conv", [True, False], ids=["conv-window", "recurrent-state"])
@pytest.mark.parametrize("arch", RECURRENT)
def test_comparison_catches_an_off_by_one_recording(arch: str, shift_conv: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    model = model_of(arch)
    prompt, block = tokens(21, 31), tokens(K, 32)
    monkeypatch.setattr(recurrent, "apply_all", _mutant(shift_conv))
    for n in (1, 3, K - 1):
        txn = recorded(model, prompt, block, n)
        assert txn.taped == recurrent_caches(txn.cache_after)  # the mutant did run
        assert max_diff(txn.cache_after, one_token(model, prompt, block[:n])) > 1e-3


@pytest.mark.parametrize("arch", RECURRENT)
def test_several_forwards_in_one_transaction(arch: str) -> None:
    """A draft model's pattern: a catch-up chunk, then one-token steps; keep a prefix of them.
    Whole forwards keep their own output state, so one-token steps are kept bit for bit."""
    model = model_of(arch)
    prompt, fed = tokens(17, 35), tokens(6, 36)
    for keep in (1, 2, 3, 4, 6):
        spec = prefilled(model, prompt)
        txn = CacheTransaction(spec).begin()  # no replay callback: the recording must do every commit
        model(mx.array([fed[:3]]), cache=spec)
        for t in fed[3:]:
            model(mx.array([[t]]), cache=spec)
        txn.commit(keep)
        assert txn.taped == (recurrent_caches(spec) if keep < 6 else 0) and txn.replayed == 0
        ref = prefilled(model, prompt)
        if keep >= 3:
            model(mx.array([fed[:3]]), cache=ref)
            for t in fed[3:keep]:
                model(mx.array([[t]]), cache=ref)
            assert max_diff(spec, ref) == 0.0, keep
        else:
            for t in fed[:keep]:
                model(mx.array([[t]]), cache=ref)
            assert max_diff(spec, ref) <= ATOL[arch], keep


def _left_padded(model: Any, prompts: List[List[int]]) -> List[Any]:
    width = max(len(p) for p in prompts)
    pad = [width - len(p) for p in prompts]
    cache = [ArraysCache(2, left_padding=pad) if type(c) is ArraysCache else BatchKVCache(left_padding=pad)
             for c in model.make_cache()]
    model(mx.array([[0] * (width - len(p)) + p for p in prompts]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


@pytest.mark.parametrize("arch", ["qwen3_5", "mamba2"])
def test_left_padded_batch_commits(arch: str) -> None:
    """Batched rows with left padding: the layers pass a mask to the primitives and ``advance`` moves
    ``left_padding``. Equal lengths: the batch equals one-token feeding of the same batch (states and
    next logits). Ragged lengths (rows grouped by length, 0 included): row b's states and left
    padding equal that batch's after n_b one-token steps."""
    model = model_of(arch)
    prompts = [tokens(9, 37), tokens(5, 38), tokens(7, 39)]
    block = mx.array([tokens(K, 40 + i) for i in range(3)])  # [3, K]
    ref = _left_padded(model, prompts)
    after: List[List[tuple]] = []  # after[i]: (states, left padding) of each recurrent cache after i steps
    for i in range(K + 1):
        # Copies: ``advance`` moves left_padding in place (``-=``).
        after.append([([x + 0 for x in c.cache], c.left_padding + 0) for c in ref if isinstance(c, ArraysCache)])
        if i < K:
            model(block[:, i : i + 1], cache=ref)
    for rows in ([1, 1, 1], [3, 3, 3], [K, K, K], [1, 3, K], [K, 0, 2], [2, 2, 4]):
        spec = _left_padded(model, prompts)
        with CacheTransaction(spec) as txn:
            assert txn.ragged
            model(block, cache=spec)
            txn.commit(rows)
        assert txn.replayed == 0
        assert txn.taped == (recurrent_caches(spec) if min(rows) < K else 0), rows
        mine = [c for c in spec if isinstance(c, ArraysCache)]
        for b, n in enumerate(rows):
            for c, (states, pad) in zip(mine, after[n]):
                assert c.left_padding[b].item() == pad[b].item(), (rows, b)
                for x, y in zip(c.cache, states):
                    assert float(mx.abs(x[b] - y[b]).max()) <= max(ATOL[arch], 1e-6), (rows, b)
        if len(set(rows)) == 1:
            n = rows[0]
            same_batch = _left_padded(model, prompts)
            for i in range(n):
                model(block[:, i : i + 1], cache=same_batch)
            nxt = mx.array([[5], [6], [7]])
            assert mx.allclose(model(nxt, cache=spec), model(nxt, cache=same_batch), atol=1e-5, rtol=1e-5).item()


@pytest.mark.parametrize("arch", ["qwen3_5", "falcon_h1", "mamba2"])
def test_unscoped_model_falls_back_to_replay(arch: str) -> None:
    """A model whose layers were not scoped records nothing: a partial commit replays the kept
    tokens (exact), and without a replay callback it is refused by name, the start state restored."""
    model = unscoped_model(arch)
    assert not any(getattr(type(m), "_spec_recurrent", False) for m in model.modules())
    prompt, block = tokens(13, 41), tokens(K, 42)
    txn = recorded(model, prompt, block, 2)
    assert txn.replayed == 2 and txn.taped == 0
    assert max_diff(txn.cache_after, one_token(model, prompt, block[:2])) <= 1e-5
    cache = prefilled(model, prompt)
    start = exact_state(cache)
    txn = CacheTransaction(cache).begin()
    model(mx.array([block]), cache=cache)
    with pytest.raises(UnsupportedCache, match="ArraysCache.*replay"):
        txn.commit(2)
    same(exact_state(cache), start)
    assert recurrent._open == {}


def test_scoping_is_per_instance_and_idempotent() -> None:
    """``scope_model`` changes the class of the recurrent layer instances of one model (a subclass of
    mlx-lm's class), nothing else; a second call changes nothing."""
    import mlx_lm.models.gated_delta as gated_delta
    import mlx_lm.models.qwen3_5 as qwen3_5

    model = model_for("qwen3_5")
    scoped = [m for m in model.modules() if getattr(type(m), "_spec_recurrent", False)]
    assert len(scoped) == 2 and all(type(m).__mro__[1] is qwen3_5.GatedDeltaNet for m in scoped)
    classes = [type(m) for m in model.modules()]
    assert recurrent.scope_model(model) == 2
    assert [type(m) for m in model.modules()] == classes
    other = unscoped_model("qwen3_5")
    assert all(type(m) is qwen3_5.GatedDeltaNet for m in other.modules() if isinstance(m, qwen3_5.GatedDeltaNet))
    assert qwen3_5.gated_delta_update is gated_delta.gated_delta_update
    assert not hasattr(gated_delta.gated_delta_update, "__wrapped__")
    # Outside a transaction nothing is recorded.
    model(mx.array([tokens(5, 50)]), cache=model.make_cache())
    assert recurrent._open == {}


@pytest.mark.parametrize("arch", ["falcon_h1", "mamba2", "nemotron_h"])
def test_ssm_layers_recompute_as_one_call_bit_for_bit(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The SSM layers' partial recurrences run as one ssm_update call (heads side by side): the
    same states as running each layer's call alone."""
    model = model_of(arch)
    cache = prefilled(model, tokens(13, 43))
    txn = CacheTransaction(cache).begin()
    model(mx.array([tokens(K, 44)]), cache=cache)
    recordings = [t.recording for _, c, t in leaves(txn._items(txn._starts)) if isinstance(c, ArraysCache)]
    sizes: List[int] = []
    run = recurrent_state._compiled_run
    monkeypatch.setattr(recurrent_state, "_compiled_run", lambda *a: sizes.append(a[-1]) or run(*a))
    for n in (1, 3, K - 1):
        requests = []
        for rec in recordings:
            for calls in rec.calls.values():
                call, left, _ = recurrent_state._locate(calls, n)
                assert call is not None and left == n
                requests.append((call, left, None))
        assert len(requests) == len(recordings) == 2
        together = recurrent_state._states_after(requests)
        alone = [recurrent_state._states_after([r])[0] for r in requests]
        assert all(mx.array_equal(a, b).item() for a, b in zip(together, alone))
    assert sizes == [2, 1, 1] * 3
    txn.abort()
