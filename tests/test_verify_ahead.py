"""Verifying ahead (plugin/cuda/verify_ahead.py): a round queues the next round's verify forward over the block
drafted ahead, at the device offset its own outcome gives, before the host reads that outcome.

The bench's oracle (benchmarks/oracle.py) supplies the drafts, its draws scripted round by round so that
rounds accept nothing, part or all of their drafts: on the device for the verify queued ahead, on the host
otherwise. The output must stay plain decoding's (mlx-lm's greedy tokens), alone (verified ahead) and in a
batch (verified in place); a queued verify is used only where the row, its caches, its pending token and its
drafts are the ones it assumed (drafts other than queued, an outcome other than assumed, plain steps between
rounds, the end of the request: verified as usual, nothing lost); the default (``on``) drafts ahead and
verifies in place.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Dict, Iterator, List, Optional

import mlx.core as mx
import pytest

from conftest import no_stop
from mlx_speculative.plugin import draft_ahead as draft_ahead_mod
from mlx_speculative.plugin import round as round_mod
from mlx_speculative.plugin.cuda import verify_ahead
from mlx_speculative.benchmarks import oracle as orc
from test_attention_rounds import MAX_TOKENS, PROMPTS, models  # noqa: F401 - models: the fixture
from test_draft_ahead import CASES, VOCAB, by_acceptance, dflash_host, run

pytestmark = pytest.mark.integration


class Scripted(orc.Oracle):
    """The bench's oracle, its draws scripted per round: right before position 0 (zero), 2 (partial), k (full)."""

    def __init__(self, cases: Iterator[str]):
        super().__init__(1.0, VOCAB)
        self.cases = cases

    def pattern(self, k: int) -> List[bool]:
        j = {"zero": 0, "partial": min(2, k - 1), "full": k}[next(self.cases)]
        return [i < j for i in range(k)]


def scripted_host(monkeypatch: pytest.MonkeyPatch, models: Dict[str, Any], cases: Iterator[str],
                  ahead: str = "verify", **speculative: Any) -> tuple:
    """``dflash_host`` with the drafter wrapped by the oracle over each prompt's reference continuation."""
    host, target = dflash_host(monkeypatch, models, ahead=ahead, **speculative)
    oracle = Scripted(cases)
    for prompt, ref in models["llama"]["refs"].items():
        oracle.register(list(prompt), ref)
    att = target.attachments[round_mod.NAME]
    target.attachments[round_mod.NAME] = dataclasses.replace(att, drafter=orc.WrappedDrafter(att.drafter, oracle))
    return host, target


def adoptions(monkeypatch: pytest.MonkeyPatch) -> Dict[str, int]:
    """Counts of queued verifies offered to a round and adopted by it."""
    seen = {"offered": 0, "adopted": 0}
    real = verify_ahead.adopt

    def counted(q: Optional[verify_ahead.Queued], *args: Any) -> Any:
        got = real(q, *args)
        seen["offered"] += q is not None
        seen["adopted"] += got is not None
        return got

    monkeypatch.setattr(round_mod, "adopt", counted)
    return seen


def refs(models: Dict[str, Any], prompts: List[List[int]]) -> List[List[int]]:
    return [models["llama"]["refs"][tuple(p)] for p in prompts]


@pytest.mark.parametrize("batch", [False, True])
def test_scripted_rounds_equal_plain_decoding(batch: bool, models: Dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    host, target = scripted_host(monkeypatch, models, itertools.cycle(CASES))
    seen = adoptions(monkeypatch)
    tokens, states = run(host, target, PROMPTS, batch)
    assert tokens == refs(models, PROMPTS)
    totals = by_acceptance(states)
    assert all(s.report["speculative"].fallback is None for s in states)
    assert totals["zero"] > 0 and totals["partial"] > 0 and totals["full"] > 0, totals
    ahead = sum(s.report["speculative"].verified_ahead for s in states)
    counts = target.cache_policy.forward.counts
    if batch:  # a batch verifies in place
        assert ahead == seen["offered"] == counts["compiled ahead"] == 0, (seen, counts)
    else:  # every round but each request's first and those near its end, adopted
        assert ahead == seen["adopted"] == seen["offered"] == counts["compiled ahead"] > totals["rounds"] // 2, \
            (seen, counts, totals)


def test_the_default_verifies_in_place(models: Dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    host, target = scripted_host(monkeypatch, models, itertools.cycle(CASES), ahead="on")
    seen = adoptions(monkeypatch)
    tokens, states = run(host, target, PROMPTS, batch=False)
    assert tokens == refs(models, PROMPTS)
    counts = target.cache_policy.forward.counts
    assert seen["offered"] == counts["compiled ahead"] == 0 and counts["compiled dflash draft ahead"] > 0, counts


def test_drafts_other_than_queued_are_verified_again(models: Dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """The verify is queued over drafts the round then does not propose: the round must not adopt it."""
    host, target = scripted_host(monkeypatch, models, itertools.cycle(CASES))
    real = orc.OracleBatch.ahead_drafts

    def other(self: orc.OracleBatch, rows: Any, unread: Any) -> Any:
        got = real(self, rows, unread)
        return None if got is None else [(got[0] + 1) % VOCAB]

    monkeypatch.setattr(orc.OracleBatch, "ahead_drafts", other)
    seen = adoptions(monkeypatch)
    tokens, states = run(host, target, PROMPTS, batch=False)
    assert tokens == refs(models, PROMPTS)
    assert seen["offered"] > 0 and seen["adopted"] == 0, seen
    assert sum(s.report["speculative"].verified_ahead for s in states) == 0


def test_a_forward_not_adopted_leaves_the_caches_as_they_were(models: Dict[str, Any],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The buffers a forward built ahead would write are garbage here (zeros): never adopted (its drafts are
    not the round's), they must never reach the caches, or the output would not be plain decoding's."""
    host, target = scripted_host(monkeypatch, models, itertools.cycle(CASES))
    fwd = target.cache_policy.forward
    real_ahead, real_drafts = fwd.forward_ahead, orc.OracleBatch.ahead_drafts

    def garbage(*args: Any) -> Any:
        got = real_ahead(*args)
        return None if got is None else (got[0], got[1], [(mx.zeros_like(k), mx.zeros_like(v)) for k, v in got[2]])

    def other(self: orc.OracleBatch, rows: Any, unread: Any) -> Any:
        got = real_drafts(self, rows, unread)
        return None if got is None else [(got[0] + 1) % VOCAB]

    monkeypatch.setattr(fwd, "forward_ahead", garbage)
    monkeypatch.setattr(orc.OracleBatch, "ahead_drafts", other)
    seen = adoptions(monkeypatch)
    tokens, _ = run(host, target, PROMPTS, batch=False)
    assert tokens == refs(models, PROMPTS)
    assert seen["offered"] > 0 and seen["adopted"] == 0 and fwd.counts["compiled ahead"] > 0, (seen, fwd.counts)


@pytest.mark.parametrize("wrong", ["accepted", "bonus"])
def test_an_outcome_other_than_assumed_is_not_adopted(wrong: str, models: Dict[str, Any],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The verify queued at the offset (or after the token) of another outcome than the host reads."""
    host, target = scripted_host(monkeypatch, models, itertools.cycle(CASES))
    real = verify_ahead.queue

    def skewed(batch: Any, drafter: Any, unread: Any, *args: Any) -> Any:
        a, bonus = unread
        return real(batch, drafter, (a + 1, bonus) if wrong == "accepted" else (a, (bonus + 1) % VOCAB), *args)

    monkeypatch.setattr(draft_ahead_mod, "queue", skewed)
    seen = adoptions(monkeypatch)
    tokens, _ = run(host, target, PROMPTS, batch=False)
    assert tokens == refs(models, PROMPTS)
    assert seen["offered"] > 0 and seen["adopted"] == 0, seen


def test_plain_steps_between_rounds_drop_it(models: Dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing accepted, adaptive blocks: the controller pauses for plain steps; the verify queued before them
    is not used."""
    host, target = scripted_host(monkeypatch, models, itertools.repeat("zero"), block_size=None, adaptive=True)
    seen = adoptions(monkeypatch)
    tokens, states = run(host, target, PROMPTS[:1], batch=False, params=no_stop(60))
    stats = states[0].report["speculative"]
    assert tokens[0][:MAX_TOKENS] == refs(models, PROMPTS[:1])[0]
    assert stats.plain_steps > 0 and stats.rounds >= 2 and stats.fallback is None, stats.to_dict()
    # Queued by the rounds at the cap: one is adopted, the one before a pause is not
    counts = target.cache_policy.forward.counts
    assert stats.verified_ahead == seen["adopted"] < seen["offered"] <= counts["compiled ahead"] <= stats.rounds, \
        (seen, counts, stats.to_dict())


def test_no_verify_is_queued_past_the_request(models: Dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Rounds that accept everything: the last rounds of a request queue nothing the request cannot use."""
    host, target = scripted_host(monkeypatch, models, itertools.repeat("full"))
    seen = adoptions(monkeypatch)
    tokens, states = run(host, target, PROMPTS[:1], batch=False)
    assert tokens == refs(models, PROMPTS[:1])
    counts = target.cache_policy.forward.counts
    assert seen["adopted"] == counts["compiled ahead"] == states[0].report["speculative"].verified_ahead > 0, seen


def test_a_failing_queue_falls_back_without_losing_a_token(models: Dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    host, target = scripted_host(monkeypatch, models, itertools.cycle(CASES))
    calls = {"n": 0}
    real = verify_ahead.queue

    def queue(*args: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("queue broke")
        return real(*args)

    monkeypatch.setattr(draft_ahead_mod, "queue", queue)
    tokens, states = run(host, target, PROMPTS[:1], batch=False)
    assert tokens == refs(models, PROMPTS[:1])  # nothing lost or repeated
    stats = states[0].report["speculative"]
    assert calls["n"] == 2 and "queue broke" in stats.fallback and stats.rounds == 2, stats.to_dict()


def test_the_oracle_on_the_device_is_the_hosts() -> None:
    """``Oracle.drafts_at`` (the queued drafts) equals ``drafts_for`` once the shifted tokens follow."""
    class Row:
        def __init__(self, tokens: List[int]):
            self.tokens, self.prompt_len = tokens, 3

    for seed in range(4):
        host, device = orc.Oracle(0.7, VOCAB, seed), orc.Oracle(0.7, VOCAB, seed)
        for o in (host, device):
            o.set_request([1, 2, 3], list(range(10, 40)), seed)
        got = device.drafts_at(Row([1, 2, 3, 10]), mx.array(3), 6)
        assert got.tolist() == host.drafts_for(Row([1, 2, 3, 10, 11, 12, 13]), 6)
