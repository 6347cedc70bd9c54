"""The innovation tape (plugin/recurrent_tape.py): partial commits of recurrent caches without a replay.

For GatedDeltaNet (qwen3_5) and Mamba-2 SSM layers (falcon_h1, mamba2, nemotron_h), after a verify block of K
tokens and ``commit(n)`` for n = 1, a middle n, K-1 and K, the caches must equal feeding the same n
tokens one at a time, with no model replay. The tolerances are tight enough that a conv window off
by one position, or a recurrent state one step early or late, fails (the mutation tests check that
the comparison does catch those). Also: several forwards in one transaction (a draft model's
pattern), left-padded batches (masks, uniform acceptance), and the fallback to a model replay when
a layer's recurrence is not one of the wrapped primitives.
"""

from __future__ import annotations

from typing import Any, Callable, List

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, BatchKVCache, CacheList

from mlx_speculative.hooks import tiny_models as tm
from mlx_speculative.plugin import recurrent_tape
from mlx_speculative.plugin.commit import CacheTransaction, UnsupportedCache
from test_commit_contract import K, exact_state, model_for, prefilled, replay_for, same, tokens, view

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


def model_of(arch: str) -> Any:
    if arch != "nemotron_h":
        return model_for(arch)
    if not _nemotron:
        mx.random.seed(3)
        _nemotron.append(tm.build_model(NEMOTRON_H))
        mx.eval(_nemotron[0].parameters())
    return _nemotron[0]
# qwen3_5: the gated-delta recurrence steps position by position, so the tape's state is the one
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


def taped(model: Any, prompt: List[int], block: List[int], n: int) -> CacheTransaction:
    spec = prefilled(model, prompt)
    with CacheTransaction(spec, replay=replay_for(model, spec, block)) as txn:
        model(mx.array([block]), cache=spec)
        txn.commit(n)
    txn.cache_after = spec  # type: ignore[attr-defined]
    return txn


@pytest.mark.parametrize("arch", RECURRENT)
def test_tape_commit_equals_one_token_feeding(arch: str) -> None:
    model = model_of(arch)
    prompt, block = tokens(21, 31), tokens(K + 1, 32)
    for n in (1, 3, K - 1, K):
        txn = taped(model, prompt, block[:K], n)
        spec = txn.cache_after
        assert txn.replayed == 0
        assert txn.taped == (recurrent_caches(spec) if n < K else 0)
        assert recurrent_tape._KEYS == {}  # nothing stays registered after the transaction
        ref = one_token(model, prompt, block[:n])
        assert max_diff(spec, ref) <= ATOL[arch], (n, max_diff(spec, ref))
        got, want = model(mx.array([[block[K]]]), cache=spec), model(mx.array([[block[K]]]), cache=ref)
        assert mx.allclose(got, want, atol=1e-5, rtol=1e-5).item()
        assert max_diff(spec, ref) <= ATOL[arch]


@pytest.mark.parametrize("arch", RECURRENT)
def test_tape_equals_model_replay(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tape and the fallback (restore + replay of the kept tokens) reach the same state."""
    model = model_of(arch)
    prompt, block = tokens(13, 33), tokens(K, 34)
    tape = taped(model, prompt, block, 3).cache_after
    monkeypatch.setattr(recurrent_tape.Tape, "usable", lambda self, n, fed: "disabled by the test")
    txn = taped(model, prompt, block, 3)
    assert txn.replayed == 3 and txn.taped == 0
    assert max_diff(tape, txn.cache_after) <= 2e-6


def _mutant(shift_conv: bool) -> Callable[[Any, int], None]:
    apply = recurrent_tape.Tape.apply

    def wrong(self: Any, n: int, partial: Any = None) -> None:  # one part right, the other one position late
        calls, convs = self.calls, self.convs
        apply(self, n, partial)
        self.calls, self.convs = ({}, convs) if shift_conv else (calls, {})
        apply(self, n + 1)
        self.calls, self.convs = calls, convs

    return wrong


@pytest.mark.parametrize("shift_conv", [True, False], ids=["conv-window", "recurrent-state"])
@pytest.mark.parametrize("arch", RECURRENT)
def test_comparison_catches_an_off_by_one_tape(arch: str, shift_conv: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    model = model_of(arch)
    prompt, block = tokens(21, 31), tokens(K, 32)
    monkeypatch.setattr(recurrent_tape.Tape, "apply", _mutant(shift_conv))
    for n in (1, 3, K - 1):
        spec = taped(model, prompt, block, n).cache_after
        assert max_diff(spec, one_token(model, prompt, block[:n])) > 1e-3


@pytest.mark.parametrize("arch", RECURRENT)
def test_several_forwards_in_one_transaction(arch: str) -> None:
    """A draft model's pattern: a catch-up chunk, then one-token steps; keep a prefix of them.
    Whole forwards keep their own output state, so one-token steps are kept bit for bit."""
    model = model_of(arch)
    prompt, fed = tokens(17, 35), tokens(6, 36)
    for keep in (1, 2, 3, 4, 6):
        spec = prefilled(model, prompt)
        txn = CacheTransaction(spec).begin()  # no replay callback: the tape must do every commit
        model(mx.array([fed[:3]]), cache=spec)
        for t in fed[3:]:
            model(mx.array([[t]]), cache=spec)
        txn.commit(keep)
        assert txn.taped == (recurrent_caches(spec) if keep < 6 else 0)
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
def test_left_padded_batch_uniform_commits(arch: str) -> None:
    """Batched rows with left padding: the layers pass a mask to the primitives and ``advance`` moves
    ``left_padding``; a uniform commit through the tape equals one-token feeding of the same batch."""
    model = model_of(arch)
    prompts = [tokens(9, 37), tokens(5, 38), tokens(7, 39)]
    block = mx.array([tokens(K, 40 + i) for i in range(3)])  # [3, K]
    for n in (1, 3, K):
        spec = _left_padded(model, prompts)
        with CacheTransaction(spec) as txn:
            model(block, cache=spec)
            txn.commit([n, n, n])
        assert txn.taped == (recurrent_caches(spec) if n < K else 0)
        ref = _left_padded(model, prompts)
        for i in range(n):
            model(block[:, i : i + 1], cache=ref)
        recurrent = [(a, b) for a, b in zip(spec, ref) if isinstance(a, ArraysCache)]
        for a, b in recurrent:
            assert mx.array_equal(a.left_padding, b.left_padding).item()
        assert max_diff([a for a, _ in recurrent], [b for _, b in recurrent]) <= max(ATOL[arch], 1e-6), n
        nxt = mx.array([[5], [6], [7]])
        assert mx.allclose(model(nxt, cache=spec), model(nxt, cache=ref), atol=1e-5, rtol=1e-5).item()


def _unwrapped(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the model's module call the primitive unwrapped: a layer the tape does not know."""
    import importlib

    module = importlib.import_module(f"mlx_lm.models.{arch}")
    for (_, name), fn in recurrent_tape._originals.items():
        if name in vars(module):
            monkeypatch.setattr(module, name, fn)
    monkeypatch.setattr(recurrent_tape, "install", lambda: None)  # no rewrapping at the next begin


@pytest.mark.parametrize("arch", ["qwen3_5", "mamba2"])
def test_unrecorded_recurrence_falls_back_to_replay(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = model_of(arch)
    prompt, block = tokens(13, 41), tokens(K, 42)
    recurrent_tape.install()
    _unwrapped(arch, monkeypatch)
    txn = taped(model, prompt, block, 2)
    assert txn.replayed == 2 and txn.taped == 0
    assert max_diff(txn.cache_after, one_token(model, prompt, block[:2])) <= 1e-5
    # Without a replay callback a partial commit is refused and the start state restored.
    cache = prefilled(model, prompt)
    start = exact_state(cache)
    txn = CacheTransaction(cache).begin()
    model(mx.array([block]), cache=cache)
    with pytest.raises(UnsupportedCache, match="ArraysCache.*replay"):
        txn.commit(2)
    same(exact_state(cache), start)


def test_wrappers_are_installed_where_models_bind_the_primitives() -> None:
    import mlx_lm.models.gated_delta as gated_delta
    import mlx_lm.models.mamba2 as mamba2
    import mlx_lm.models.qwen3_5 as qwen3_5
    import mlx_lm.models.ssm as ssm

    model_for("qwen3_5")
    recurrent_tape.install()
    recurrent_tape.install()  # idempotent
    for module, name in ((qwen3_5, "gated_delta_update"), (gated_delta, "gated_delta_update"),
                         (mamba2, "ssm_update"), (ssm, "ssm_update")):
        fn = getattr(module, name)
        assert fn._spec_tape_original is recurrent_tape._originals[(fn._spec_tape_original.__module__, name)]
    assert mx.concatenate is recurrent_tape._recording_concatenate
    # Outside a transaction nothing is recorded.
    assert recurrent_tape._KEYS == {}
    mx.eval(mx.concatenate([mx.zeros((1, 2)), mx.ones((1, 2))], axis=0))


@pytest.mark.parametrize("arch", ["falcon_h1", "mamba2", "nemotron_h"])
def test_ssm_layers_recompute_as_one_call_bit_for_bit(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The SSM layers' partial recurrences run as one ssm_update call (heads side by side): the
    same states as running each layer's call alone."""
    from mlx_speculative.plugin.commit import _arrays_items

    model = model_of(arch)
    cache = prefilled(model, tokens(13, 43))
    txn = CacheTransaction(cache).begin()
    model(mx.array([tokens(K, 44)]), cache=cache)
    tapes = [t.tape for _, _, t in _arrays_items(txn._handlers, txn.caches, txn._starts)]
    sizes: List[int] = []
    run = recurrent_tape._compiled_run
    monkeypatch.setattr(recurrent_tape, "_compiled_run", lambda *a: sizes.append(a[-1]) or run(*a))
    for n in (1, 3, K - 1):
        calls = [(call, m) for tape in tapes for _, call, m in tape.plan(n)]
        assert len(calls) == len(tapes) == 2
        together = recurrent_tape._states_after(calls)
        alone = [recurrent_tape._states_after([c])[0] for c in calls]
        assert all(mx.array_equal(a, b).item() for a, b in zip(together, alone))
    assert sizes == [2, 1, 1] * 3
    txn.abort()
