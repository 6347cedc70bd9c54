"""The Gemma 4 assistant (family gemma4_assistant): shared K/V, exact rounds, the sparse head.

A tiny gemma4_text target (per-layer inputs, KV-shared layers, sliding windows of 8 positions that
the prompts outgrow) and tiny assistants made from google/gemma-4-E2B-it-assistant's config.json
(its field and tensor names, tiny sizes): the centroid-routed sparse head and the tied dense one.
After every round the K/V the assistant attended over equal the K/V a fresh forward of the target
writes for the committed tokens (alone and in a batch of eight whose rows accept different counts),
and its first draft equals a from-scratch assistant forward over those K/V.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from conftest import PROMPTS, encode, greedy_reference, make_host, no_stop, seeded_rounds
from mlx_speculative.drafters import registry
from mlx_speculative.drafters.base import DraftTarget, Proposal
from mlx_speculative.drafters.mtp import gemma, tiny
from mlx_speculative.drafters.mtp.assistant import AssistantBatch, masks
from mlx_speculative.drafters.mtp.batch import draw
from mlx_speculative.hooks import taps
from mlx_speculative.testing import tiny_models as tm
from mlx_speculative.hooks.kv_view import committed_kv
from mlx_speculative.hooks.state import KeyStream, SamplingParams
from test_engine_batch import WatchedDrafter, _run_batch
from test_sampling_stats import CAUGHT_P, PASS_P, chisquare

pytestmark = pytest.mark.integration

FIXTURES = Path(__file__).parent / "fixtures" / "mtp"
REAL = json.loads((FIXTURES / "google__gemma-4-E2B-it-assistant.config.json").read_text())
PROMPT = "the cache layer block round target fast slow small large one two three four"
BLOCK = 4
PLAN = ["zero", "full", "partial", "full", "zero", "partial", "full", "zero", "partial"]
ATOL = 1e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Dict[str, Path]:
    root = tmp_path_factory.mktemp("mtp_gemma")
    config = tiny.gemma4_text_config()
    out = {"target": tm.make_checkpoint(root / "target", config, seed=71, tokenizer_dir=tokenizer_dir, logit_scale=3.0)}
    out["sparse"] = tiny.write_assistant(root / "sparse", tiny.assistant_config(REAL, config), seed=72, tokenizer_dir=tokenizer_dir)
    out["dense"] = tiny.write_assistant(root / "dense", tiny.assistant_config(REAL, config, ordered=False), seed=73,
                                        tokenizer_dir=tokenizer_dir)
    return out


def test_assistants_resolve_to_mtp_with_kind_auto(models: Dict[str, Path]) -> None:
    for name in ("sparse", "dense"):
        resolution = registry.resolve(str(models[name]), "auto")
        assert (resolution.kind, resolution.family.name) == ("mtp", "gemma4_assistant")
    target = make_host({"draft_model": str(models["sparse"])}).load(str(models["target"]))
    drafter = target.attachments["speculative"].drafter
    # The last layer of each type that keeps its own K/V (layers 4 and 5 share theirs).
    assert drafter.kv_layers == {"sliding_attention": 3, "full_attention": 2} and drafter.default_block_size == 4


def test_check_explains_field_by_field(models: Dict[str, Path]) -> None:
    config = json.loads((models["sparse"] / "config.json").read_text())
    t = tiny.gemma4_text_config()
    target = lambda **over: DraftTarget(config=tiny.gemma4_text_config(**over))  # noqa: E731
    assert gemma.check(None, config, target()).ok
    verdict = gemma.check(None, config, target(hidden_size=128))
    assert any("backbone_hidden_size: the assistant has 64, the target's hidden_size is 128" in r for r in verdict.reasons)
    verdict = gemma.check(None, config, target(layer_types=["sliding_attention"] * 6))
    assert any("no layer of type ['full_attention'] with its own K/V" in r for r in verdict.reasons)
    verdict = gemma.check(None, config, target(global_head_dim=64))
    assert any("text_config.global_head_dim: the assistant has 32, the target 64" in r for r in verdict.reasons)
    verdict = gemma.check(None, config, target(sliding_window=16))
    assert any("text_config.sliding_window" in r for r in verdict.reasons)
    verdict = gemma.check(None, dict(config, num_centroids=25), DraftTarget(config=t))
    assert any("num_centroids / centroid_intermediate_top_k: 25 / 4" in r for r in verdict.reasons)
    verdict = gemma.check(None, config, DraftTarget(config=tm.llama_config()))
    assert any("target model_type: 'llama'" in r for r in verdict.reasons)


def reference(target: Any, drafter: Any, tokens: List[int]) -> Dict[str, Any]:
    """K/V of the assistant's layers and the final hidden state at P-1, from one fresh target forward
    over the committed tokens (``tokens`` ends with the pending one)."""
    layer = drafter.hidden_layer
    taps.install_taps(target.model, [layer])
    cache = make_prompt_cache(target.model)
    with taps.record([layer]) as rec:
        target.model(mx.array([tokens[:-1]], dtype=mx.uint32), cache=cache)
    views = {kind: committed_kv(cache[i]) for kind, i in drafter.kv_layers.items()}
    return {"views": views, "hidden": drafter.final_norm(rec[layer][0][:, -1:])}


def assert_same_kv(read: Any, ref: Any, row: int, pending: int, window: int) -> None:
    """Row ``row`` of the K/V read holds, slot for slot, the K/V the fresh forward wrote for its position,
    and every position the assistant's mask admits."""
    pos, want = np.array(read.positions[row]), np.array(ref.positions[0])
    keys, ref_keys = np.array(read.keys[row]), np.array(ref.keys[0])  # [n_kv, S, D]
    values, ref_values = np.array(read.values[row]), np.array(ref.values[0])
    where = {int(p): s for s, p in enumerate(want) if p >= 0}
    need = {p for p in range(pending) if not window or pending - p < window}
    assert need <= {int(p) for p in pos if p >= 0}, (sorted(need), pos)
    for s, p in enumerate(pos):
        if p in need:
            np.testing.assert_allclose(keys[:, s], ref_keys[:, where[int(p)]], atol=ATOL)
            np.testing.assert_allclose(values[:, s], ref_values[:, where[int(p)]], atol=ATOL)


def check_round(self: AssistantBatch, rows: List[Any], target: Any, drafter: Any, got: List[Proposal]) -> None:
    for b, row in enumerate(rows):
        if not len(got[b].tokens):
            continue  # nothing left to draft for this row
        ref = reference(target, drafter, row.tokens)
        P = len(row.tokens) - 1
        for kind, view in self.read.items():
            assert_same_kv(view, ref["views"][kind], b, P, drafter.window if kind == "sliding_attention" else 0)
        assert mx.allclose(self.hidden[id(row)], ref["hidden"], atol=ATOL).item()
        # The first draft from scratch: the reference K/V, the query at P.
        shared = {k: (v.keys, v.values) for k, v in ref["views"].items()}
        x = mx.concatenate([drafter.embed(mx.array([[row.pending]], dtype=mx.uint32)), ref["hidden"]], axis=-1)
        _, state = drafter.model(x, shared, masks(ref["views"], mx.array([P]), drafter.window), mx.array([P]))
        assert mx.argmax(drafter.model.logits(state)[0, 0]).item() == got[b].tokens[0].item()


def forced(case: str, truth: List[int], vocab: int = 384) -> List[int]:
    j = {"zero": 0, "partial": 1, "full": len(truth)}[case]
    drafts = list(truth)
    if j < len(truth):
        drafts[j] = (truth[j] + 1) % vocab
    return drafts


@pytest.mark.parametrize("head", ["sparse", "dense"])
def test_forced_acceptance_reads_the_committed_kv(head: str, models: Dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    host = make_host({"draft_model": str(models[head]), "block_size": BLOCK})
    target = host.load(str(models["target"]))
    drafter = target.attachments["speculative"].drafter
    prompt = encode(target, PROMPT)
    assert len(prompt) > 2 * drafter.window  # the sliding caches wrap
    ref = greedy_reference(target.model, prompt, 50)
    plan, seen = iter(PLAN), {"rounds": 0}
    original = AssistantBatch.propose

    def propose(self: AssistantBatch, rows: List[Any], max_drafts: List[int]) -> List[Proposal]:
        got = original(self, rows, max_drafts)
        check_round(self, rows, target, drafter, got)
        seen["rounds"] += 1
        g = rows[0].generated
        return [Proposal(forced(next(plan, "full"), ref[g:g + len(got[0].tokens)]))]

    monkeypatch.setattr(AssistantBatch, "propose", propose)
    result = host.generate(target, prompt, no_stop(50))
    assert result.tokens == ref
    stats = result.report["speculative"]
    assert stats.fallback is None and seen["rounds"] == stats.rounds >= len(PLAN)
    assert min(stats.rounds_by_acceptance.values()) >= 3, stats.rounds_by_acceptance


def test_a_batch_of_eight_reads_each_rows_kv(models: Dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    host = make_host({"draft_model": str(models["sparse"]), "block_size": BLOCK})
    target = host.load(str(models["target"]))
    drafter = target.attachments["speculative"].drafter
    requests = [(encode(target, PROMPTS[i * 2 + 1]), 40 + 2 * i) for i in range(8)]
    refs = [greedy_reference(target.model, p, n) for p, n in requests]
    original, checked = AssistantBatch.propose, {"rows": 0}

    def propose(self: AssistantBatch, rows: List[Any], max_drafts: List[int]) -> List[Proposal]:
        got = original(self, rows, max_drafts)
        check_round(self, rows, target, drafter, got)
        checked["rows"] = max(checked["rows"], len(rows))
        return got

    monkeypatch.setattr(AssistantBatch, "propose", propose)
    att = target.attachments["speculative"]
    log: Dict[str, List[Any]] = {"forwards": [], "accepted": []}
    att.drafter = WatchedDrafter(att.drafter, log, {tuple(p): r for (p, _), r in zip(requests, refs)})
    assert _run_batch(host, target, requests) == refs
    assert checked["rows"] == 8 and any(len(set(a)) > 1 for a in log["accepted"])
    flat = [x for a in log["accepted"] for x in a]
    assert 0 in flat and max(flat) == BLOCK - 1 and any(0 < x < BLOCK - 1 for x in flat)
    assert all(f == k for f, k, _ in log["forwards"])  # one assistant forward per draft step, all rows


def _sparse(models: Dict[str, Path]) -> Any:
    return make_host({"draft_model": str(models["sparse"])}).load(str(models["target"])).attachments["speculative"].drafter.model


def test_sparse_argmax_is_the_dense_argmax_over_the_selected_clusters(models: Dict[str, Path]) -> None:
    model = _sparse(models)
    mx.random.seed(5)
    state = mx.random.normal((64, model.text.hidden_size))  # [n, H]
    head = model.masked_embedding
    sparse = model.logits(state)  # [n, V]
    dense = model.dense_logits(state)
    ordering = np.array(head.token_ordering).reshape(head.num_centroids, head.per_cluster)
    clusters = np.array(head.clusters(state))  # [n, top_k]
    for i in range(state.shape[0]):
        allowed = np.zeros(dense.shape[-1], bool)
        allowed[ordering[clusters[i]].reshape(-1)] = True
        row = np.array(dense[i])
        assert np.isneginf(np.array(sparse[i])[~allowed]).all()
        np.testing.assert_allclose(np.array(sparse[i])[allowed], row[allowed], atol=1e-4)
        assert int(mx.argmax(sparse[i]).item()) == int(np.argmax(np.where(allowed, row, -np.inf)))
    assert (np.array(mx.argmax(sparse, -1)) != np.array(mx.argmax(dense, -1))).any()  # the restriction matters


class Row:
    def __init__(self, sampling: SamplingParams):
        self.sampling, self.stream = sampling, KeyStream(7, "drafter")

    def draw_drafts(self, logq: mx.array, offset: int = 0) -> mx.array:
        return mx.random.categorical(logq, axis=-1, key=self.stream.next())


@pytest.mark.statistical  # also in the statistical group: a chi-square test
@pytest.mark.parametrize("sampling", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.9)])
def test_sparse_q_is_what_the_drafter_samples_from(models: Dict[str, Path], sampling: SamplingParams) -> None:
    model = _sparse(models)
    mx.random.seed(9)
    state = mx.random.normal((1, model.text.hidden_size)) * 3
    logits = model.logits(state)  # [1, V]
    row = Row(sampling)
    draws, qs = [], []
    for _ in range(1200):  # 6,000 draws
        tokens, q = draw([row] * 5, mx.repeat(logits, 5, axis=0), 0)
        draws.append(tokens)
        qs.append(q[0])
    counts = np.bincount(np.array(mx.concatenate(draws)), minlength=logits.shape[-1])
    q = np.exp(np.array(qs[0], dtype=np.float64))
    assert abs(q.sum() - 1) < 1e-4 and (q[np.isneginf(np.array(logits[0]))] == 0).all()
    assert counts[q == 0].sum() == 0  # never outside the selected clusters
    assert chisquare(counts, q / q.sum())[2] > PASS_P
    # The control: the dense distribution (a sentinel-free approximation would sit in between) is rejected.
    dense = np.array(mx.softmax(sampling.process(model.dense_logits(state) - mx.logsumexp(model.dense_logits(state))), axis=-1)[0])
    assert chisquare(counts, dense.astype(np.float64) / dense.sum())[2] < CAUGHT_P


@pytest.mark.parametrize("head", ["sparse", "dense"])
def test_seeded_sampling_is_one_token_decoding(head: str, models: Dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    host = make_host({"draft_model": str(models[head]), "block_size": BLOCK})
    target = host.load(str(models["target"]))
    rounds = seeded_rounds(host, target, encode(target, PROMPT), 30, 8, monkeypatch)
    assert rounds["zero"] > 0, rounds
