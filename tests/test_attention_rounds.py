"""Greedy rounds with the attention routed through the dispatcher equal plain decoding, token for token.

The plugin hands the host its dispatcher inside the cache policy (``CachePolicy.attention``), as it does
on MLX-CUDA; here the CUDA kernel's place is taken by a stand-in with the same contract
(``cuda_attention.reference``, pure MLX) and the key thresholds are 0, so every 2..32-query call the
dispatcher can prove exact goes to the stand-in with the bounds it derived. Targets: llama, qwen3, qwen3_5
(GatedDeltaNet and attention layers: both scopes on one model), gemma3_text (sliding-window layers), the
projections routed through ``projections.stand_in()`` as well, with
padded caches (described array masks, batches with left padding) and with mlx-lm's caches ("causal"; batches
through ``DescribedBatchKVCache``, mlx-lm's with its masks described);
each request alone and all in one batch; draft models (routed too), n-gram and DFlash drafters. Reference:
mlx-lm's ``generate_step`` on a second copy of the model, loaded in the same process and never routed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Tuple

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm import load

from conftest import greedy_reference, make_host, no_stop
from mlx_speculative.drafters.dflash import tiny
from mlx_speculative.hooks import attention as host_attention
from mlx_speculative.testing import tiny_models as tm
from mlx_speculative.hooks.scheduler import Scheduler
from mlx_speculative.plugin import cuda
from mlx_speculative.plugin.cuda import attention, backend as cuda_backend, projections
from test_attention_dispatch import StandIn

pytestmark = pytest.mark.integration

FIXTURES = Path(__file__).parent / "fixtures" / "dflash"
CONFIGS = {"llama": tm.llama_config(num_hidden_layers=4), "qwen3": tm.qwen3_config(num_hidden_layers=4),
           "qwen3_5": tm.qwen3_5_config(), "gemma3_text": tm.gemma3_text_config()}
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22, 20, 21, 22, 20, 21, 23, 24, 25, 26], [40, 41, 42]]
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Dict[str, Any]:
    """Per architecture: target, truncated draft model, and mlx-lm's greedy tokens from an unrouted copy."""
    root = tmp_path_factory.mktemp("attention_rounds")
    out: Dict[str, Any] = {}
    for i, (arch, config) in enumerate(CONFIGS.items()):
        # Layer 2 left loud: the 2-layer draft model cut from the target accepts none, some or all.
        target = tm.make_checkpoint(root / arch, config, seed=70 + i, tokenizer_dir=tokenizer_dir, logit_scale=3.0,
                                    quiet_layers_from=3)
        drafter = tm.make_truncated_drafter(target, root / f"{arch}-draft", num_layers=2)
        plain, _ = load(str(target))
        refs = {tuple(p): greedy_reference(plain, p, MAX_TOKENS) for p in PROMPTS + [long_prompt()]}
        out[arch] = {"target": target, "drafter": drafter, "plain": plain, "refs": refs}
    real = json.loads((FIXTURES / "z-lab__Qwen3-4B-DFlash-b16.config.json").read_text())
    dflash = tiny.shrink_config(real, target_layer_ids=[0, 2], mask_token_id=383, num_target_layers=4)
    out["dflash"] = tiny.write_checkpoint(root / "dflash", dflash, seed=66)
    return out


def long_prompt() -> List[int]:
    """40 tokens (a prefill of more than 32 positions) that repeat: the n-gram drafter finds drafts."""
    return ([30, 31, 32, 33, 34, 35, 36, 37] * 5)[:40]


def routed_host(monkeypatch: pytest.MonkeyPatch, padded: str, speculative: Dict[str, Any],
                path: Path, quantized: bool = False) -> Tuple[Any, Any, attention.Dispatcher, StandIn]:
    """A host whose speculative plugin hands it a policy carrying the stand-in's dispatcher."""
    kernel = StandIn()
    disp = attention.Dispatcher(attention.Kernel("stand-in", kernel, None, None), min_keys={"mlx-mask": 0, "array": 0})
    proj = projections.stand_in(quantized)  # the projections too, as on MLX-CUDA (4-bit layers: MLX_SPEC_QUANTIZED_KERNEL=on)
    monkeypatch.setattr(cuda, "available", lambda: True)  # as on MLX-CUDA: the plugin asks for a backend
    monkeypatch.setattr(cuda_backend, "dispatcher_for", lambda mode=None, **_: disp)
    monkeypatch.setattr(cuda_backend, "projections_for", lambda mode=None, **_: proj)
    monkeypatch.setenv(cuda.PADDED_ENV, padded)
    monkeypatch.setenv("MLX_SPEC_PREWARM_TOKENS", "0")
    host = make_host(dict(speculative, block_size=5, adaptive=False))
    target = host.load(str(path))
    assert target.cache_policy.attention is disp and target.cache_policy.projections is proj
    assert host_attention.routed(target.model) == sum(1 for _ in _attention_layers(target.model)) > 0
    assert host_attention.routed_projections(target.model) > 0
    return host, target, disp, kernel


def _attention_layers(model: Any) -> List[Any]:
    return [m for m in model.modules() if hasattr(m, "o_proj") and hasattr(m, "q_proj")]


def decode(host: Any, target: Any, prompts: List[List[int]], batch: bool) -> Tuple[List[List[int]], Dict[str, int]]:
    """Tokens per prompt (each alone, or all in one batch) and the rounds by acceptance."""
    totals = {"zero": 0, "partial": 0, "full": 0, "rounds": 0}
    groups = [prompts] if batch else [[p] for p in prompts]
    tokens: List[List[int]] = []
    for group in groups:
        scheduler = Scheduler(host, target)
        requests = [scheduler.submit(p, no_stop(MAX_TOKENS)) for p in group]
        got: Dict[int, List[int]] = {r.id: [] for r in requests}
        while scheduler.busy:
            for request, event in scheduler.step():
                got[request.id].append(event.token)
        for r in requests:
            tokens.append(got[r.id])
            stats = r.state.report["speculative"]
            assert stats.fallback is None, stats.fallback
            totals["rounds"] += stats.rounds
            for key, n in stats.rounds_by_acceptance.items():
                totals[key] += n
    return tokens, totals


def check_calls(kernel: StandIn, disp: attention.Dispatcher, policy: Any = None) -> None:
    """The stand-in saw only 2..32-query calls; one-token steps took MLX's path. The projections'
    stand-in took every call it was asked for (only 2..32-row ones reach it), sibling projections (q/k/v,
    gate/up) in shared launches once learned."""
    assert kernel.calls and all(2 <= L <= 32 for L, *_ in kernel.calls)
    assert disp.counts["kernel"] == len(kernel.calls) and disp.counts["mlx: queries"] > 0, disp.counts
    if policy is not None:
        counts = policy.projections.counts
        assert counts["kernel"] > 0 and counts["fused"] > 0 and counts["mlx"] == 0, counts


@pytest.mark.parametrize("padded", ["on", "off"])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_5"])
def test_draft_model_rounds_equal_plain_decoding(arch: str, padded: str, models: Dict[str, Any],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    m = models[arch]
    host, target, disp, kernel = routed_host(monkeypatch, padded, {"draft_model": str(m["drafter"])}, m["target"])
    refs = [m["refs"][tuple(p)] for p in PROMPTS]
    totals = {"zero": 0, "partial": 0, "full": 0}
    for batch in (False, True):
        before = len(kernel.calls)
        tokens, t = decode(host, target, PROMPTS, batch)
        assert tokens == refs, (arch, padded, batch)
        assert t["rounds"] > 0 and len(kernel.calls) > before
        for key in totals:
            totals[key] += t[key]
    check_calls(kernel, disp, target.cache_policy)
    assert totals["zero"] > 0 and totals["partial"] > 0 and totals["full"] > 0, totals
    # The batch's described masks (padded caches: rows at their own lengths, per-row offsets; mlx-lm's
    # exact-length BatchKVCache under the routed policy: per-row left padding) reached the kernel, and no call
    # fell back for its mask.
    per_row = [c for c in kernel.calls if isinstance(c[1] if padded == "off" else c[3], mx.array) and (
        c[1] if padded == "off" else c[3]).ndim == 1]
    assert per_row
    assert disp.counts["mlx: mask"] == 0, disp.counts
    kinds = {type(c) for c in target.cache_policy.make_cache(target.model)}
    assert (cuda_backend.PaddedKVCache if padded == "on" else cuda_backend.RoutedKVCache) in kinds, kinds
    # The unrouted copy in the same process never reached the dispatcher.
    calls = len(kernel.calls)
    assert greedy_reference(m["plain"], PROMPTS[0], 5) == refs[0][:5] and len(kernel.calls) == calls


@pytest.mark.parametrize("padded", ["on", "off"])
def test_sliding_window_target_alone(padded: str, models: Dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """gemma3_text: global layers reach the kernel; sliding layers' rotating masks, once past the window
    (8), are undescribed arrays and take MLX's path. (Batches of this target: see the report of issue 19;
    mlx-lm's BatchRotatingKVCache gives a left-padded row wrong multi-token forwards, kernel or not.)"""
    m = models["gemma3_text"]
    host, target, disp, kernel = routed_host(monkeypatch, padded, {"draft_model": str(m["drafter"])}, m["target"])
    tokens, totals = decode(host, target, PROMPTS, batch=False)
    assert tokens == [m["refs"][tuple(p)] for p in PROMPTS] and totals["rounds"] > 0
    check_calls(kernel, disp, target.cache_policy)
    assert disp.counts["mlx: mask"] > 0, disp.counts


@pytest.mark.parametrize("padded", ["on", "off"])
def test_every_verify_forward_reaches_the_kernel(padded: str, models: Dict[str, Any],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """n-gram drafts (no drafter model): each round's verify forward is one call per attention layer,
    and nothing else reaches the kernel (the 39-position prefill and the one-token steps do not)."""
    m = models["llama"]
    host, target, disp, kernel = routed_host(monkeypatch, padded, {"kind": "ngram"}, m["target"])
    prompt = long_prompt()
    tokens, totals = decode(host, target, [prompt], batch=False)
    assert tokens == [m["refs"][tuple(prompt)]]
    assert totals["rounds"] > 0 and len(kernel.calls) == 4 * totals["rounds"], (len(kernel.calls), totals)
    check_calls(kernel, disp, target.cache_policy)


@pytest.mark.parametrize("padded", ["on", "off"])
def test_dflash_rounds_through_the_dispatcher(padded: str, models: Dict[str, Any],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """DFlash's blocks attend non-causally to their context: the block's keys follow the context's in
    its cache (padded or not), so every block is one range of keys, described, and reaches the kernel
    (alone and batched: per-row widths, and left padding or, padded, rows at their own lengths)."""
    m = models["llama"]
    host, target, disp, kernel = routed_host(monkeypatch, padded, {"draft_model": str(models["dflash"]),
                                                                   "kind": "dflash"}, m["target"])
    assert host_attention.routed(target.attachments["speculative"].drafter.model) > 0
    assert host_attention.routed_projections(target.attachments["speculative"].drafter.model) > 0
    refs = [m["refs"][tuple(p)] for p in PROMPTS]
    for batch in (False, True):
        tokens, totals = decode(host, target, PROMPTS, batch)
        assert tokens == refs and totals["rounds"] > 0, batch
    check_calls(kernel, disp, target.cache_policy)
    top = lambda x: x if isinstance(x, int) else max(x.tolist())  # noqa: E731
    blocks = [c for c in kernel.calls if isinstance(c[3], int) and c[3] >= top(c[2]) - 1]  # not causal
    if padded == "off":
        assert blocks and any(isinstance(c[1], mx.array) for c in blocks)  # batched rows' left padding
    else:  # batched rows' own key lengths (context + block width per row)
        assert blocks and any(isinstance(c[2], mx.array) and c[2].size > 1 and len(set(c[2].tolist())) > 1 for c in blocks)


def test_dflash_chunked_context_alone_and_batched(models: Dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Padded caches: a prompt's context longer than a chunk (4 here, 512 by default) goes in chunks and a
    power-of-two tail (in a batch, each row's as it joins). The rounds, alone and batched, still equal plain
    decoding, and the drafter drafts the same tokens as from one append (the same rounds and acceptance)."""
    from mlx_speculative.drafters.dflash import DFlashDrafter
    from mlx_speculative.drafters.dflash import batch as dflash_batch

    appended: List[Tuple[int, int]] = []  # (rows, positions) of each context append
    original = DFlashDrafter.append_context
    monkeypatch.setattr(DFlashDrafter, "append_context", lambda self, caches, feats:
                        appended.append(feats.shape[:2]) or original(self, caches, feats))
    drafts: List[List[int]] = []  # every row's draft tokens, round by round: what the context makes
    propose = dflash_batch.DFlashBatch.propose

    def recorded(self: Any, rows: List[Any], max_drafts: List[int]) -> List[Any]:
        out = propose(self, rows, max_drafts)
        drafts.extend(p.tokens.tolist() if isinstance(p.tokens, mx.array) else list(p.tokens) for p in out)
        return out

    monkeypatch.setattr(dflash_batch.DFlashBatch, "propose", recorded)
    m = models["llama"]
    host, target, _, _ = routed_host(monkeypatch, "on", {"draft_model": str(models["dflash"]), "kind": "dflash"},
                                     m["target"])
    refs = [m["refs"][tuple(p)] for p in PROMPTS]
    for batch in (False, True):
        drafts.clear()
        _, whole = decode(host, target, PROMPTS, batch)  # prompts shorter than 512: one append each
        whole_drafts = list(drafts)
        monkeypatch.setattr(dflash_batch, "CONTEXT_CHUNK", 4)
        appended.clear()
        drafts.clear()
        tokens, totals = decode(host, target, PROMPTS, batch)
        monkeypatch.setattr(dflash_batch, "CONTEXT_CHUNK", 512)
        assert tokens == refs and totals["rounds"] > 0, batch
        assert totals == whole and drafts == whole_drafts and drafts, (batch, totals, whole)
        assert all(n <= 4 and n & (n - 1) == 0 for _, n in appended), appended
        assert appended.count((1, 4)) >= 2  # a 7- and a 12-token prompt: several chunks each


@pytest.mark.parametrize("padded", ["on", "off"])
def test_quantized_target_rounds_equal_plain_decoding(padded: str, models: Dict[str, Any], tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A 4-bit target (mlx-lm's convert, affine, group 32) with its 4-bit layers routed too (the kernel's
    reference in its place): the verify forwards' projections reach it, the one-token steps keep MLX's
    quantized matmul, and the rounds (alone and batched) equal mlx-lm's greedy decoding of an unrouted copy."""
    from mlx_lm import convert

    quantized = tmp_path / "llama-4bit"
    convert(str(models["llama"]["target"]), str(quantized), quantize=True, q_group_size=32, q_bits=4)
    plain, _ = load(str(quantized))
    refs = [greedy_reference(plain, p, MAX_TOKENS) for p in PROMPTS]
    host, target, disp, kernel = routed_host(monkeypatch, padded, {"draft_model": str(models["llama"]["drafter"])},
                                             quantized, quantized=True)
    assert sum(1 for m in target.model.modules() if isinstance(m, nn.QuantizedLinear)) == \
        host_attention.routed_projections(target.model) > 0
    totals = {"zero": 0, "partial": 0, "full": 0}
    for batch in (False, True):
        tokens, t = decode(host, target, PROMPTS, batch)
        assert tokens == refs, (padded, batch)
        for key in totals:
            totals[key] += t[key]
    counts = target.cache_policy.projections.counts
    assert counts["quantized"] > 0 and counts["mlx"] == 0, counts
    # The 4-bit target drafting for itself accepts every draft (on shape-stable caches the fp32 drafter's blocks
    # keep their size to a request's end, where a short one used to be accepted whole).
    host, target, _, _ = routed_host(monkeypatch, padded, {"draft_model": str(quantized)}, quantized, quantized=True)
    tokens, t = decode(host, target, PROMPTS[:2], True)
    assert tokens == refs[:2] and t["full"] > 0 and t["zero"] == 0, t
    totals["full"] += t["full"]
    assert totals["zero"] > 0 and totals["partial"] > 0 and totals["full"] > 0, totals
