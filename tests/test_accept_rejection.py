"""Rejection sampling (plugin/accept.py) on hand-made p and q, batched over many independent rounds.

p rows are the target's distributions at the k+1 verified positions, q rows the drafter's at
the k draft positions (notation of Leviathan et al. 2023). Each test runs tens of thousands of
rounds in one vectorised call of ``rejection_accept``.
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import numpy as np
import pytest

from mlx_speculative.plugin import accept
from test_sampling_stats import CAUGHT_P, PASS_P, chisquare, tv

pytestmark = pytest.mark.statistical

N = 40_000


def _log(p: np.ndarray) -> mx.array:
    with np.errstate(divide="ignore"):
        return mx.array(np.log(np.asarray(p, dtype=np.float32)))


def _batch(rows: np.ndarray, n: int = N) -> mx.array:
    """log of rows [..., V], repeated over a batch of n rounds: [n, ..., V]."""
    lp = _log(rows)
    return mx.broadcast_to(lp[None], (n, *lp.shape))


def _draws(q_rows: np.ndarray, key: int, n: int = N) -> mx.array:
    """x_i ~ q_i independently for each round: [n, k]."""
    return mx.random.categorical(_batch(q_rows, n), key=mx.random.key(key)).astype(mx.uint32)


def _counts(tokens: mx.array, V: int) -> np.ndarray:
    return np.bincount(np.array(tokens).reshape(-1), minlength=V)


P = np.array([0.5, 0.3, 0.2, 0.0])
Q = np.array([0.2, 0.5, 0.1, 0.2])
RESIDUAL = np.array([0.75, 0.0, 0.25, 0.0])  # norm(max(0, p - q)) = norm([0.3, 0, 0.1, 0]), by hand


def test_residual_is_exactly_normalised_positive_part() -> None:
    r = accept.residual(mx.array(P, dtype=mx.float32), mx.array(Q, dtype=mx.float32))
    np.testing.assert_allclose(np.array(r), RESIDUAL, rtol=0, atol=1e-7)
    # p <= q everywhere (p = q): no residual mass, p itself is returned.
    same = mx.array(P, dtype=mx.float32)
    np.testing.assert_allclose(np.array(accept.residual(same, same)), P, atol=0)


def test_q_equal_p_accepts_every_draft() -> None:
    rng = np.random.default_rng(1)
    k, V = 5, 7
    p = rng.dirichlet(np.ones(V) * 0.5, size=k + 1)
    p[:, 3] = 0.0  # a filtered token (top-p) on both sides
    p /= p.sum(-1, keepdims=True)
    drafts = _draws(p[:k], key=1)
    a, bonus = accept.rejection_accept(drafts, _batch(p[:k]), _batch(p), key=mx.random.key(2))
    assert np.all(np.array(a) == k)
    # After a fully accepted block the bonus is drawn from p_{k+1}.
    assert chisquare(_counts(bonus, V), p[k])[2] > PASS_P


def test_p_zero_rejects_with_certainty() -> None:
    k = 3
    p = np.tile(P, (k + 1, 1))
    q = np.tile(Q, (k, 1))
    drafts = mx.full((N, k), 3, dtype=mx.uint32)  # p(3) = 0, q(3) = 0.2
    a, bonus = accept.rejection_accept(drafts, _batch(q), _batch(p), key=mx.random.key(3))
    assert np.all(np.array(a) == 0)
    counts = _counts(bonus, 4)
    assert counts[3] == 0 and counts[1] == 0  # residual mass is 0 where p <= q
    assert chisquare(counts, RESIDUAL)[2] > PASS_P


def test_bonus_after_rejection_follows_residual() -> None:
    # One draft x ~ q. Acceptance probability is sum_x min(p, q) = 0.6; after a rejection the
    # bonus follows norm(max(0, p - q)); the emitted token overall follows p.
    p = np.stack([P, np.full(4, 0.25)])
    drafts = _draws(Q[None], key=4)
    a, bonus = accept.rejection_accept(drafts, _batch(Q[None]), _batch(p), key=mx.random.key(5))
    a, bonus, x = np.array(a), np.array(bonus), np.array(drafts)[:, 0]
    rate = a.mean()
    assert abs(rate - 0.6) < 5 * np.sqrt(0.24 / N), rate
    rejected = bonus[a == 0]
    assert chisquare(np.bincount(rejected, minlength=4), RESIDUAL)[2] > PASS_P
    first = np.where(a == 1, x, bonus)
    assert chisquare(np.bincount(first, minlength=4), P)[2] > PASS_P


def test_one_hot_q_accepts_with_probability_p() -> None:
    # A drafter without a distribution (ngram): q is one-hot at x, so x is kept with probability
    # p(x) and after a rejection the bonus is p with x removed, renormalised.
    p = np.stack([P, np.full(4, 0.25)])
    drafts = mx.zeros((N, 1), dtype=mx.uint32)  # always proposes token 0, p(0) = 0.5
    a, bonus = accept.rejection_accept(drafts, None, _batch(p), key=mx.random.key(6))
    a, bonus = np.array(a), np.array(bonus)
    assert abs(a.mean() - 0.5) < 5 * np.sqrt(0.25 / N)
    without_x = np.array([0.0, 0.6, 0.4, 0.0])
    assert chisquare(np.bincount(bonus[a == 0], minlength=4), without_x)[2] > PASS_P
    assert chisquare(np.bincount(bonus[a == 1], minlength=4), p[1])[2] > PASS_P


def test_batch_shapes_and_rows_are_independent() -> None:
    k, V = 3, 4
    p = np.tile(P, (k + 1, 1))
    rows_p = _log(np.stack([p, p]))[None].astype(mx.float32)  # [1, 2, k+1, V]
    rows_p = mx.broadcast_to(rows_p, (5, 2, k + 1, V))
    rows_q = mx.broadcast_to(_log(np.stack([p[:k], np.tile(Q, (k, 1))]))[None], (5, 2, k, V))
    drafts = mx.array(np.stack([np.tile([0, 1, 2], (5, 1)), np.tile([3, 0, 0], (5, 1))], axis=1), dtype=mx.uint32)
    a, bonus = accept.rejection_accept(drafts, rows_q, rows_p, key=mx.random.key(7))
    assert a.shape == (5, 2) and bonus.shape == (5, 2)
    assert np.all(np.array(a)[:, 0] == k)  # q = p: everything kept
    assert np.all(np.array(a)[:, 1] == 0)  # p(3) = 0: rejected at once


def test_same_key_same_outcome_and_global_state_untouched() -> None:
    p = np.stack([P, P, P])
    q = np.stack([Q, Q])
    drafts = _draws(q, key=8, n=1000)
    before = np.array(mx.random.state[0])
    one = accept.rejection_accept(drafts, _batch(q, 1000), _batch(p, 1000), key=mx.random.key(9))
    two = accept.rejection_accept(drafts, _batch(q, 1000), _batch(p, 1000), key=mx.random.key(9))
    mx.eval(one, two)
    np.testing.assert_array_equal(np.array(mx.random.state[0]), before)
    for x, y in zip(one, two):
        np.testing.assert_array_equal(np.array(x), np.array(y))
    other = accept.rejection_accept(drafts, _batch(q, 1000), _batch(p, 1000), key=mx.random.key(10))
    assert not np.array_equal(np.array(one[1]), np.array(other[1]))


def test_no_drafts_samples_bonus_from_p() -> None:
    drafts = mx.zeros((N, 0), dtype=mx.uint32)
    a, bonus = accept.rejection_accept(drafts, _batch(np.zeros((0, 4))), _batch(P[None]), key=mx.random.key(11))
    assert np.all(np.array(a) == 0)
    assert chisquare(_counts(bonus, 4), P)[2] > PASS_P


def test_mismatched_shapes_are_refused() -> None:
    drafts = mx.zeros((2,), dtype=mx.uint32)
    with pytest.raises(ValueError, match=r"expected log p \[\.\.\., 3, V\] and log q \[\.\.\., 2, V\]"):
        accept.rejection_accept(drafts, _log(np.tile(Q, (2, 1))), _log(np.tile(P, (2, 1))))
    with pytest.raises(ValueError, match="got log p"):
        accept.rejection_accept(drafts, _log(np.tile(Q[:3] / Q[:3].sum(), (2, 1))), _log(np.tile(P, (3, 1))))


# The output distribution over whole sequences, with a control -----------------------------------

V, K = 5, 2


def _tree(seed: int, concentration: float) -> dict:
    """A random conditional distribution for every prefix of length <= K: prefix -> [V] probabilities."""
    rng = np.random.default_rng(seed)
    table = {(): rng.dirichlet(np.ones(V) * concentration)}
    for x in range(V):
        table[(x,)] = rng.dirichlet(np.ones(V) * concentration)
        for y in range(V):
            table[(x, y)] = rng.dirichlet(np.ones(V) * concentration)
    for t in table.values():  # a filtered-out token, as top-p or top-k would leave
        t[rng.integers(V)] = 0.0
        t /= t.sum()
    return table


def _sequences(rule: Callable, p_tab: dict, q_tab: dict, one_hot: bool, n: int, seed: int) -> np.ndarray:
    """n rounds: draft x_1..x_K from q (or q's mode, one-hot q), accept with ``rule``, then continue by sampling p, so
    that every row holds K+1 tokens whose joint law must be p's. Returns [n, K+1]."""
    rng = np.random.default_rng(seed)

    def draw(tab: dict, prefixes: np.ndarray) -> np.ndarray:
        probs = np.stack([tab[tuple(s)] for s in prefixes])  # [n, V]
        u = rng.random((len(prefixes), 1))
        return np.minimum((probs.cumsum(-1) < u).sum(-1), V - 1)

    drafts = np.zeros((n, K), dtype=np.int64)
    for i in range(K):
        if one_hot:  # a drafter without a distribution: its own mode (a greedy-only head)
            drafts[:, i] = [int(np.argmax(q_tab[tuple(s)])) for s in drafts[:, :i]]
        else:
            drafts[:, i] = draw(q_tab, drafts[:, :i])
    p_rows = np.stack([np.stack([p_tab[tuple(s[:i])] for i in range(K + 1)]) for s in drafts])  # [n, K+1, V]
    q_rows = None if one_hot else _log(np.stack([np.stack([q_tab[tuple(s[:i])] for i in range(K)]) for s in drafts]))
    a, bonus = rule(mx.array(drafts, dtype=mx.uint32), q_rows, _log(p_rows), mx.random.key(seed))
    a, bonus = np.array(a), np.array(bonus)
    out = np.zeros((n, K + 1), dtype=np.int64)
    for j in range(K + 1):
        emitted = np.where(a > j, drafts[:, min(j, K - 1)], bonus)
        later = a < j  # position j comes after this round's output: sample it from p
        out[:, j] = np.where(later, draw(p_tab, out[:, :j]) if j else 0, emitted)
    return out


def _joint(p_tab: dict) -> np.ndarray:
    joint = np.zeros((V,) * (K + 1))
    for idx in np.ndindex(*joint.shape):
        joint[idx] = np.prod([p_tab[tuple(idx[:j])][idx[j]] for j in range(K + 1)])
    return joint.reshape(-1)


def _wrong_rule(drafts, q, p, key):
    """A classic bug: after a rejection, draw the bonus from p instead of norm(max(0, p - q))."""
    saved = accept.residual
    accept.residual = lambda p_, q_: p_
    try:
        return accept.rejection_accept(drafts, q, p, key)
    finally:
        accept.residual = saved


@pytest.mark.parametrize("one_hot", [False, True])
def test_sequences_follow_p_and_a_wrong_rule_is_caught(one_hot: bool) -> None:
    p_tab, q_tab = _tree(20, 0.7), _tree(21, 0.7)
    joint = _joint(p_tab)
    seqs = _sequences(accept.rejection_accept, p_tab, q_tab, one_hot, N, seed=22)
    codes = np.ravel_multi_index(seqs.T, (V,) * (K + 1))
    stat, df, pv = chisquare(np.bincount(codes, minlength=joint.size), joint)
    assert pv > PASS_P, (stat, df, pv, tv(np.bincount(codes, minlength=joint.size), joint))

    bad = _sequences(_wrong_rule, p_tab, q_tab, one_hot, N, seed=22)
    bad_codes = np.ravel_multi_index(bad.T, (V,) * (K + 1))
    assert chisquare(np.bincount(bad_codes, minlength=joint.size), joint)[2] < CAUGHT_P
