"""Transactions inside the real round loop: a drafter that raises mid-round, and hidden-state captures.

A drafter that fails in its third round must leave every cache (the target's and its own) exactly
as before that round; the request goes on with plain decoding, with no lost or repeated token.
Captured hidden states must stay those of the kept positions when a recurrent target replays them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from conftest import encode, greedy_reference, make_host, no_stop
from mlx_speculative.drafters.base import DraftSession, Drafter
from mlx_speculative.drafters.draft_model import DraftModelDrafter
from mlx_speculative.hooks import taps
from mlx_speculative.hooks import tiny_models as tm
from mlx_speculative.hooks.host import Host
from mlx_speculative.plugin.types import Proposal
from test_commit_contract import exact_state, same

MAX_TOKENS = 30


class FlakySession(DraftSession):
    """A real draft-model session that raises in ``propose`` of round ``fail_at``, after feeding its caches."""

    def __init__(self, inner: DraftSession, fail_at: Optional[int], where: str = "propose"):
        self.inner, self.fail_at, self.where, self.calls, self.commits = inner, fail_at, where, 0, 0
        self.before: Optional[Dict[str, List[Any]]] = None

    def caches(self) -> List[Any]:
        return self.inner.caches()

    def replay(self, n: int) -> None:
        self.inner.replay(n)

    def propose(self, state: Any, max_drafts: int) -> Proposal:
        self.calls += 1
        if self.where == "oov" and self.calls == self.fail_at:  # a list with an out-of-vocabulary token
            self.before = {"target": exact_state(state.cache), "own": exact_state(self.caches()),
                           "tokens": list(state.tokens)}
            return Proposal(list(self.inner.propose(state, max_drafts).tokens)[:-1] + [10**6])
        if self.where == "lazy":
            # Every proposal as an (unevaluated) array; round fail_at carries an out-of-vocabulary
            # token, found only after the verify was queued.
            if self.calls == self.fail_at:
                self.before = {"target": exact_state(state.cache), "own": exact_state(self.caches()),
                               "tokens": list(state.tokens)}
            tokens = list(self.inner.propose(state, max_drafts).tokens)
            if self.calls == self.fail_at:
                tokens[-1] = 10**6
            return Proposal(mx.array(tokens, dtype=mx.int32) + 0)
        if self.calls == self.fail_at and self.where == "propose":
            self.before = {"target": exact_state(state.cache), "own": exact_state(self.caches()),
                           "tokens": list(state.tokens)}
            self.inner.propose(state, max_drafts)  # feeds the drafter's caches, then fails
            raise RuntimeError("drafter exploded")
        return self.inner.propose(state, max_drafts)

    def commit(self, state: Any, accepted: int, draft_tokens: int) -> int:
        self.commits += 1
        if self.commits == self.fail_at and self.where == "commit":
            raise RuntimeError("drafter exploded while committing")
        return self.inner.commit(state, accepted, draft_tokens)


class FlakyDrafter(Drafter):
    kind = "draft_model"
    family = "flaky_test"
    default_block_size = 5

    def __init__(self, model: Any, fail_at: Optional[int], layers: List[int], where: str = "propose"):
        self.inner = DraftModelDrafter(model)
        self.fail_at, self.layers, self.where = fail_at, layers, where
        self.sessions: List[FlakySession] = []

    def capture_layers(self) -> List[int]:
        return self.layers

    def new_session(self, state: Any) -> DraftSession:
        session = FlakySession(self.inner.new_session(state), self.fail_at, self.where)
        self.sessions.append(session)
        return session


class CheckingHost(Host):
    """Checks, at the first plain step after a failed round, that every cache is as before that round."""

    checked = 0

    def _plain_step(self, state: Any) -> Any:
        req = state.extras.get("speculative")
        session = getattr(req, "session", None)
        if session is not None and session.before is not None and not getattr(session, "checked", False):
            session.checked = True
            same(exact_state(state.cache), session.before["target"])
            same(exact_state(session.caches()), session.before["own"])
            assert state.tokens == session.before["tokens"]
            CheckingHost.checked += 1
        return super()._plain_step(state)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Dict[str, Dict[str, Path]]:
    out = {}
    for i, (arch, config) in enumerate([("qwen3_5", tm.qwen3_5_config()), ("gemma3_text", tm.gemma3_text_config())]):
        root = tmp_path_factory.mktemp(arch)
        target = tm.make_checkpoint(root / "target", config, seed=40 + i, tokenizer_dir=tokenizer_dir,
                                    logit_scale=3.0, quiet_layers_from=1)
        out[arch] = {"target": target, "drafter": tm.make_truncated_drafter(target, root / "drafter", 2)}
    return out


def _host(pair: Dict[str, Path], fail_at: Optional[int], layers: List[int], where: str = "propose"):
    host = make_host({"kind": "ngram", "block_size": 5})
    host.__class__ = CheckingHost
    target = host.load(str(pair["target"]))
    drafter = FlakyDrafter(load(str(pair["drafter"]))[0], fail_at, layers, where)
    att = target.attachments["speculative"]
    att.drafter, att.block_size = drafter, 5
    return host, target, drafter


@pytest.mark.parametrize("arch", ["qwen3_5", "gemma3_text"])
def test_drafter_raising_mid_round_falls_back_without_losing_tokens(arch: str, checkpoints: Dict[str, Any]) -> None:
    host, target, drafter = _host(checkpoints[arch], fail_at=3, layers=[])
    before = CheckingHost.checked
    for text in ("the model token draft verify", "red green blue one two three red green blue one two"):
        prompt = encode(target, text)
        result = host.generate(target, prompt, no_stop(MAX_TOKENS))
        assert result.tokens == greedy_reference(target.model, prompt, MAX_TOKENS)
        stats = result.report["speculative"]
        assert stats.rounds == 2 and "drafter exploded" in stats.fallback
        assert "RuntimeError" in stats.fallback
    assert CheckingHost.checked == before + 2


@pytest.mark.parametrize("where", ["lazy", "oov"])
@pytest.mark.parametrize("arch", ["qwen3_5", "gemma3_text"])
def test_out_of_vocabulary_drafts_roll_the_round_back(arch: str, where: str, checkpoints: Dict[str, Any]) -> None:
    """Lazy arrays are checked after the queued verify, lists before it: both leave every cache as before."""
    host, target, drafter = _host(checkpoints[arch], fail_at=3, layers=[], where=where)
    before = CheckingHost.checked
    prompt = encode(target, "red green blue one two three red green blue one two")
    result = host.generate(target, prompt, no_stop(MAX_TOKENS))
    assert result.tokens == greedy_reference(target.model, prompt, MAX_TOKENS)
    stats = result.report["speculative"]
    assert stats.rounds == 2 and "outside the target's vocabulary" in stats.fallback
    assert CheckingHost.checked == before + 1  # target and drafter caches as before round 3


def test_drafter_raising_in_commit_keeps_the_round_and_falls_back(checkpoints: Dict[str, Any]) -> None:
    """The target already committed the round's tokens; the drafter's caches roll back; plain decoding goes on."""
    host, target, drafter = _host(checkpoints["qwen3_5"], fail_at=2, layers=[], where="commit")
    prompt = encode(target, "the model token draft verify")
    result = host.generate(target, prompt, no_stop(MAX_TOKENS))
    assert result.tokens == greedy_reference(target.model, prompt, MAX_TOKENS)
    stats = result.report["speculative"]
    assert stats.rounds == 2 and "while committing" in stats.fallback


def _reference_captures(model: Any, tokens: List[int], prompt_len: int, layers: List[int]) -> Dict[int, mx.array]:
    """The layers' outputs for every fed position under plain decoding (prompt chunk, then one at a time)."""
    cache = make_prompt_cache(model)
    with taps.record(layers) as rec:
        model(mx.array([tokens[: prompt_len - 1]]), cache=cache)
        for t in tokens[prompt_len - 1 : -1]:
            model(mx.array([[t]]), cache=cache)
    return {i: mx.concatenate(v, axis=1) for i, v in rec.items()}


@pytest.mark.parametrize("arch", ["qwen3_5", "gemma3_text"])
def test_captures_follow_the_kept_positions(arch: str, checkpoints: Dict[str, Any]) -> None:
    layers = [0, 3]
    host, target, drafter = _host(checkpoints[arch], fail_at=None, layers=layers)
    prompt = encode(target, "test plan build run step loop test plan build run step loop")
    holder: List[Any] = []
    events = list(host.stream(target, prompt, no_stop(MAX_TOKENS), state_out=holder))
    state = holder[0]
    stats = state.report["speculative"]
    assert stats.rounds_by_acceptance["partial"] + stats.rounds_by_acceptance["zero"] > 0, stats
    assert [e.token for e in events] == greedy_reference(target.model, prompt, MAX_TOKENS)
    ref = _reference_captures(target.model, state.tokens, len(prompt), layers)
    for i in layers:
        assert state.captures[i].shape == ref[i].shape == (1, len(state.tokens) - 1, 64)
        assert mx.allclose(state.captures[i], ref[i], atol=1e-4, rtol=1e-4).item()


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
