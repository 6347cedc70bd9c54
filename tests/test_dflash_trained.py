"""A tiny drafter trained for DFlash's objective on its target's own greedy text accepts in the
round loop (naturally: zero, partial and full rounds) and stays exact; shifting its context by one
position costs acceptance, so the captures and the context positions line up as in training."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict

import mlx.core as mx
import pytest

from conftest import greedy_reference, make_host, no_stop
from mlx_speculative.drafters.dflash import DFlashBatch, tiny
from mlx_speculative.testing import tiny_models as tm
from mlx_speculative.testing.tiny_models import corpus

pytestmark = pytest.mark.integration

FIXTURES = Path(__file__).parent / "fixtures" / "dflash"
SEQUENCES = 16


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Dict[str, Any]:
    root = tmp_path_factory.mktemp("dflash_trained")
    target = tm.make_checkpoint(root / "target", tm.llama_config(num_hidden_layers=4), seed=41,
                                tokenizer_dir=tokenizer_dir, logit_scale=3.0, quiet_layers_from=2)
    real = json.loads((FIXTURES / "z-lab__Qwen3-4B-DFlash-b16.config.json").read_text())
    config = tiny.shrink_config(real, target_layer_ids=[0, 2], mask_token_id=383, num_target_layers=4, block_size=8)
    drafter = tiny.write_checkpoint(root / "drafter", config, seed=42)
    losses = tiny.train(drafter, target, steps=100, sequences=SEQUENCES, batch=SEQUENCES, length=48, seed=0)
    assert losses["last_loss"] < losses["first_loss"] / 2, losses
    return {"target": target, "drafter": drafter}


def _run(trained: Dict[str, Any]) -> Dict[str, int]:
    # A pinned block: acceptance then measures the drafter alone, not the adaptive controller.
    host = make_host({"draft_model": str(trained["drafter"]), "block_size": 8})
    target = host.load(str(trained["target"]))
    totals = {"zero": 0, "partial": 0, "full": 0, "accepted": 0, "drafted": 0}
    for text in corpus(SEQUENCES, seed=1)[:8]:  # the prompts it was trained on (see tiny.train)
        prompt = (target.tokenizer.encode(text, add_special_tokens=False) * 8)[:8]
        ref = greedy_reference(target.model, prompt, 40)
        result = host.generate(target, prompt, no_stop(40))
        assert result.tokens == ref, text
        stats = result.report["speculative"]
        for k, v in stats.rounds_by_acceptance.items():
            totals[k] += v
        totals["accepted"] += stats.accepted_tokens
        totals["drafted"] += stats.draft_tokens
    return totals


def test_trained_drafter_accepts_and_is_exact(trained: Dict[str, Any]) -> None:
    totals = _run(trained)
    assert totals["zero"] > 0 and totals["partial"] > 0 and totals["full"] > 0, totals
    assert totals["accepted"] > 0.3 * totals["drafted"], totals


def test_context_off_by_one_loses_acceptance(trained: Dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    aligned = _run(trained)
    original = DFlashBatch._features

    def shifted(self: DFlashBatch, state: Any) -> Any:
        h = original(self, state)  # [1, n, taps*H] of the row's new positions
        return None if h is None else mx.concatenate([mx.zeros_like(h[:, :1]), h[:, :-1]], axis=1)

    monkeypatch.setattr(DFlashBatch, "_features", shifted)
    wrong = _run(trained)  # still exact: only the drafts get worse
    rate = lambda t: t["accepted"] / t["drafted"]  # noqa: E731
    zero_share = lambda t: t["zero"] / (t["zero"] + t["partial"] + t["full"])  # noqa: E731
    assert rate(wrong) < 0.8 * rate(aligned) and zero_share(wrong) > 1.5 * zero_share(aligned), (aligned, wrong)
