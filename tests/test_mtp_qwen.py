"""The Qwen3.5 / Qwen3-Next MTP head (family qwen3_5_mtp): layouts, kind resolution, exact rounds.

Tiny targets in the Hugging Face layout carry their random ``mtp.*`` head in their own shards (two
shard files and an index); the head is also split out as mlx-vlm's ``split_mtp`` writes it. Rounds
are forced to zero, partial and full acceptance (the head really runs; its proposals are replaced by
the target's continuation, corrupted at a chosen position) and the head's KV cache and its output at
the last entry are compared after every round with a from-scratch recomputation over the committed
tokens. A batch of eight rows accepts different counts in the same step.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from conftest import PROMPTS, encode, greedy_reference, make_host, no_stop, seeded_rounds
from mlx_speculative.drafters import registry
from mlx_speculative.drafters.base import DraftTarget, Proposal
from mlx_speculative.drafters.mtp import qwen, tiny
from mlx_speculative.drafters.mtp.batch import Depth, HeadBatch
from mlx_speculative.hooks import taps
from mlx_speculative.hooks.kv_view import committed_kv
from test_engine_batch import WatchedDrafter, _run_batch

pytestmark = pytest.mark.integration

PROMPT = "the cache layer block round target fast slow small large"
BLOCK = 4  # pinned: 3 draft tokens per round, the head applied recursively beyond its depth of 1
PLAN = ["zero", "full", "partial", "full", "zero", "partial", "full", "zero", "partial"]
ATOL = 1e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Dict[str, Path]:
    root = tmp_path_factory.mktemp("mtp_qwen")
    out = {
        "qwen3_5": tiny.write_qwen_target(root / "qwen3_5", tiny.qwen3_5_config(), seed=61, tokenizer_dir=tokenizer_dir),
        "qwen3_next": tiny.write_qwen_target(root / "qwen3_next", tiny.qwen3_next_config(), seed=62,
                                             tokenizer_dir=tokenizer_dir),
    }
    out["split"] = tiny.split_qwen_head(out["qwen3_5"], root / "split")
    out["converted"] = tiny.write_qwen_target(root / "converted", tiny.qwen3_5_config(), seed=61,
                                              tokenizer_dir=tokenizer_dir, head=False, shards=1)
    out["small"] = tiny.write_qwen_target(root / "small", tiny.qwen3_5_config(num_hidden_layers=2), seed=63,
                                          tokenizer_dir=tokenizer_dir, head=False, shards=1)
    return out


def test_layouts_resolve_to_mtp_with_kind_auto(models: Dict[str, Path]) -> None:
    for name in ("qwen3_5", "qwen3_next", "split"):
        resolution = registry.resolve(str(models[name]), "auto")
        assert (resolution.kind, resolution.family.name) == ("mtp", "qwen3_5_mtp"), name
    index = json.loads((models["qwen3_5"] / "model.safetensors.index.json").read_text())["weight_map"]
    assert {f for n, f in index.items() if n.startswith("mtp.")} == {"model-00002-of-00002.safetensors"}
    assert "mtp.fc.weight" in index and "mtp.layers.0.self_attn.q_proj.weight" in index
    split = json.loads((models["split"] / "config.json").read_text())
    assert split["model_type"] == "qwen3_5_mtp" and split["block_size"] == 3 and "text_config" in split


def test_mlx_lm_conversion_names_the_standalone_route(models: Dict[str, Path]) -> None:
    host = make_host({"draft_model": str(models["converted"])})
    with pytest.raises(Exception, match=r"mtp\.\*: none in .*mlx-lm's convert drops them.*split_mtp"):
        host.load(str(models["converted"]))
    # The original checkpoint serves a converted target; a headless Qwen3.5 is a plain draft LM.
    host = make_host({"draft_model": str(models["qwen3_5"])})
    assert host.load(str(models["converted"])).attachments["speculative"].drafter.kind == "mtp"
    host = make_host({"draft_model": str(models["small"]), "kind": "draft_model"})
    assert host.load(str(models["qwen3_5"])).attachments["speculative"].drafter.kind == "draft_model"


def test_check_explains_field_by_field(models: Dict[str, Path]) -> None:
    config = json.loads((models["qwen3_5"] / "config.json").read_text())
    other = tiny.qwen3_5_config(hidden_size=128, num_attention_heads=8)
    verdict = qwen.check(models["qwen3_5"], config, DraftTarget(config=other, path=None))
    assert not verdict.ok and any("text_config.hidden_size: the head has 64, the target has 128" in r for r in verdict.reasons)
    deep = dict(config, text_config=dict(config["text_config"], mtp_num_hidden_layers=2))
    verdict = qwen.check(None, deep, DraftTarget(config=config, path=None))
    assert any("mtp_num_hidden_layers: 2; supported: 1" in r for r in verdict.reasons)
    verdict = qwen.check(models["qwen3_5"], config, DraftTarget(config=config, path=models["qwen3_5"]))
    assert verdict.ok and any("mtp.*: 15 tensors" in n for n in verdict.notes), verdict.notes
    verdict = qwen.check(None, config, DraftTarget(config=tiny.qwen3_next_config(), path=None))
    assert any("target model_type: 'qwen3_next'" in r for r in verdict.reasons)


def scratch(target: Any, drafter: Any, tokens: List[int]) -> Dict[str, mx.array]:
    """The head's cache and last output for ``tokens`` (pending last) from one fresh forward of each."""
    layer = drafter.hidden_layer
    taps.install_taps(target.model, [layer])
    with taps.record([layer]) as rec:
        target.model(mx.array([tokens[:-1]], dtype=mx.uint32), cache=make_prompt_cache(target.model))
    hidden = drafter.final_norm(rec[layer][0])  # [1, P, H]: the target's final hidden states
    cache = drafter.make_cache()
    out = drafter.model(drafter.embed(mx.array([tokens[1:]], dtype=mx.uint32)), hidden, cache)
    view = committed_kv(cache[0])
    return {"keys": view.keys, "values": view.values, "seed": out[:, -1:]}


def forced(case: str, truth: List[int], vocab: int = 384) -> List[int]:
    j = {"zero": 0, "partial": 1, "full": len(truth)}[case]
    drafts = list(truth)
    if j < len(truth):
        drafts[j] = (truth[j] + 1) % vocab
    return drafts


def forced_rounds_are_exact(host: Any, target: Any, prompt: List[int], monkeypatch: pytest.MonkeyPatch,
                            check_context: bool = False) -> None:
    """Zero, partial and full acceptance forced (PLAN) through a head's own proposals; before every round
    the head's KV cache and seed equal a from-scratch recomputation; the output equals plain decoding."""
    drafter = target.attachments["speculative"].drafter
    ref = greedy_reference(target.model, prompt, 60)
    plan, seen = iter(PLAN), {"rounds": 0}
    original = HeadBatch.propose

    def propose(self: HeadBatch, rows: List[Any], max_drafts: List[int]) -> List[Proposal]:
        (state,) = rows
        want = scratch(target, drafter, state.tokens)
        if check_context:
            assert self.context == [len(state.tokens) - 1]
        view = committed_kv(self.cache[0])
        assert view.keys.shape == want["keys"].shape and mx.allclose(view.keys, want["keys"], atol=ATOL).item()
        assert mx.allclose(view.values, want["values"], atol=ATOL).item()
        assert mx.allclose(self.seeds[0], want["seed"], atol=ATOL).item()
        got = original(self, rows, max_drafts)[0]
        assert mx.argmax(drafter.logits(want["seed"]), axis=-1).item() == got.tokens[0].item()  # the first draft
        seen["rounds"] += 1
        g = state.generated
        return [Proposal(forced(next(plan, "full"), ref[g:g + len(got.tokens)]))]

    monkeypatch.setattr(HeadBatch, "propose", propose)
    result = host.generate(target, prompt, no_stop(60))
    assert result.tokens == ref
    stats = result.report["speculative"]
    assert stats.fallback is None and seen["rounds"] == stats.rounds >= len(PLAN)
    assert stats.rounds_by_acceptance["zero"] >= 3 and stats.rounds_by_acceptance["partial"] >= 3
    assert stats.rounds_by_acceptance["full"] >= 3


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_next", "split"])
def test_forced_acceptance_is_exact_and_the_head_cache_is_recomputed(
    name: str, models: Dict[str, Path], monkeypatch: pytest.MonkeyPatch,
) -> None:
    target_dir = models["qwen3_5" if name == "split" else name]
    host = make_host({"draft_model": str(models[name]), "block_size": BLOCK})
    target = host.load(str(target_dir))
    drafter = target.attachments["speculative"].drafter
    assert (drafter.kind, drafter.default_block_size) == ("mtp", 3 if name == "split" else 2)
    forced_rounds_are_exact(host, target, encode(target, PROMPT), monkeypatch, check_context=True)


def batch_of_eight_is_exact(target_dir: str, head_dir: str) -> Dict[str, List[Any]]:
    """8 rows of different prompts and lengths decode as plain decoding does, accepting different counts in
    one step (zero, partial and full among them); returns the watched drafter's log."""
    host = make_host({"draft_model": head_dir, "block_size": BLOCK})
    target = host.load(target_dir)
    requests = [(encode(target, PROMPTS[i * 2 + 1]), 14 + 5 * i) for i in range(8)]
    refs = [greedy_reference(target.model, p, n) for p, n in requests]
    att = target.attachments["speculative"]
    log: Dict[str, List[Any]] = {"forwards": [], "accepted": []}
    att.drafter = WatchedDrafter(att.drafter, log, {tuple(p): r for (p, _), r in zip(requests, refs)})
    assert _run_batch(host, target, requests) == refs
    assert max(len(a) for a in log["accepted"]) >= 4
    assert any(len(set(a)) > 1 for a in log["accepted"])
    flat = [x for a in log["accepted"] for x in a]
    assert 0 in flat and max(flat) == BLOCK - 1 and any(0 < x < BLOCK - 1 for x in flat)
    return log


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_next"])
def test_a_batch_of_eight_accepts_different_counts_in_one_step(name: str, models: Dict[str, Path]) -> None:
    log = batch_of_eight_is_exact(str(models[name]), str(models[name]))
    # One head forward per draft step for every row: prepare's (the first draft), then one per deeper draft
    # (one in all once the depth controller stops recursing for every row).
    assert all(f in (1, k) for f, k, b in log["forwards"][1:]) and any(f == k and b > 1 for f, k, b in log["forwards"])


def test_depth_stops_recursing_while_it_does_not_pay() -> None:
    depth = Depth(trained=1)
    assert depth.allowed(3) == 3
    for _ in range(8):
        depth.record(1, 3)  # the recursive drafts are never accepted
    assert depth.capped and depth.allowed(3) == 1 and depth.allowed(1) == 1
    for _ in range(8):
        depth.record(1, 1)  # the head's own depth is always accepted: try recursing again
    assert not depth.capped and depth.allowed(3) == 3
    for _ in range(8):
        depth.record(2, 3)
    assert not depth.capped


def test_seeded_sampling_is_one_token_decoding(models: Dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    # The head's recursive steps draw at offsets 0, 1, 2 of the block.
    host = make_host({"draft_model": str(models["qwen3_5"]), "block_size": BLOCK})
    target = host.load(str(models["qwen3_5"]))
    rounds = seeded_rounds(host, target, encode(target, PROMPT), 30, 7, monkeypatch)
    assert rounds["zero"] > 0, rounds
