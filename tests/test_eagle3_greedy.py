"""Greedy EAGLE-3 decoding equals plain decoding token for token (fp32, CPU) on llama, qwen3 and
qwen3_5 targets, for tiny drafters in each layout, with zero, partial and full acceptance forced;
the drafter's own proposals are target ids through d2t; a batch of 8 rows accepting different
counts in the same step, one drafter forward per draft step for all rows."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Dict, List

import mlx.core as mx
import pytest

from conftest import PROMPTS, encode, greedy_reference, make_host, no_stop, seeded_rounds
from mlx_speculative.drafters.base import Proposal
from mlx_speculative.drafters.eagle3 import Eagle3Batch, tiny
from mlx_speculative.testing import tiny_models as tm
from test_engine_batch import ROWS, WatchedDrafter, _requests, _run_batch

pytestmark = pytest.mark.integration

FIXTURES = Path(__file__).parent / "fixtures" / "eagle3"
LAYOUTS = {  # real config, layer ids for a 4-layer target (None: the default)
    "eagle": ("SafeAILab__EAGLE__traineagle3", None),
    "specforge": ("sgl-project__SpecForge__llama3-8B-eagle3", [0, 1, 3]),
    "speculators": ("speculators-issue-1065__eagle3-qwen3moe", [1, 2, 4]),
}
ARCHS = ["llama", "qwen3", "qwen3_5"]
BLOCK = 6
_REFERENCE: Dict[tuple, List[int]] = {}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Dict[str, Path]:
    root = tmp_path_factory.mktemp("eagle3_greedy")
    out = {
        "llama": tm.make_checkpoint(root / "llama", tm.llama_config(num_hidden_layers=4), seed=31,
                                    tokenizer_dir=tokenizer_dir, logit_scale=3.0, quiet_layers_from=2),
        "qwen3": tm.make_checkpoint(root / "qwen3", tm.qwen3_config(num_hidden_layers=4, tie_word_embeddings=True),
                                    seed=32, tokenizer_dir=tokenizer_dir, logit_scale=3.0, quiet_layers_from=2),
        "qwen3_5": tm.make_checkpoint(root / "qwen3_5", tm.qwen3_5_config(), seed=33, tokenizer_dir=tokenizer_dir,
                                      logit_scale=3.0, quiet_layers_from=2),
    }
    for layout, (name, ids) in LAYOUTS.items():
        real = json.loads((FIXTURES / f"{name}.config.json").read_text())
        out[layout] = tiny.write_checkpoint(root / layout, tiny.shrink_config(real, layer_ids=ids), seed=34)
    return out


class Oracle:
    """After the drafter ran: records its own proposals, then replaces them by the target's greedy
    continuation, corrupted at a random position in some rounds (zero, partial and full rounds)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, seed: int = 0):
        self.rng = random.Random(seed)
        self.ref: List[int] = []
        self.prompt_len = 0
        self.own: List[int] = []
        original = Eagle3Batch.propose
        oracle = self

        def propose(batch: Eagle3Batch, rows: List[Any], max_drafts: List[int]) -> List[Proposal]:
            d = batch.drafter
            raw = mx.argmax(d.model.logits(batch.last[:, 0]), axis=-1).tolist()  # the first draft, as a draft id
            out = []
            for b, (state, proposal, m) in enumerate(zip(rows, original(batch, rows, max_drafts), max_drafts)):
                own = proposal.tokens.tolist() if isinstance(proposal.tokens, mx.array) else list(proposal.tokens)
                if not own:  # nothing to draft from yet (no captured position)
                    out.append(proposal)
                    continue
                oracle.own.append((raw[b], own[0]))
                g = len(state.tokens) - oracle.prompt_len
                drafts = list(oracle.ref[g: g + m])
                drafts += own[len(drafts):]  # past the reference's end: the drafter's own
                case = oracle.rng.choice(["zero", "partial", "full"])
                if case != "full":
                    j = 0 if case == "zero" else oracle.rng.randrange(len(drafts))
                    drafts[j] = (drafts[j] + 1) % 384
                out.append(Proposal(drafts, proposal.logprobs))
            return out

        monkeypatch.setattr(Eagle3Batch, "propose", propose)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_plain_with_zero_partial_full(arch: str, layout: str, models: Dict[str, Path],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    oracle = Oracle(monkeypatch, seed=ARCHS.index(arch) * 3 + list(LAYOUTS).index(layout))
    host = make_host({"draft_model": str(models[layout]), "kind": "auto", "block_size": BLOCK})
    target = host.load(str(models[arch]))
    drafter = target.attachments["speculative"].drafter
    assert drafter.kind == "eagle3"
    plain = make_host(None, plugins=False)
    totals = {"zero": 0, "partial": 0, "full": 0}
    for text, n in ((PROMPTS[0], 1), (PROMPTS[1], 30), (PROMPTS[4], 30)):
        prompt = encode(target, text)
        key = (arch, text, n)
        if key not in _REFERENCE:  # the same for every layout: computed once per target
            _REFERENCE[key] = greedy_reference(target.model, prompt, n)
            assert plain.generate(target, prompt, no_stop(n)).tokens == _REFERENCE[key]
        oracle.ref, oracle.prompt_len = _REFERENCE[key], len(prompt)
        result = host.generate(target, prompt, no_stop(n))
        assert result.tokens == _REFERENCE[key], (text, n)
        stats = result.report.get("speculative")
        if n > 1:
            assert stats is not None and stats.kind == "eagle3" and stats.fallback is None
            for k, v in stats.rounds_by_acceptance.items():
                totals[k] += v
    assert all(v > 0 for v in totals.values()), totals
    # The drafter's own drafts are target ids: draft id d proposes d + d2t[d].
    d2t = (mx.array(drafter.targets) - mx.arange(256)).tolist()
    assert oracle.own and all(token == d + d2t[d] for d, token in oracle.own), oracle.own[:8]
    assert any(token != d for d, token in oracle.own)


@pytest.mark.parametrize("arch, padded", [("llama", False), ("qwen3_5", False), ("llama", True)])
def test_a_batch_of_eight_accepting_different_counts(arch: str, padded: bool, models: Dict[str, Path],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    if padded:  # CUDA's shape-stable caches: padded keys, power-of-two catch-up widths, pre-warmed
        monkeypatch.setenv("MLX_SPEC_PADDED_CACHE", "on")
        monkeypatch.setenv("MLX_SPEC_PREWARM_TOKENS", "256")
    host = make_host({"draft_model": str(models["specforge"]), "block_size": BLOCK})
    target = host.load(str(models[arch]))
    requests = _requests(target)
    refs = [greedy_reference(target.model, p, n) for p, n in requests]
    att = target.attachments["speculative"]
    assert att.drafter.kind == "eagle3" and att.drafter.shape_stable == padded
    log: Dict[str, List[Any]] = {"forwards": [], "accepted": []}
    att.drafter = WatchedDrafter(att.drafter, log, {tuple(p): r for (p, _), r in zip(requests, refs)})
    assert _run_batch(host, target, requests) == refs
    assert max(len(a) for a in log["accepted"]) >= ROWS // 2
    assert any(len(set(a)) > 1 for a in log["accepted"])  # rows accept different counts in the same step
    flat = [x for a in log["accepted"] for x in a]
    assert 0 in flat and max(flat) == BLOCK - 1 and any(0 < x < BLOCK - 1 for x in flat)  # zero, partial, full
    # One drafter forward per draft step for all rows: the catch-up (draft 1) and k - 1 chain
    # steps; k - 1 when every row's catch-up was its prompt, fed alone as it joined.
    assert all(k - 1 <= f <= k for f, k, _ in log["forwards"]), log["forwards"]
    assert any(f == k and b >= ROWS // 2 for f, k, b in log["forwards"]), str(log["forwards"])


def test_bench_runs_a_synthetic_eagle3_drafter(tmp_path: Path) -> None:
    from mlx_speculative.hooks.cli import main

    out = tmp_path / "bench.json"
    assert main(["bench", "--synthetic-target", "tiny", "--cpu", "--kind", "eagle3", "--oracle-acceptance", "3",
                 "--block-sizes", "4", "--prompt-lengths", "64,100", "--max-tokens", "12", "--no-mlx-lm-spec",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert "draft vocabulary 384" in report["drafters"]["eagle3"]  # the tiny target's whole vocabulary (32k on real ones)
    for regime in ("fresh", "warm"):
        spec = report["results"][regime]["plugin eagle3 b4 tau3"]
        assert spec["identical_share"] == 1.0 and 1.5 < spec["tau"] <= 4 and spec["rounds"] > 0
    assert set(report["kernel_costs"]["draft_ms"]["eagle3"]) == {"4"}


@pytest.mark.parametrize("layout", list(LAYOUTS)[:1])
def test_seeded_sampling_is_one_token_decoding(layout: str, models: Dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    # q over the target's vocabulary (zero outside the draft vocabulary) takes the target's noise per position.
    host = make_host({"draft_model": str(models[layout]), "kind": "auto", "block_size": BLOCK})
    target = host.load(str(models["llama"]))
    rounds = seeded_rounds(host, target, encode(target, PROMPTS[1]), 30, 6, monkeypatch)
    assert rounds["zero"] > 0, rounds
