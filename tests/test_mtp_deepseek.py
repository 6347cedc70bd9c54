"""DeepSeek-V3's nextn layer (family deepseek_nextn), read from a tiny 3-layer target's own shards.

The target stores the layer as ``model.layers.3.*`` (enorm, hnorm, eh_proj, an MoE block with MLA
attention in the Hugging Face layout: per-expert weights and ``kv_b_proj``, shared_head, its own
embedding copy), which ``mlx_lm.load`` refuses; the host loads the target without it. Rounds forced to
zero, partial and full acceptance stay exact, the layer's cache equals a from-scratch recomputation
after every round, and a batch of eight accepts different counts in one step.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from conftest import PROMPTS, encode, greedy_reference, make_host, no_stop
from mlx_speculative.drafters import registry
from mlx_speculative.drafters.base import DraftTarget, Proposal
from mlx_speculative.drafters.mtp import deepseek, tiny
from mlx_speculative.drafters.mtp.batch import HeadBatch
from mlx_speculative.hooks import loading
from mlx_speculative.testing import tiny_models as tm
from mlx_speculative.hooks.kv_view import committed_kv
from test_engine_batch import WatchedDrafter, _run_batch
from test_mtp_qwen import ATOL, PLAN, forced, scratch

pytestmark = pytest.mark.integration

BLOCK = 3


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Dict[str, Path]:
    root = tmp_path_factory.mktemp("mtp_deepseek")
    config = tm.deepseek_v3_config(num_hidden_layers=3, num_nextn_predict_layers=1)
    return {"target": tiny.write_deepseek_target(root / "target", config, seed=91, tokenizer_dir=tokenizer_dir),
            "converted": tiny.write_deepseek_target(root / "converted", config, seed=91, tokenizer_dir=tokenizer_dir,
                                                    nextn=False, shards=1)}


def test_the_target_loads_without_its_nextn_layer(models: Dict[str, Path]) -> None:
    from mlx_lm import load

    index = json.loads((models["target"] / "model.safetensors.index.json").read_text())["weight_map"]
    layer = {n for n in index if n.startswith("model.layers.3.")}
    assert {"model.layers.3.eh_proj.weight", "model.layers.3.enorm.weight", "model.layers.3.shared_head.head.weight",
            "model.layers.3.self_attn.kv_b_proj.weight", "model.layers.3.mlp.experts.0.up_proj.weight"} <= layer
    with pytest.raises(ValueError, match="parameters not in model"):
        load(str(models["target"]))  # mlx-lm's sanitize drops only model.layers.61
    config = loading.read_config(models["target"])
    assert loading.extra_layer_prefixes(config) == ("model.layers.3.",)
    model, _ = loading.load_target(models["target"], config)
    assert len(model.model.layers) == 3 and "sanitize" not in model.__dict__ and type(model).__module__ == "mlx_lm.models.deepseek_v3"
    resolution = registry.resolve(str(models["target"]), "auto")
    assert (resolution.kind, resolution.family.name) == ("mtp", "deepseek_nextn")


def test_check_and_the_converted_target(models: Dict[str, Path]) -> None:
    config = loading.read_config(models["target"])
    verdict = deepseek.check(models["target"], config, DraftTarget(config=config, path=models["target"]))
    assert verdict.ok and any("model.layers.3.*: " in n for n in verdict.notes), verdict.notes
    verdict = deepseek.check(None, dict(config, num_nextn_predict_layers=2), DraftTarget(config=config))
    assert any("num_nextn_predict_layers: 2; supported: 1" in r for r in verdict.reasons)
    verdict = deepseek.check(None, config, DraftTarget(config=dict(config, hidden_size=128)))
    assert any("hidden_size: the checkpoint has 64, the target 128" in r for r in verdict.reasons)
    host = make_host({"draft_model": str(models["converted"])})
    with pytest.raises(Exception, match=r"model\.layers\.3\.\*: none in .*mlx-lm's convert drops the nextn layer"):
        host.load(str(models["converted"]))
    # The original checkpoint's layer serves a target without it.
    drafter = make_host({"draft_model": str(models["target"])}).load(str(models["converted"])).attachments["speculative"].drafter
    assert drafter.family == "deepseek_nextn"
    assert not any("embed_tokens" in k for k, _ in tree_flatten(drafter.model.parameters()))  # its embedding copy is not read


def test_forced_acceptance_is_exact(models: Dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    host = make_host({"draft_model": str(models["target"]), "block_size": BLOCK})
    target = host.load(str(models["target"]))
    drafter = target.attachments["speculative"].drafter
    assert (drafter.kind, drafter.default_block_size) == ("mtp", 2)
    prompt = encode(target, PROMPTS[5])
    ref = greedy_reference(target.model, prompt, 40)
    plan, seen = iter(PLAN), {"rounds": 0}
    original = HeadBatch.propose

    def propose(self: HeadBatch, rows: List[Any], max_drafts: List[int]) -> List[Proposal]:
        (state,) = rows
        want = scratch(target, drafter, state.tokens)
        view = committed_kv(self.cache[0])
        assert view.keys.shape == want["keys"].shape and mx.allclose(view.keys, want["keys"], atol=ATOL).item()
        assert mx.allclose(self.seeds[0], want["seed"], atol=ATOL).item()
        got = original(self, rows, max_drafts)[0]
        assert mx.argmax(drafter.logits(want["seed"]), axis=-1).item() == got.tokens[0].item()
        seen["rounds"] += 1
        g = state.generated
        return [Proposal(forced(next(plan, "full"), ref[g:g + len(got.tokens)]))]

    monkeypatch.setattr(HeadBatch, "propose", propose)
    result = host.generate(target, prompt, no_stop(40))
    assert result.tokens == ref
    stats = result.report["speculative"]
    assert stats.fallback is None and seen["rounds"] == stats.rounds
    assert min(stats.rounds_by_acceptance.values()) >= 2, stats.rounds_by_acceptance


def test_a_batch_of_eight(models: Dict[str, Path]) -> None:
    host = make_host({"draft_model": str(models["target"]), "block_size": BLOCK})
    target = host.load(str(models["target"]))
    requests = [(encode(target, PROMPTS[i * 2 + 1]), 14 + 4 * i) for i in range(8)]
    refs = [greedy_reference(target.model, p, n) for p, n in requests]
    att = target.attachments["speculative"]
    log: Dict[str, List[Any]] = {"forwards": [], "accepted": []}
    att.drafter = WatchedDrafter(att.drafter, log, {tuple(p): r for (p, _), r in zip(requests, refs)})
    assert _run_batch(host, target, requests) == refs
    assert max(len(a) for a in log["accepted"]) >= 4 and any(len(set(a)) > 1 for a in log["accepted"])
    flat = [x for a in log["accepted"] for x in a]
    assert 0 in flat and max(flat) == BLOCK - 1 and any(0 < x < BLOCK - 1 for x in flat)
