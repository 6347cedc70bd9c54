"""``kind: mtp`` with no draft model: the MTP heads inside the target's own checkpoint (vLLM's ``method: mtp``).

Tiny Qwen3.5 and DeepSeek-V3 targets carry their random head (``mtp.*``; the nextn layer
``model.layers.{N}.*``) in their own safetensors shards. Named by the kind alone, the head is found
there; rounds forced to zero, partial and full acceptance (the head really runs; its proposals are
replaced by the target's continuation, corrupted at a chosen position) give plain decoding's tokens.
A target whose config promises a head its files lack (an mlx-lm conversion) and a target with none
get one-line errors naming what was expected and the split route.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

import pytest

from conftest import PROMPTS, encode, greedy_reference, make_host, no_stop
from mlx_speculative.drafters import registry
from mlx_speculative.drafters.base import DraftTarget, DrafterError, Proposal
from mlx_speculative.drafters.mtp import tiny
from mlx_speculative.drafters.mtp.batch import HeadBatch
from mlx_speculative.testing import tiny_models as tm
from mlx_speculative.hooks.cli import main

pytestmark = pytest.mark.integration

PLAN = ["zero", "full", "partial", "full", "zero", "partial", "full", "zero", "partial"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Dict[str, Path]:
    root = tmp_path_factory.mktemp("mtp_own")
    deepseek = tm.deepseek_v3_config(num_hidden_layers=3, num_nextn_predict_layers=1)
    return {
        "qwen3_5": tiny.write_qwen_target(root / "qwen3_5", tiny.qwen3_5_config(), seed=71, tokenizer_dir=tokenizer_dir),
        "deepseek": tiny.write_deepseek_target(root / "deepseek", deepseek, seed=72, tokenizer_dir=tokenizer_dir),
        "converted": tiny.write_qwen_target(root / "converted", tiny.qwen3_5_config(), seed=71,
                                            tokenizer_dir=tokenizer_dir, head=False, shards=1),
        "llama": tm.make_checkpoint(root / "llama", tm.llama_config(), seed=73, tokenizer_dir=tokenizer_dir),
    }


def _forced(case: str, truth: List[int], vocab: int = 384) -> List[int]:
    j = {"zero": 0, "partial": 1, "full": len(truth)}[case]
    drafts = list(truth)
    if j < len(truth):
        drafts[j] = (truth[j] + 1) % vocab
    return drafts


@pytest.mark.parametrize("name,family", [("qwen3_5", "qwen3_5_mtp"), ("deepseek", "deepseek_nextn")])
def test_kind_mtp_alone_uses_the_targets_own_head_and_stays_exact(
    name: str, family: str, models: Dict[str, Path], monkeypatch: pytest.MonkeyPatch,
) -> None:
    host = make_host({"kind": "mtp", "block_size": 3})  # the YAML's `kind: mtp`, no draft_model
    target = host.load(str(models[name]))
    drafter = target.attachments["speculative"].drafter
    assert (drafter.kind, drafter.family) == ("mtp", family)
    prompt = encode(target, PROMPTS[5])
    ref = greedy_reference(target.model, prompt, 40)
    plan, drafted = iter(PLAN), {"rounds": 0, "own": 0}
    original = HeadBatch.propose

    def propose(self: HeadBatch, rows: List[Any], max_drafts: List[int]) -> List[Proposal]:
        (state,) = rows
        got = original(self, rows, max_drafts)[0]  # the head's own drafts, then forced
        drafted["rounds"] += 1
        g = state.generated
        return [Proposal(_forced(next(plan, "full"), ref[g:g + len(got.tokens)]))]

    monkeypatch.setattr(HeadBatch, "propose", propose)
    result = host.generate(target, prompt, no_stop(40))
    assert result.tokens == ref
    stats = result.report["speculative"]
    assert stats.fallback is None and drafted["rounds"] == stats.rounds
    assert min(stats.rounds_by_acceptance.values()) >= 2, stats.rounds_by_acceptance


def test_the_heads_own_drafts_equal_plain_decoding_through_the_cli(models: Dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    target = str(models["qwen3_5"])
    args = ["generate", "--model", target, "--prompt", PROMPTS[1], "--max-tokens", "24", "--json", "--ignore-chat-template"]
    assert main([*args, "--draft-kind", "mtp"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert main([*args, "--no-speculative"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert spec["speculative"]["kind"] == "mtp" and spec["speculative"]["rounds"] > 0
    assert spec["tokens"] == plain["tokens"]
    assert main(["check", "--model", target, "--draft-kind", "mtp", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["kind"], report["family"], report["compatible"]) == ("mtp", "qwen3_5_mtp", True)


def test_a_conversion_without_the_tensors_names_the_split_route(models: Dict[str, Path]) -> None:
    host = make_host({"kind": "mtp"})
    with pytest.raises(Exception, match=r"mtp\.\*: none in .*mlx-lm's convert drops them.*mlx_vlm\.split_mtp"):
        host.load(str(models["converted"]))


def test_a_target_without_heads_is_a_one_line_error(models: Dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    config = json.loads((models["llama"] / "config.json").read_text())
    with pytest.raises(DrafterError) as err:
        registry.resolve(None, "mtp", DraftTarget(config=config, path=models["llama"]))
    message = str(err.value)
    assert "\n" not in message and "the target (model_type 'llama') has none" in message
    assert "mtp_num_hidden_layers >= 1" in message and "num_nextn_predict_layers >= 1" in message
    assert "mlx_vlm.split_mtp" in message and "train-drafter --kind mtp" in message and "--draft-model" in message
    # Without a target to look in (mlx-spec check gives one), and for kinds no target carries: as before.
    with pytest.raises(DrafterError, match="no draft model needs heads inside the target's own checkpoint"):
        registry.resolve(None, "mtp")
    with pytest.raises(DrafterError, match=r"^draft kind 'draft_model' needs a draft model"):
        registry.resolve(None, "draft_model", DraftTarget(config=config, path=models["llama"]))
    assert main(["check", "--model", str(models["llama"]), "--draft-kind", "mtp"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("mlx-spec: error:")]
    assert len(lines) == 1 and "has none" in lines[0]
