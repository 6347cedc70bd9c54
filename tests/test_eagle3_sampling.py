"""Rejection sampling with an EAGLE-3 drafter keeps the target's distribution, with a draft
vocabulary that does not contain the target's likeliest token (q is zero there).

The tiny 16-token llama target of ``test_sampling_distribution`` and its exact law under one-token
sampling (temperature, top-p 0.9). Against it: the vectorised decode loop with q restricted to the
draft vocabulary before the sampling filters (as the drafter makes it), 100,000 tokens; and the
real host with an EAGLE-3 drafter whose 10-token draft vocabulary leaves the likeliest token out.
Every round hands ``rejection_accept`` a q over the target's full vocabulary: zero outside the
draft vocabulary, normalised, the drafts inside its support.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

import mlx.core as mx
import numpy as np
import pytest

from mlx_speculative.drafters.eagle3 import tiny
from mlx_speculative.hooks.state import SamplingParams
from mlx_speculative.plugin import accept
from test_sampling_distribution import (
    POSITIONS, SIM_SAMPLES, TOP_P, VOCAB, Tables, _bonus_from_p, _score, exact_distributions, fit, host_tokens, pair,
    simulate, tally,
)
from test_sampling_stats import CAUGHT_P, PASS_P

pytestmark = pytest.mark.statistical

__all__ = ["pair"]  # the 16-token target and draft LM (module fixture of test_sampling_distribution)
FIXTURES = Path(__file__).parent / "fixtures" / "eagle3"
HOST_SAMPLES = 800  # x 5 tokens; the slow run: 1,500 at another temperature


def draft_vocabulary(pair: Dict[str, Any]) -> List[int]:
    """10 of the 16 tokens, without the target's likeliest token at the first position."""
    marginals, _ = exact_distributions(pair["target_model"], SamplingParams(temperature=1.0, top_p=TOP_P))
    top = int(np.argmax(marginals[0]))
    return [t for t in range(VOCAB) if t != top][:10]


class RestrictedTables(Tables):
    """The draft LM's q restricted to ``allowed`` (-inf elsewhere) before the sampling filters."""

    def __init__(self, pair: Dict[str, Any], sampling: SamplingParams, allowed: List[int]):
        raw = SamplingParams(temperature=1.0)  # plain softmax: the log-probabilities themselves
        p, q = [], []
        for d in range(POSITIONS):
            contexts = np.stack(np.unravel_index(np.arange(VOCAB**d), (VOCAB,) * d), axis=1) if d else np.zeros((1, 0), np.int64)
            p.append(_score(pair["target_model"], contexts, sampling))
            q.append(_score(pair["drafter_model"], contexts, raw))
        mask = np.full(VOCAB, -np.inf)
        mask[allowed] = 0.0
        with np.errstate(divide="ignore"):
            self.log_p = mx.array(np.log(np.concatenate(p)).astype(np.float32))  # [contexts, V]
            q_log = mx.array((np.log(np.concatenate(q)) + mask).astype(np.float32))
        self.log_q = sampling.process(q_log - mx.logsumexp(q_log, axis=-1, keepdims=True))


@pytest.mark.parametrize("temperature", [pytest.param(0.7, marks=pytest.mark.slow), 1.0])
def test_rounds_keep_the_distribution_with_q_zero_outside_the_draft_vocabulary(pair: Dict[str, Any], temperature: float) -> None:
    allowed = draft_vocabulary(pair)
    sampling = SamplingParams(temperature=temperature, top_p=TOP_P)
    tables = RestrictedTables(pair, sampling, allowed)
    assert bool(mx.all(mx.isinf(tables.log_q[:, [t for t in range(VOCAB) if t not in allowed]])).item())
    exact = exact_distributions(pair["target_model"], sampling)
    top = int(np.argmax(exact[0][0]))
    assert top not in allowed and exact[0][0][top] > 0.2  # the likeliest token can only come as a bonus
    tokens = simulate(tables, SIM_SAMPLES, seed=2)
    results = fit(*tally(tokens), exact)
    assert all(pv > PASS_P for _, pv, _ in results), results
    wrong = fit(*tally(simulate(tables, SIM_SAMPLES, seed=2, rule=_bonus_from_p)), exact)
    assert min(pv for _, pv, _ in wrong) < CAUGHT_P, wrong  # the control: a wrong rule is caught


@pytest.fixture(scope="module")
def eagle_pair(pair: Dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    real = json.loads((FIXTURES / "sgl-project__SpecForge__llama3-8B-eagle3.config.json").read_text())
    config = tiny.shrink_config(real, layer_ids=[0, 1, 1], draft_vocab_size=10, hidden_size=16, intermediate_size=32,
                                num_attention_heads=2, num_key_value_heads=1, head_dim=8, vocab_size=VOCAB)
    allowed = draft_vocabulary(pair)
    path = tiny.write_checkpoint(tmp_path_factory.mktemp("eagle3_v16") / "drafter", config, seed=12,
                                 draft_ids=allowed, scale=2.0)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).write_bytes((pair["target"] / name).read_bytes())
    return {**pair, "drafter": path, "allowed": allowed}


def _host_fits(eagle_pair: Dict[str, Any], temperature: float, samples: int) -> None:
    tokens, rounds = host_tokens(eagle_pair, temperature, samples)
    assert all(n > 0 for n in rounds.values()), rounds  # zero, partial and full acceptance all occur
    exact = exact_distributions(eagle_pair["target_model"], SamplingParams(temperature=temperature, top_p=TOP_P))
    top = int(np.argmax(exact[0][0]))
    assert (tokens == top).mean() > 0.1  # the token the drafter cannot propose, emitted as the bonus
    results = fit(*tally(tokens), exact)
    assert all(pv > PASS_P for _, pv, _ in results), results


def test_host_rounds_with_an_eagle3_drafter_keep_the_distribution(eagle_pair: Dict[str, Any]) -> None:
    _host_fits(eagle_pair, 1.0, HOST_SAMPLES)


@pytest.mark.slow
def test_host_rounds_with_an_eagle3_drafter_keep_the_distribution_at_0_7(eagle_pair: Dict[str, Any]) -> None:
    _host_fits(eagle_pair, 0.7, 1_500)


def test_rounds_hand_over_q_over_the_full_vocabulary(eagle_pair: Dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    calls: List[Any] = []
    real = accept.rejection_accept

    def recording(drafts, log_q, log_p, key=None):
        calls.append((np.array(drafts).tolist(), np.array(log_q)))
        return real(drafts, log_q, log_p, key)

    monkeypatch.setattr(accept, "rejection_accept", recording)
    host_tokens(eagle_pair, 0.7, 40)
    assert len(calls) > 40
    outside = [t for t in range(VOCAB) if t not in eagle_pair["allowed"]]
    for drafts, log_q in calls:
        q = np.exp(log_q)  # [k, V]: the target's full vocabulary
        assert q.shape == (len(drafts), VOCAB)
        np.testing.assert_allclose(q.sum(-1), 1.0, atol=1e-5)
        assert (q[:, outside] == 0).all()
        assert all(q[i, x] > 0 and x in eagle_pair["allowed"] for i, x in enumerate(drafts))
