"""Greedy DFlash decoding equals plain decoding token for token (fp32, CPU) on llama, qwen3 and
qwen3_5 targets, for tiny drafters in each real checkpoint format; stats through ``--json``."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Dict, List

import mlx.core as mx
import pytest

from conftest import PROMPTS, encode, greedy_reference, make_host, no_stop
from mlx_speculative.drafters.base import Proposal
from mlx_speculative.drafters.dflash import DFlashBatch, tiny
from mlx_speculative.testing import tiny_models as tm
from mlx_speculative.hooks.cli import main
from test_dflash_rounds import qwen3_5_config

pytestmark = pytest.mark.integration

FIXTURES = Path(__file__).parent / "fixtures" / "dflash"
FORMATS = {  # fixture, target_layer_ids for a 4-layer target, tensor-name prefix
    "b16_flat": ("z-lab__Qwen3-4B-DFlash-b16", [0, 2], ""),
    "nested": ("z-lab__Qwen3.5-4B-DFlash", [0, 1, 3], "model."),
    "muse_assistant": ("meta-models__Muse-Glimmer-30B-assistant", [1, 3], ""),
    "speculators": ("speculators-issue-613__dflash-qwen3.6-35b-a3b", [1, 2], ""),
}
ARCHS = ["llama", "qwen3", "qwen3_5"]
LENGTHS = (1, 9, 33)
_REFERENCE: Dict[tuple, List[int]] = {}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Dict[str, Path]:
    root = tmp_path_factory.mktemp("dflash_greedy")
    out = {
        "llama": tm.make_checkpoint(root / "llama", tm.llama_config(num_hidden_layers=4), seed=31,
                                    tokenizer_dir=tokenizer_dir, logit_scale=3.0, quiet_layers_from=2),
        "qwen3": tm.make_checkpoint(root / "qwen3", tm.qwen3_config(num_hidden_layers=4, tie_word_embeddings=True),
                                    seed=32, tokenizer_dir=tokenizer_dir, logit_scale=3.0, quiet_layers_from=2),
        "qwen3_5": tm.make_checkpoint(root / "qwen3_5", qwen3_5_config(), seed=33, tokenizer_dir=tokenizer_dir,
                                      logit_scale=3.0),
    }
    for fmt, (name, ids, prefix) in FORMATS.items():
        real = json.loads((FIXTURES / f"{name}.config.json").read_text())
        config = tiny.shrink_config(real, target_layer_ids=ids, mask_token_id=383, num_target_layers=4)
        out[fmt] = tiny.write_checkpoint(root / fmt, config, seed=34, prefix=prefix)
    return out


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_plain(arch: str, fmt: str, models: Dict[str, Path]) -> None:
    host = make_host({"draft_model": str(models[fmt]), "kind": "auto"})
    target = host.load(str(models[arch]))
    assert target.attachments["speculative"].drafter.kind == "dflash"
    plain = make_host(None, plugins=False)
    rounds = 0
    for text in PROMPTS[:3]:
        prompt = encode(target, text)
        for n in LENGTHS:
            key = (arch, text, n)
            if key not in _REFERENCE:  # the same for every format: computed once per target
                _REFERENCE[key] = greedy_reference(target.model, prompt, n)
                assert plain.generate(target, prompt, no_stop(n)).tokens == _REFERENCE[key]
            ref = _REFERENCE[key]
            result = host.generate(target, prompt, no_stop(n))
            assert result.tokens == ref, (text, n)
            stats = result.report.get("speculative")
            if n > 1:
                assert stats is not None and stats.kind == "dflash" and stats.fallback is None
                rounds += stats.rounds
    assert rounds > 0


class Oracle:
    """Overrides proposals after the drafter ran: the target's greedy continuation, corrupted at a
    random position in some rounds, so that rounds are zero, partial and full."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, seed: int = 0):
        self.rng = random.Random(seed)
        self.ref: List[int] = []
        self.prompt_len = 0
        original = DFlashBatch.propose
        oracle = self

        def propose(batch: DFlashBatch, rows: List[Any], max_drafts: List[int]) -> List[Proposal]:
            out = []
            for state, proposal, m in zip(rows, original(batch, rows, max_drafts), max_drafts):
                g = len(state.tokens) - oracle.prompt_len
                drafts = list(oracle.ref[g: g + m])
                own = proposal.tokens.tolist() if isinstance(proposal.tokens, mx.array) else list(proposal.tokens)
                drafts += own[len(drafts):]  # past the reference's end: the drafter's own
                case = oracle.rng.choice(["zero", "partial", "full", "full"])
                if case != "full":
                    j = 0 if case == "zero" else oracle.rng.randrange(len(drafts))
                    drafts[j] = (drafts[j] + 1) % 384
                out.append(Proposal(drafts, proposal.logprobs))
            return out

        monkeypatch.setattr(DFlashBatch, "propose", propose)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_plain_with_zero_partial_full(arch: str, models: Dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    oracle = Oracle(monkeypatch, seed=3)
    host = make_host({"draft_model": str(models["nested"])})
    target = host.load(str(models[arch]))
    totals = {"zero": 0, "partial": 0, "full": 0}
    sizes: List[int] = []
    plain_steps = 0
    for text in PROMPTS[:6]:
        prompt = encode(target, text)
        for n in (5, 40):
            ref = greedy_reference(target.model, prompt, n)
            oracle.ref, oracle.prompt_len = ref, len(prompt)
            result = host.generate(target, prompt, no_stop(n))
            assert result.tokens == ref, (text, n)
            stats = result.report["speculative"]
            assert stats.fallback is None
            for k, v in stats.rounds_by_acceptance.items():
                totals[k] += v
            sizes += stats.block_sizes
            plain_steps += stats.plain_steps
    assert all(v > 0 for v in totals.values()), totals
    # adaptive: a collapse shrinks the block or (nothing accepted) pauses for plain steps; back to the cap
    assert max(sizes) == 16 and (min(sizes) < 16 or plain_steps > 0)


def _cli_json(capsys: pytest.CaptureFixture, *args: str) -> Dict[str, Any]:
    assert main(["generate", "--json", "--ignore-chat-template", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_stats(models: Dict[str, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    common = ["--model", str(models["qwen3"]), "--prompt", PROMPTS[0], "--max-tokens", "40"]
    plain = _cli_json(capsys, *common, "--no-speculative")
    assert plain["speculative"] is None

    oracle = Oracle(monkeypatch, seed=5)
    oracle.prompt_len = plain["prompt_tokens"]
    oracle.ref = plain["tokens"]
    out = _cli_json(capsys, *common, "--draft-model", str(models["b16_flat"]), "--draft-kind", "auto")
    assert out["tokens"] == plain["tokens"]
    spec = out["speculative"]
    assert spec["kind"] == "dflash" and spec["fallback"] is None
    per_pos = spec["accepted_per_position"]
    assert len(per_pos) == 15 and per_pos == sorted(per_pos, reverse=True) and sum(per_pos) == spec["accepted_tokens"]
    assert len(spec["block_sizes"]) == spec["rounds"] and spec["block_sizes"][0] == 16
    assert spec["mean_acceptance_length"] == pytest.approx(1 + spec["accepted_tokens"] / spec["rounds"], abs=1e-3)

    pinned = _cli_json(capsys, *common, "--draft-model", str(models["b16_flat"]), "--draft-block-size", "4")
    assert pinned["tokens"] == plain["tokens"]
    assert set(pinned["speculative"]["block_sizes"]) == {4} and len(pinned["speculative"]["accepted_per_position"]) == 3


def test_sampling_rounds_use_q(models: Dict[str, Path]) -> None:
    from mlx_speculative.hooks.host import GenerationParams
    from mlx_speculative.hooks.state import SamplingParams

    host = make_host({"draft_model": str(models["b16_flat"])})
    target = host.load(str(models["llama"]))
    params = GenerationParams(max_tokens=24, stop_token_ids=[], sampling=SamplingParams(temperature=0.8, seed=4))
    result = host.generate(target, encode(target, PROMPTS[1]), params)
    stats = result.report["speculative"]
    assert len(result.tokens) == 24 and stats.fallback is None and stats.rounds > 0
    again = host.generate(target, encode(target, PROMPTS[1]), params)
    assert again.tokens == result.tokens  # a seeded request repeats, drafter draws included
