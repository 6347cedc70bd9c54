"""Transactions inside the real round loop: a drafter that raises mid-round, and hidden-state captures.

A drafter that fails in its third round must leave every cache (the target's and its own) exactly
as before that round; the request goes on with plain decoding, with no lost or repeated token.
The captures handed to a drafter must be those of the committed positions, each once, when a
recurrent or sliding-window target keeps part of a verify forward.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from conftest import BareForwarding, encode, greedy_reference, make_host, no_stop
from mlx_speculative.drafters.base import DraftBatch, Drafter, Proposal, Verified
from mlx_speculative.drafters.draft_model import DraftModelDrafter
from mlx_speculative.hooks import recurrent, taps
from mlx_speculative.testing import tiny_models as tm
from mlx_speculative.hooks.scheduler import Scheduler
from mlx_speculative.hooks.specs import hookimpl
from test_commit_contract import exact_state, same

pytestmark = pytest.mark.integration

MAX_TOKENS = 30


class FlakyBatch(BareForwarding):
    """A real draft-model batch that fails in round ``fail_at``: raising in ``propose`` after feeding
    its caches, proposing a token outside the vocabulary (a list, or lazily as an array), or raising in
    ``commit``. Records every capture it is handed."""

    def __init__(self, drafter: "FlakyDrafter"):
        super().__init__(drafter.inner.new_batch())
        self.d = drafter
        self.calls = self.commits = 0

    def sync(self, rows: Sequence[Any]) -> None:
        for row in rows:
            if row.captures:
                self.d.handed.append(dict(row.captures))
        self.inner.sync(rows)

    def propose(self, rows: Sequence[Any], max_drafts: Sequence[int]) -> List[Proposal]:
        self.calls += 1
        failing = self.calls == self.d.fail_at and self.d.where != "commit"
        if failing:
            self.d.before = {"target": exact_state(self.d.batch().cache), "own": exact_state(self.inner.cache),
                             "tokens": list(rows[0].tokens)}
        out = self.inner.propose(rows, max_drafts)  # feeds the drafter's caches
        if failing and self.d.where == "propose":
            raise RuntimeError("drafter exploded")
        if self.d.where in ("oov", "lazy"):
            tokens = list(out[0].tokens)
            if failing:
                tokens[-1] = 10**6
            lazy = mx.array(tokens, dtype=mx.int32) + 0  # an unevaluated array: checked after the verify
            return [Proposal(lazy if self.d.where == "lazy" else tokens, out[0].logprobs)]
        return out

    def commit(self, rows: Sequence[Any], verified: Sequence[Verified]) -> List[int]:
        self.commits += 1
        if self.commits == self.d.fail_at and self.d.where == "commit":
            raise RuntimeError("drafter exploded while committing")
        self.d.handed += [v.captures for v in verified if v.captures]
        return self.inner.commit(rows, verified)


class FlakyDrafter(Drafter):
    kind = "draft_model"
    family = "flaky_test"
    default_block_size = 5

    def __init__(self, model: Any, fail_at: Optional[int], layers: List[int], where: str, batch: Callable[[], Any]):
        self.inner = DraftModelDrafter(model)
        self.fail_at, self.layers, self.where, self.batch = fail_at, layers, where, batch
        self.before: Optional[Dict[str, Any]] = None
        self.checked = 0
        self.handed: List[Dict[int, mx.array]] = []

    def capture_layers(self) -> List[int]:
        return self.layers

    def new_batch(self) -> DraftBatch:
        self.flaky = FlakyBatch(self)
        return self.flaky


class Checker:
    """Asked after the speculative plugin declines (a failed round): every cache must be as before
    that round, before the host takes its plain step."""

    def __init__(self) -> None:
        self.drafter: Optional[FlakyDrafter] = None

    @hookimpl
    def host_decode_step(self, batch: Any) -> None:
        d = self.drafter
        if d is not None and d.before is not None and not d.checked:
            d.checked += 1
            same(exact_state(batch.cache), d.before["target"])
            same(exact_state(d.flaky.inner.cache), d.before["own"])
            assert batch.rows[0].tokens == d.before["tokens"]
        return None


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Dict[str, Dict[str, Path]]:
    out = {}
    for i, (arch, config) in enumerate([("qwen3_5", tm.qwen3_5_config()), ("gemma3_text", tm.gemma3_text_config())]):
        root = tmp_path_factory.mktemp(arch)
        target = tm.make_checkpoint(root / "target", config, seed=40 + i, tokenizer_dir=tokenizer_dir,
                                    logit_scale=3.0, quiet_layers_from=1)
        out[arch] = {"target": target, "drafter": tm.make_truncated_drafter(target, root / "drafter", 2)}
    return out


def _generate(pair: Dict[str, Path], prompt_text: str, fail_at: Optional[int], layers: List[int],
              where: str = "propose") -> Any:
    from mlx_speculative.hooks.host import Host
    from mlx_speculative.hooks.manager import make_plugin_manager
    from mlx_speculative.hooks.state import HostConfig
    from mlx_speculative.plugin import hookimpls

    checker = Checker()
    host = Host(HostConfig(sections={"speculative": {"kind": "ngram", "block_size": 5}}),
                pm=make_plugin_manager(False, [checker, hookimpls]))  # the checker is asked after the plugin
    target = host.load(str(pair["target"]))
    scheduler = Scheduler(host, target)
    prompt = encode(target, prompt_text)
    box: Dict[str, Any] = {}
    model = load(str(pair["drafter"]))[0]
    recurrent.scope_model(model)
    drafter = FlakyDrafter(model, fail_at, layers, where, lambda: box["request"].batch)
    checker.drafter = drafter
    att = target.attachments["speculative"]
    att.drafter, att.block_size = drafter, 5
    request = box["request"] = scheduler.submit(prompt, no_stop(MAX_TOKENS))
    tokens: List[int] = []
    while not request.done:
        tokens += [e.token for _, e in scheduler.step()]
    return target, prompt, tokens, request.state, drafter


@pytest.mark.parametrize("arch", ["qwen3_5", "gemma3_text"])
def test_drafter_raising_mid_round_falls_back_without_losing_tokens(arch: str, checkpoints: Dict[str, Any]) -> None:
    for text in ("the model token draft verify", "red green blue one two three red green blue one two"):
        target, prompt, tokens, state, drafter = _generate(checkpoints[arch], text, 3, [])
        assert tokens == greedy_reference(target.model, prompt, MAX_TOKENS)
        stats = state.report["speculative"]
        assert stats.rounds == 2 and "drafter exploded" in stats.fallback and "RuntimeError" in stats.fallback
        assert drafter.checked == 1


@pytest.mark.parametrize("where", ["lazy", "oov"])
@pytest.mark.parametrize("arch", ["qwen3_5", "gemma3_text"])
def test_out_of_vocabulary_drafts_roll_the_round_back(arch: str, where: str, checkpoints: Dict[str, Any]) -> None:
    """Lazy arrays are checked after the queued verify, lists before it: both leave every cache as before."""
    target, prompt, tokens, state, drafter = _generate(
        checkpoints[arch], "red green blue one two three red green blue one two", 3, [], where)
    assert tokens == greedy_reference(target.model, prompt, MAX_TOKENS)
    stats = state.report["speculative"]
    assert stats.rounds == 2 and "outside the target's vocabulary" in stats.fallback
    assert drafter.checked == 1  # target and drafter caches as before round 3


def test_drafter_raising_in_commit_keeps_the_round_and_falls_back(checkpoints: Dict[str, Any]) -> None:
    """The target already committed the round's tokens; the drafter's caches roll back; plain decoding goes on."""
    target, prompt, tokens, state, _ = _generate(checkpoints["qwen3_5"], "the model token draft verify", 2, [],
                                                 "commit")
    assert tokens == greedy_reference(target.model, prompt, MAX_TOKENS)
    stats = state.report["speculative"]
    assert stats.rounds == 2 and "while committing" in stats.fallback


def _reference_captures(model: Any, tokens: List[int], prompt_len: int, layers: List[int]) -> Dict[int, mx.array]:
    """The layers' outputs for every fed position under plain decoding (prompt chunk, then one at a time)."""
    cache = make_prompt_cache(model)
    taps.install_taps(model, layers)
    with taps.record(layers) as rec:
        model(mx.array([tokens[: prompt_len - 1]]), cache=cache)
        for t in tokens[prompt_len - 1 : -1]:
            model(mx.array([[t]]), cache=cache)
    return {i: mx.concatenate(v, axis=1) for i, v in rec.items()}


@pytest.mark.parametrize("arch", ["qwen3_5", "gemma3_text"])
def test_captures_follow_the_kept_positions(arch: str, checkpoints: Dict[str, Any]) -> None:
    layers = [0, 3]
    target, prompt, tokens, state, drafter = _generate(
        checkpoints[arch], "test plan build run step loop test plan build run step loop", None, layers)
    stats = state.report["speculative"]
    assert stats.rounds_by_acceptance["partial"] + stats.rounds_by_acceptance["zero"] > 0, stats
    assert tokens == greedy_reference(target.model, prompt, MAX_TOKENS)
    ref = _reference_captures(target.model, state.tokens, len(prompt), layers)
    for i in layers:
        got = mx.concatenate([h[i] for h in drafter.handed], axis=1)  # every committed position, once
        assert got.shape == ref[i].shape == (1, len(state.tokens) - 1, 64)
        assert mx.allclose(got, ref[i], atol=1e-4, rtol=1e-4).item()


def test_max_kv_size_falls_back_to_plain_decoding(qwen3_pair: Dict[str, Path]) -> None:
    """max_kv_size (RotatingKVCache with keep=4) cannot be verified exactly past the window: the
    round is refused before anything changes and the request decodes plainly, equal to mlx-lm."""
    from mlx_lm.generate import generate_step

    host = make_host({"draft_model": str(qwen3_pair["drafter"]), "block_size": 4})
    target = host.load(str(qwen3_pair["target"]))
    prompt = encode(target, "the model token")
    assert len(prompt) <= 8  # a few rounds fit in the window before it is exceeded
    ref = [int(t) for t, _ in generate_step(mx.array(prompt), target.model, max_tokens=30, max_kv_size=16)]
    result = host.generate(target, prompt, no_stop(30, max_kv_size=16))
    assert result.tokens == ref
    stats = result.report["speculative"]
    assert stats.rounds > 0 and "RotatingKVCache" in stats.fallback and "keep=4" in stats.fallback
