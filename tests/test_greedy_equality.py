"""Greedy speculative output equals mlx-lm's generate_step token for token (fp32, CPU)."""

from __future__ import annotations

from typing import Any, Dict

import pytest

from conftest import PROMPTS, encode, greedy_reference, make_host, no_stop

pytestmark = pytest.mark.integration

LENGTHS = (1, 7, 40)


def _run_all(pair: Dict[str, Any], speculative: Dict[str, Any], prompts=PROMPTS, lengths=LENGTHS) -> Dict[str, int]:
    host = make_host(speculative)
    target = host.load(str(pair["target"]))
    plain = make_host(None, plugins=False)
    totals = {"rounds": 0, "accepted": 0, "drafted": 0, "zero": 0, "partial": 0, "full": 0}
    for text in prompts:
        prompt = encode(target, text)
        for n in lengths:
            ref = greedy_reference(target.model, prompt, n)
            result = host.generate(target, prompt, no_stop(n))
            assert result.tokens == ref, (text, n)
            assert plain.generate(target, prompt, no_stop(n)).tokens == ref
            stats = result.report.get("speculative")
            if stats is None:
                assert n == 1, "a request of more than one token must run rounds"
                continue
            assert stats.fallback is None
            totals["rounds"] += stats.rounds
            totals["accepted"] += stats.accepted_tokens
            totals["drafted"] += stats.draft_tokens
            for key, count in stats.rounds_by_acceptance.items():
                totals[key] += count
    return totals


@pytest.mark.parametrize("arch", ["llama_pair", "qwen3_pair"])
def test_draft_model_equals_generate_step(arch: str, request: pytest.FixtureRequest) -> None:
    pair = request.getfixturevalue(arch)
    totals = _run_all(pair, {"draft_model": str(pair["drafter"]), "block_size": 4})
    assert totals["zero"] > 0 and totals["partial"] > 0 and totals["full"] > 0, totals


@pytest.mark.parametrize("arch", ["llama_pair", "qwen3_pair"])
def test_ngram_equals_generate_step(arch: str, request: pytest.FixtureRequest) -> None:
    pair = request.getfixturevalue(arch)
    totals = _run_all(pair, {"kind": "ngram", "block_size": 6})
    assert totals["zero"] > 0 and totals["partial"] > 0 and totals["full"] > 0, totals


def test_identical_drafter_accepts_everything(llama_pair: Dict[str, Any]) -> None:
    totals = _run_all(llama_pair, {"draft_model": str(llama_pair["target"]), "block_size": 5},
                      prompts=PROMPTS[:5], lengths=(23,))
    assert totals["accepted"] == totals["drafted"] > 0
    assert totals["full"] == totals["rounds"]


def test_random_drafter_still_exact(qwen3_pair: Dict[str, Any]) -> None:
    totals = _run_all(qwen3_pair, {"draft_model": str(qwen3_pair["random_drafter"]), "block_size": 3,
                                   "adaptive": False}, prompts=PROMPTS[:6], lengths=(17,))
    assert totals["zero"] > totals["full"]


def test_adaptive_block_size_pauses_on_rejection(qwen3_pair: Dict[str, Any]) -> None:
    host = make_host({"draft_model": str(qwen3_pair["random_drafter"])})
    target = host.load(str(qwen3_pair["target"]))
    prompt = encode(target, PROMPTS[0])
    result = host.generate(target, prompt, no_stop(60))
    stats = result.report["speculative"]
    assert stats.block_sizes[0] == 4
    # Rounds that keep failing give way to plain steps (timed: the next pauses are sized by the
    # measured costs); nothing is lost or repeated.
    assert stats.plain_steps > 0 and stats.rounds + stats.accepted_tokens + stats.plain_steps == 59
    assert stats.block_sizes == [4] * stats.rounds and stats.rounds <= 4  # paused at the same size, backing off
    assert result.tokens == greedy_reference(target.model, prompt, 60)


@pytest.mark.parametrize("speculative", [{"kind": "ngram", "block_size": 6}, "drafter"])
def test_logits_processors_apply_per_verified_position(speculative: Any, llama_pair: Dict[str, Any]) -> None:
    """Repetition penalty and logit bias see each position's own history, as in one-token decoding."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_logits_processors

    if speculative == "drafter":
        speculative = {"draft_model": str(llama_pair["drafter"]), "block_size": 4}
    host = make_host(speculative)
    target = host.load(str(llama_pair["target"]))
    changed = False
    for text in PROMPTS[:8]:
        prompt = encode(target, text)
        processors = make_logits_processors({5: 2.0, 17: -1.0}, repetition_penalty=1.5, repetition_context_size=8)
        ref = [int(t) for t, _ in generate_step(mx.array(prompt), target.model, max_tokens=30,
                                                logits_processors=processors)]
        params = no_stop(30, logits_processors=make_logits_processors({5: 2.0, 17: -1.0}, repetition_penalty=1.5,
                                                                      repetition_context_size=8))
        result = host.generate(target, prompt, params)
        assert result.tokens == ref, text
        assert result.report["speculative"].rounds > 0
        changed = changed or result.tokens != greedy_reference(target.model, prompt, 30)
    assert changed, "the processors must change some outputs, or this test proves nothing"
