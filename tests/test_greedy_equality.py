"""Greedy speculative output equals mlx-lm's generate_step token for token (fp32, CPU)."""

from __future__ import annotations

from typing import Any, Dict

import pytest

from conftest import PROMPTS, encode, greedy_reference, make_host, no_stop

LENGTHS = (1, 7, 40)


def _run_all(pair: Dict[str, Any], speculative: Dict[str, Any]) -> Dict[str, int]:
    host = make_host(speculative)
    target = host.load(str(pair["target"]))
    plain = make_host(None, plugins=False)
    totals = {"rounds": 0, "accepted": 0, "drafted": 0, "zero": 0, "partial": 0, "full": 0}
    for text in PROMPTS:
        prompt = encode(target, text)
        for n in LENGTHS:
            ref = greedy_reference(target.model, prompt, n)
            result = host.generate(target, prompt, no_stop(n))
            assert result.tokens == ref, (text, n)
            assert plain.generate(target, prompt, no_stop(n)).tokens == ref
            stats = result.report.get("speculative")
            if stats is None:
                assert n == 1
                continue
            totals["rounds"] += stats.rounds
            totals["accepted"] += stats.accepted_tokens
            totals["drafted"] += stats.draft_tokens
    return totals


@pytest.mark.parametrize("arch", ["llama_pair", "qwen3_pair"])
def test_draft_model_equals_generate_step(arch: str, request: pytest.FixtureRequest) -> None:
    pair = request.getfixturevalue(arch)
    totals = _run_all(pair, {"draft_model": str(pair["drafter"]), "block_size": 4})
    assert 0 < totals["accepted"] < totals["drafted"]


@pytest.mark.parametrize("arch", ["llama_pair", "qwen3_pair"])
def test_ngram_equals_generate_step(arch: str, request: pytest.FixtureRequest) -> None:
    pair = request.getfixturevalue(arch)
    totals = _run_all(pair, {"kind": "ngram", "block_size": 6})
    assert totals["rounds"] > 0 and totals["accepted"] > 0
