"""DFlash round loop, one round at a time, with forced zero, partial and full acceptance.

Proposals are overridden with the target's known greedy continuation (corrupted at a chosen
position), after the drafter has really run. After every round the captured hidden states and the
drafter's context cache are compared with a from-scratch recomputation over the committed tokens,
and the drafter's own block logits with a from-scratch drafter forward.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from conftest import encode, greedy_reference, make_host, no_stop, seeded_rounds
from mlx_speculative.drafters.base import Proposal
from mlx_speculative.drafters.dflash import DFlashBatch, DFlashDrafter, tiny
from mlx_speculative.drafters.dflash.features import target_features
from mlx_speculative.hooks import taps
from mlx_speculative.testing import tiny_models as tm
from mlx_speculative.hooks.api import draft_backend
from mlx_speculative.plugin.cuda.backend import PaddedKVCache, ShapeStablePolicy
from mlx_speculative.plugin.cuda.compiled import CompiledForward

pytestmark = pytest.mark.integration

FIXTURES = Path(__file__).parent / "fixtures" / "dflash"
PROMPT = "the cache layer block round target fast slow small large"
BLOCK = 6  # pinned: 5 draft tokens per round
PLAN = ["zero", "full", "partial", "full", "zero", "partial", "partial", "full", "zero"]
ATOL = 1e-4  # fp32: chunked and one-shot forwards differ in summation order only

def qwen3_5_config() -> Dict[str, Any]:
    text = dict(
        model_type="qwen3_5_text", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=384, rms_norm_eps=1e-6,
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, full_attention_interval=2, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [2, 1, 1]},
    )
    return {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": text,
            "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Dict[str, Path]:
    import json

    root = tmp_path_factory.mktemp("dflash_rounds")
    out = {
        "llama": tm.make_checkpoint(root / "llama", tm.llama_config(num_hidden_layers=4), seed=21,
                                    tokenizer_dir=tokenizer_dir, logit_scale=3.0, quiet_layers_from=2),
        "qwen3": tm.make_checkpoint(root / "qwen3", tm.qwen3_config(num_hidden_layers=4, tie_word_embeddings=True),
                                    seed=22, tokenizer_dir=tokenizer_dir, logit_scale=3.0, quiet_layers_from=2),
        "qwen3_5": tm.make_checkpoint(root / "qwen3_5", qwen3_5_config(), seed=23, tokenizer_dir=tokenizer_dir,
                                      logit_scale=3.0),
    }
    # Nested Qwen3.5-4B-DFlash format; layer 0 slides over 8 positions, so the window mask is used.
    real = json.loads((FIXTURES / "z-lab__Qwen3.5-4B-DFlash.config.json").read_text())
    config = tiny.shrink_config(real, target_layer_ids=[0, 1, 3], mask_token_id=383, num_target_layers=4)
    out["drafter"] = tiny.write_checkpoint(root / "drafter", config, seed=24)
    return out


def scratch_hidden(model: Any, tokens: List[int], layers: List[int]) -> Dict[int, mx.array]:
    """Outputs of ``layers`` for ``tokens`` from one fresh forward: {layer: [1, N, H]}."""
    taps.install_taps(model, layers)
    with taps.record(layers) as rec:
        model(mx.array([tokens], dtype=mx.uint32), cache=make_prompt_cache(model))
    return {i: v[0] for i, v in rec.items()}


def concat(hidden: Dict[int, mx.array], layers: List[int], end: int, final_norm: Any = None) -> mx.array:
    """The drafter's input: the layers' states side by side; HF's last hidden state is after the norm."""
    parts = [hidden[i][:, :end] for i in layers]
    if final_norm is not None:
        parts = [final_norm[1](h) if i == final_norm[0] else h for i, h in zip(layers, parts)]
    return mx.concatenate(parts, axis=-1)  # [1, end, taps*H]


def forced_tokens(case: str, truth: List[int], vocab: int) -> tuple[List[int], int]:
    """(drafts, expected accepted): the truth corrupted at position 0 (zero), 2 (partial) or nowhere."""
    j = {"zero": 0, "partial": 2, "full": len(truth)}[case]
    drafts = list(truth)
    if j < len(truth):
        drafts[j] = (truth[j] + 1) % vocab
    return drafts, j


def run_plan(models: Dict[str, Path], arch: str, monkeypatch: pytest.MonkeyPatch, bucket: Optional[int] = None,
             compiled: bool = False) -> Dict[str, Any]:
    host = make_host({"draft_model": str(models["drafter"]), "block_size": BLOCK})
    target = host.load(str(models[arch]))
    drafter = target.attachments["speculative"].drafter
    policy = ShapeStablePolicy(bucket or 8, prewarm_tokens=0)
    if bucket:  # padded context caches and power-of-two blocks (CUDA's default backend), small buckets
        drafter.backend = draft_backend(policy)
    if compiled:  # and the backend's compiled calls: the target's verify, the drafter's block and appends
        policy.forward = drafter.compiler = CompiledForward(PaddedKVCache, grow=16)
        target.cache_policy = policy  # the requests' caches padded, their verify forwards compiled
    layers = drafter.capture_layers()
    prompt = encode(target, PROMPT)
    ref = greedy_reference(target.model, prompt, 80)
    vocab = 384
    plan = iter(PLAN)
    seen: Dict[str, Any] = {"rounds": 0, "compiled": drafter.compiler}
    original = DFlashBatch.propose
    heads: List[mx.array] = []  # the drafter's logits per round (greedy proposals carry no q)
    head = drafter.head
    if not compiled:  # compiled, a round's block, head and argmax are one call: its tokens only
        drafter.head = lambda h: heads.append(head(h)) or heads[-1]

    def propose(self: DFlashBatch, rows: List[Any], max_drafts: List[int]) -> List[Proposal]:
        (state,), (k,) = rows, max_drafts
        proposal = original(self, rows, max_drafts)[0]
        assert proposal.logprobs is None  # greedy: tokens only
        # The context holds exactly the committed positions, and the drafter's incremental forward
        # equals a from-scratch one over all of them.
        start = len(state.tokens) - 1
        assert self.context == [start]
        hidden = scratch_hidden(target.model, state.tokens[:-1], layers)
        feats = target_features({i: hidden[i][:, :start] for i in layers}, layers, drafter.final_norm)
        context = drafter.model.context_states(feats)  # [1, start, H]
        for layer, cache in zip(drafter.model.layers, self.cache):
            k_ref, v_ref = layer.self_attn.keys_values(context, 0)
            keys, values = cache.keys_and_values()
            assert cache.offset == start and keys.shape[2] == (-(-start // bucket) * bucket if bucket else start)
            assert mx.allclose(keys[..., :start, :], k_ref, atol=ATOL).item()
            assert mx.allclose(values[..., :start, :], v_ref, atol=ATOL).item()
        scratch = drafter.model.make_cache()
        drafter.model.append_context(feats, scratch)
        block = mx.array([[state.pending] + [drafter.mask_token_id] * k], dtype=mx.uint32)
        logits = drafter.head(drafter.model(drafter.embed(block), scratch)[:, 1:])[0]
        expect = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if not compiled:
            got = heads[-1][0].astype(mx.float32)
            assert mx.allclose(got - mx.logsumexp(got, axis=-1, keepdims=True), expect, atol=ATOL).item()
        assert proposal.tokens.tolist() == mx.argmax(expect, axis=-1).tolist()
        seen["rounds"] += 1
        seen["ahead_used"] = self.ahead_used
        case = next(plan, "full")
        g = len(state.tokens) - len(prompt)
        tokens, _ = forced_tokens(case, ref[g: g + k], vocab)
        return [Proposal(tokens, None)]

    monkeypatch.setattr(DFlashBatch, "propose", propose)
    result = host.generate(target, prompt, no_stop(80))
    assert result.tokens == ref
    stats = result.report["speculative"]
    assert seen["rounds"] == stats.rounds >= len(PLAN)
    assert stats.rounds_by_acceptance["zero"] == 3 and stats.rounds_by_acceptance["partial"] == 3
    assert stats.rounds_by_acceptance["full"] >= 3
    assert set(stats.block_sizes) == {BLOCK}  # pinned
    return seen


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_5"])
def test_forced_acceptance_keeps_captures_and_context_exact(
    arch: str, models: Dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    run_plan(models, arch, monkeypatch)


def test_padded_context_cache_is_exact(models: Dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    run_plan(models, "llama", monkeypatch, bucket=8)  # crosses several buckets; padding masked out


def test_chunked_context_appends_are_exact(models: Dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt's context longer than a chunk goes in chunks and a power-of-two tail (the counts prewarm made)."""
    from mlx_speculative.drafters.dflash import batch as dflash_batch

    monkeypatch.setattr(dflash_batch, "CONTEXT_CHUNK", 4)
    sizes: List[int] = []
    append = dflash_batch.DFlashBatch._append
    monkeypatch.setattr(dflash_batch.DFlashBatch, "_append",
                        lambda self, caches, feats, counts: sizes.append(feats.shape[1]) or append(self, caches, feats, counts))
    appended: List[int] = []
    buffers: List[int] = []  # the first layer's buffer length before each append

    def append_context(self: DFlashDrafter, caches: List[Any], feats: mx.array, _orig=DFlashDrafter.append_context) -> None:
        appended.append(feats.shape[1])
        buffers.append(0 if caches[0].keys is None else caches[0].keys.shape[2])
        _orig(self, caches, feats)

    monkeypatch.setattr(DFlashDrafter, "append_context", append_context)
    run_plan(models, "llama", monkeypatch, bucket=8)
    n = sizes[0] // 4
    assert sizes[0] > 4 and appended[:n] == [4] * n, (sizes, appended)
    assert all(n <= 4 and n & (n - 1) == 0 for n in appended), appended
    # The first context's buffers grow once, after its first chunk, to the whole padded width (_reserve).
    width = -(-sizes[0] // 4) * 4
    assert buffers[0] == 0 and buffers[1:n] == [-(-width // 8) * 8] * (n - 1), (sizes, buffers[:n])


@pytest.mark.parametrize("ahead", ["on", "off"])
def test_compiled_calls_are_exact(ahead: str, models: Dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """The same plan with the policy's compiled calls (plugin/cuda/compiled.py): padded target caches and compiled
    verify forwards, the drafter's block and context appends compiled, buffers grown in steps of 16. Drafting
    ahead (the default there), every round after the first drafts its block during the round before, from
    the device's outcome: the checks above then see that block and the context it kept."""
    monkeypatch.setenv("MLX_SPEC_DRAFT_AHEAD", ahead)
    seen = run_plan(models, "llama", monkeypatch, bucket=8, compiled=True)
    fwd = seen["compiled"]
    blocks = fwd.counts["compiled dflash draft"] + fwd.counts["compiled dflash draft ahead"]
    assert fwd.counts["compiled"] >= len(PLAN) and blocks >= seen["rounds"], fwd.counts
    assert fwd.counts["compiled dflash context"] + fwd.counts["compiled dflash draft ahead"] > 0 and not fwd.failed
    if ahead == "on":  # the first round's block, and the one after the prompt's catch-up, drafted in place
        assert seen["ahead_used"] == seen["rounds"] - 1 == fwd.counts["compiled dflash draft ahead"] - 1, fwd.counts
    else:
        assert seen["ahead_used"] == 0 and fwd.counts["compiled dflash draft ahead"] == 0, fwd.counts


def test_drafter_failure_rolls_back_and_falls_back(models: Dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    host = make_host({"draft_model": str(models["drafter"]), "block_size": BLOCK})
    target = host.load(str(models["llama"]))
    prompt = encode(target, PROMPT)
    ref = greedy_reference(target.model, prompt, 30)
    original = DFlashBatch.propose
    calls = {"n": 0}

    def propose(self: DFlashBatch, rows: List[Any], max_drafts: List[int]) -> List[Proposal]:
        calls["n"] += 1
        proposal = original(self, rows, max_drafts)  # the drafter ran, then fails
        if calls["n"] == 3:
            raise RuntimeError("drafter broke")
        return proposal

    monkeypatch.setattr(DFlashBatch, "propose", propose)
    holder: List[Any] = []
    tokens = [e.token for e in host.stream(target, prompt, no_stop(30), state_out=holder)]
    assert tokens == ref  # nothing lost or repeated: the round was rolled back, plain decoding after
    req = holder[0].extras["speculative"]
    assert calls["n"] == 3 and "drafter broke" in req.stats.fallback and req.stats.rounds == 2


def test_tied_and_untied_heads_are_the_targets(models: Dict[str, Path]) -> None:
    for arch, tied in (("llama", False), ("qwen3", True)):
        target = make_host({"draft_model": str(models["drafter"])}).load(str(models[arch]))
        drafter = target.attachments["speculative"].drafter
        assert drafter.embed is target.model.model.embed_tokens
        if tied:
            assert drafter.head == target.model.model.embed_tokens.as_linear
        else:
            assert drafter.head is target.model.lm_head


def test_last_layer_tap_is_taken_after_the_final_norm(models: Dict[str, Path], tmp_path: Path) -> None:
    import json

    real = json.loads((FIXTURES / "z-lab__Qwen3-4B-DFlash-b16.config.json").read_text())
    config = tiny.shrink_config(real, target_layer_ids=[1, 3], mask_token_id=383, num_target_layers=4)
    host = make_host({"draft_model": str(tiny.write_checkpoint(tmp_path / "last", config)), "block_size": BLOCK})
    target = host.load(str(models["llama"]))
    drafter = target.attachments["speculative"].drafter
    assert drafter.final_norm is not None and drafter.final_norm[0] == 3
    prompt = encode(target, PROMPT)
    raw = scratch_hidden(target.model, prompt, [1, 3])
    hidden = target_features(raw, [1, 3], drafter.final_norm)  # [1, n, 2*H]: what the drafter reads
    assert mx.allclose(hidden[..., :64], raw[1], atol=ATOL).item()
    assert mx.allclose(hidden[..., 64:], target.model.model.norm(raw[3]), atol=ATOL).item()
    out = host.generate(target, prompt, no_stop(20))
    assert out.tokens == greedy_reference(target.model, prompt, 20)


def test_prewarm_runs_every_bucket_and_width(models: Dict[str, Path]) -> None:
    from mlx_speculative.drafters.dflash import prewarm

    target = make_host({"draft_model": str(models["drafter"])}).load(str(models["llama"]))
    drafter = target.attachments["speculative"].drafter
    assert not drafter.shape_stable and prewarm(drafter, 64, 16) == 0  # CPU: mlx-lm's caches, nothing to warm
    drafter.backend = draft_backend(ShapeStablePolicy(16, prewarm_tokens=0))
    # spans 16..64 x widths 2, 4, 8, 16, context counts 1, 2, 4 .. 512, and a batch's 32 block positions once
    assert prewarm(drafter, 64, 16) == 4 * 4 + 10 + 1
    assert prewarm(drafter, 50, 16) == 4 * 4 + 10 + 1  # 50 keys need the 64-key span too
    assert prewarm(drafter, 16, 16) == 4 + 10  # no span holds 32 positions: none warmed


@pytest.mark.parametrize("ahead", [False, True])
def test_staged_draft_equals_one_graph(ahead: bool, models: Dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """``DFlashDrafter.draft`` queues its context writes and layers one by one (``staged``); the same compiled
    call as one graph gives bit-equal drafts and cache buffers, in place and drafting ahead."""
    host = make_host({"draft_model": str(models["drafter"]), "block_size": BLOCK})
    drafter = host.load(str(models["llama"])).attachments["speculative"].drafter
    drafter.backend = draft_backend(ShapeStablePolicy(8, prewarm_tokens=0))
    drafter.compiler = CompiledForward(PaddedKVCache, grow=16)
    taps = len(drafter.args.target_layer_ids) * drafter.args.hidden_size
    mx.random.seed(5)
    context, feats = mx.random.normal((1, 11, taps)), mx.random.normal((1, BLOCK, taps))
    tokens = mx.array([[7] + [383] * (BLOCK - 1)], dtype=mx.uint32)
    got = {}
    for staged in (True, False):
        monkeypatch.setattr(DFlashDrafter, "staged", staged)
        caches = drafter.make_cache()
        drafter.append_context(caches, context)
        rest = (None, feats, mx.array(4)) if ahead else ()
        drafts = drafter.draft(caches, tokens, *rest)
        assert drafts is not None and drafts.shape == (1, BLOCK - 1)
        mx.eval(drafts, [c.keys for c in caches])
        got[staged] = (drafts, [(c.keys, c.values, c.offset) for c in caches])
    (drafts, cached), (plain, expected) = got[True], got[False]
    assert drafts.tolist() == plain.tolist()
    for (k, v, o), (k0, v0, o0) in zip(cached, expected):
        assert o == o0 == 11 and mx.array_equal(k, k0) and mx.array_equal(v, v0)
    counts = drafter.compiler.counts
    assert counts["compiled dflash draft" + (" ahead" if ahead else "")] == 2 and not drafter.compiler.failed, counts


@pytest.mark.parametrize("bucket", [None, 16])
def test_batched_contexts_are_exact(bucket: Optional[int], models: Dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows of a batch accepting different counts: each round's committed positions go into every row's context in
    one append, taken from the round's verify outputs at once (``DFlashBatch._batched_features``), and each row's
    context equals a from-scratch one after every round (mlx-lm's left-padded batch; rows at their own lengths)."""
    from mlx_speculative.hooks.kv_view import committed_kv
    from mlx_speculative.hooks.scheduler import Scheduler

    host = make_host({"draft_model": str(models["drafter"]), "block_size": BLOCK})
    target = host.load(str(models["llama"]))
    drafter = target.attachments["speculative"].drafter
    if bucket:
        target.cache_policy = ShapeStablePolicy(bucket, prewarm_tokens=0)
        drafter.backend = draft_backend(target.cache_policy)
    layers = drafter.capture_layers()
    words = PROMPT.split()
    prompts = [encode(target, " ".join(words[:n])) for n in (10, 4, 7)]
    refs = {tuple(p): greedy_reference(target.model, p, 30) for p in prompts}
    cases = iter(["zero", "partial", "full"] * 40)
    fast = [0]
    batched = DFlashBatch._batched_features
    monkeypatch.setattr(DFlashBatch, "_batched_features",
                        lambda self: (lambda got: fast.__setitem__(0, fast[0] + (got is not None)) or got)(batched(self)))
    original = DFlashBatch.propose

    def propose(self: DFlashBatch, rows: List[Any], max_drafts: List[int]) -> List[Proposal]:
        original(self, rows, max_drafts)
        out = []
        for b, (state, k) in enumerate(zip(rows, max_drafts)):
            start = len(state.tokens) - 1
            assert self.context[b] == start
            hidden = scratch_hidden(target.model, state.tokens[:-1], layers)
            feats = target_features({i: hidden[i][:, :start] for i in layers}, layers, drafter.final_norm)
            context = drafter.model.context_states(feats)  # [1, start, H]
            for layer, cache in zip(drafter.model.layers, self.cache):
                k_ref, _ = layer.self_attn.keys_values(context, 0)
                view = committed_kv(cache) if len(rows) > 1 else None
                if view is None:
                    keys = cache.keys[..., :start, :]
                else:
                    slots = [s for s, p in enumerate(view.positions[b].tolist()) if p >= 0]
                    assert [view.positions[b].tolist()[s] for s in slots] == list(range(start))
                    keys = view.keys[b : b + 1, :, mx.array(slots)]
                assert mx.allclose(keys, k_ref, atol=ATOL).item()
            ref = refs[tuple(state.tokens[: state.prompt_len])]
            g = len(state.tokens) - state.prompt_len
            out.append(Proposal(forced_tokens(next(cases), ref[g : g + k], 384)[0]) if k else Proposal([]))
        return out

    monkeypatch.setattr(DFlashBatch, "propose", propose)
    scheduler = Scheduler(host, target)
    submitted = [scheduler.submit(p, no_stop(30)) for p in prompts]
    got: Dict[int, List[int]] = {r.id: [] for r in submitted}
    while scheduler.busy:
        for request, event in scheduler.step():
            got[request.id].append(event.token)
    assert [got[r.id] for r in submitted] == [refs[tuple(p)] for p in prompts]
    assert fast[0] > 3  # the rounds' contexts appended for all rows at once


def test_seeded_sampling_is_one_token_decoding(models: Dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    # The block's k drafts drawn in one call at offsets 0..k-1, with the target's noise of those positions.
    host = make_host({"draft_model": str(models["drafter"]), "block_size": BLOCK})
    target = host.load(str(models["llama"]))
    rounds = seeded_rounds(host, target, encode(target, "the cache layer block round target"), 30, 5, monkeypatch)
    assert rounds["zero"] > 0, rounds
