"""Rejection sampling with MTP drafters leaves the target's distribution unchanged.

16-token targets with their drafters: a Qwen3.5 target with its ``mtp.*`` head, and a Gemma 4 text
target with a tiny assistant whose sparse head selects 2 of 4 clusters per step (its q is zero on
half the vocabulary). As in test_sampling_distribution: the target's exact law of its first tokens
under its own sampling (temperature, top-p 0.9) against unseeded continuations (speculative sampling)
through the real host, by Pearson's chi-square.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict

import pytest

from mlx_speculative.drafters.mtp import tiny
from mlx_speculative.hooks.state import SamplingParams
from test_sampling_distribution import TOP_P, VOCAB, exact_distributions, fit, host_tokens, tally, word_tokenizer
from test_sampling_stats import PASS_P

pytestmark = pytest.mark.statistical

REAL = json.loads((Path(__file__).parent / "fixtures" / "mtp" / "google__gemma-4-E2B-it-assistant.config.json").read_text())


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Dict[str, Any]]:
    root = tmp_path_factory.mktemp("mtp_sampling")
    tok = word_tokenizer(root / "tokenizer", VOCAB)
    qwen = tiny.write_qwen_target(root / "qwen", tiny.qwen3_5_config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64),
                                  seed=11, tokenizer_dir=tok, logit_scale=2.0)
    config = tiny.gemma4_text_config(vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB, hidden_size=32)
    gemma = tiny.write_gemma_target(root / "gemma", config, seed=12, tokenizer_dir=tok, logit_scale=1.0)
    assistant = tiny.write_assistant(root / "assistant", tiny.assistant_config(REAL, config, centroids=4, top_k=2),
                                     seed=13, tokenizer_dir=tok)
    return {"qwen3_5_mtp": {"target": qwen, "drafter": qwen}, "gemma4_assistant": {"target": gemma, "drafter": assistant}}


def run(pairs: Dict[str, Dict[str, Any]], name: str, temperature: float, samples: int) -> None:
    from mlx_lm import load

    pair = pairs[name]
    tokens, rounds = host_tokens(pair, temperature, samples)
    assert all(n > 0 for n in rounds.values()), rounds  # zero, partial and full acceptance all occur
    model, _ = load(str(pair["target"]))
    exact = exact_distributions(model, SamplingParams(temperature=temperature, top_p=TOP_P))
    results = fit(*tally(tokens), exact)
    assert all(pv > PASS_P for _, pv, _ in results), results


@pytest.mark.parametrize("name", ["qwen3_5_mtp", "gemma4_assistant"])
def test_mtp_rounds_keep_the_target_distribution(pairs: Dict[str, Dict[str, Any]], name: str) -> None:
    run(pairs, name, 1.0, 600)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3_5_mtp", "gemma4_assistant"])
def test_mtp_rounds_keep_the_target_distribution_at_a_lower_temperature(pairs: Dict[str, Dict[str, Any]], name: str) -> None:
    run(pairs, name, 0.7, 1000)
