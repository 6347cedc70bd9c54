"""Drafting ahead (plugin/draft_ahead.py; ``DraftBatch.draft_ahead``, DFlash over the policy's compiled calls):
a round queues the next round's block from its outcome still on the device, before the host reads it.

The block must be used only where the rows are what it assumed, and the output must stay plain decoding's:
greedy rounds with zero, partial and full acceptance (drafts forced from the reference, corrupted at a
chosen position) equal mlx-lm's greedy tokens, alone (blocks drafted ahead) and in a batch (drafted in
place). Dropped, with nothing lost: a row joining, plain steps between rounds (adaptive pauses), more
drafts wanted than were drafted ahead, an outcome other than the one assumed; a failing ahead falls back
to plain decoding; sampled rows draft in place; a bad MLX_SPEC_DRAFT_AHEAD is a clear error.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import mlx.core as mx
import pytest

from conftest import make_host, no_stop
from mlx_speculative.drafters.base import Proposal
from mlx_speculative.drafters.dflash import DFlashBatch, DFlashDrafter
from mlx_speculative.hooks.scheduler import Scheduler
from mlx_speculative.hooks.state import SamplingParams
from mlx_speculative.plugin import accept, cuda, draft
from mlx_speculative.plugin.cuda import compiled
from mlx_speculative.plugin import round as rnd
from test_attention_rounds import MAX_TOKENS, PROMPTS, models  # noqa: F401 - models: the fixture

pytestmark = pytest.mark.integration

CASES = ("zero", "full", "partial")
VOCAB = 384


def dflash_host(monkeypatch: pytest.MonkeyPatch, models: Dict[str, Any], ahead: str = "on",
                **speculative: Any) -> Tuple[Any, Any]:
    """A host decoding the llama target with the DFlash drafter over padded caches and compiled calls."""
    monkeypatch.setenv(cuda.PADDED_ENV, "on")
    monkeypatch.setenv(compiled.ENV, "on")
    monkeypatch.setenv("MLX_SPEC_PREWARM_TOKENS", "0")
    monkeypatch.setenv(draft.AHEAD_ENV, ahead)
    settings = {"draft_model": str(models["dflash"]), "kind": "dflash", "block_size": 5, "adaptive": False}
    host = make_host({**settings, **speculative})
    target = host.load(str(models["llama"]["target"]))
    assert isinstance(target.cache_policy.forward, compiled.CompiledForward)
    return host, target


def force(monkeypatch: pytest.MonkeyPatch, refs: Dict[Tuple[int, ...], List[int]], cases: Iterator[str],
          seen: Dict[str, int]) -> None:
    """Proposals replaced, after the drafter ran, by each row's reference continuation, corrupted at position
    0 (zero), 2 (partial) or nowhere (full): the case cycling round by round, row b of a batch b cases on (rows
    of one round accept different counts). ``seen["log"]``: per round (rows, drafted ahead?, the rows' ids,
    whether every row drafted); ``seen["drafted"]``: per round, each row's tokens as the drafter proposed them."""
    original = DFlashBatch.propose

    def propose(self: DFlashBatch, rows: List[Any], max_drafts: List[int]) -> List[Proposal]:
        used = self.ahead_used
        drafted = original(self, rows, max_drafts)
        seen.setdefault("drafted", []).append([list(p.tokens.tolist() if isinstance(p.tokens, mx.array) else p.tokens)
                                               for p in drafted])
        seen["ahead_used"] += self.ahead_used - used
        seen["rounds"] += 1
        seen.setdefault("log", []).append((len(rows), self.ahead_used - used, tuple(id(r) for r in rows),
                                           all(k > 0 for k in max_drafts)))
        case = CASES.index(next(cases))
        out = []
        for b, (row, k) in enumerate(zip(rows, max_drafts)):
            ref = refs[tuple(row.tokens[: row.prompt_len])]
            g = len(row.tokens) - row.prompt_len
            truth = (ref[g : g + k] + [0] * k)[:k]
            j = {"zero": 0, "partial": 2, "full": k}[CASES[(case + b) % len(CASES)]]
            out.append(Proposal([(t + 1) % VOCAB if i == j else t for i, t in enumerate(truth)] if k else []))
        return out

    monkeypatch.setattr(DFlashBatch, "propose", propose)


def ahead_expected(log: List[Tuple[int, int, Tuple[int, ...], bool]]) -> List[bool]:
    """Per round: whether its blocks were drafted ahead: the round before had the same rows or, rows having left
    since, at least two of them (rows that drafted nothing there got blocks too)."""
    def served(before: Tuple[int, ...], ids: Tuple[int, ...]) -> bool:
        return ids == before or (len(ids) >= 2 and ids == tuple(r for r in before if r in ids))

    return [i > 0 and served(log[i - 1][2], ids) for i, (_, _, ids, _) in enumerate(log)]


def run(host: Any, target: Any, prompts: List[List[int]], batch: bool, params: Any = None,
        join_after: Optional[int] = None, at_join: Callable[[], None] = lambda: None) -> Tuple[List[List[int]], List[Any]]:
    """Tokens per prompt (each alone, or all in one batch; ``join_after``: the second prompt joins the first
    after that many steps, ``at_join`` called then) and the requests' states; ``params``: the requests', or
    a list of each prompt's."""
    groups = [prompts] if batch or join_after is not None else [[p] for p in prompts]
    tokens: List[List[int]] = []
    states: List[Any] = []
    for group in groups:
        scheduler = Scheduler(host, target)
        first = group if join_after is None else group[:1]
        each = params if isinstance(params, list) else [params or no_stop(MAX_TOKENS)] * len(prompts)
        requests = [scheduler.submit(p, each[prompts.index(p)]) for p in first]
        got: Dict[int, List[int]] = {r.id: [] for r in requests}
        steps = 0
        while scheduler.busy:
            for request, event in scheduler.step():
                got[request.id].append(event.token)
            steps += 1
            if steps == join_after:
                at_join()
                later = [scheduler.submit(p, params or no_stop(MAX_TOKENS)) for p in group[1:]]
                got.update({r.id: [] for r in later})
                requests += later
        tokens += [got[r.id] for r in requests]
        states += [r.state for r in requests]
    return tokens, states


def by_acceptance(states: List[Any]) -> Dict[str, int]:
    out = {"zero": 0, "partial": 0, "full": 0, "rounds": 0}
    for s in states:
        stats = s.report["speculative"]
        out["rounds"] += stats.rounds
        for key, n in stats.rounds_by_acceptance.items():
            out[key] += n
    return out


@pytest.mark.parametrize("batch", [False, True])
def test_forced_rounds_equal_plain_decoding(batch: bool, models: Dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    m = models["llama"]
    host, target = dflash_host(monkeypatch, models)
    seen = {"ahead_used": 0, "rounds": 0}
    force(monkeypatch, m["refs"], itertools.cycle(CASES), seen)
    tokens, states = run(host, target, PROMPTS, batch)
    assert tokens == [m["refs"][tuple(p)] for p in PROMPTS]
    totals = by_acceptance(states)
    assert all(s.report["speculative"].fallback is None for s in states)
    assert totals["zero"] > 0 and totals["partial"] > 0 and totals["full"] > 0, totals
    counts = target.cache_policy.forward.counts
    log = seen["log"]
    # every round drafts its blocks during the round before, where that one drafted for the same rows (a batch:
    # one compiled call for all, each row past its own accepted count)
    assert [bool(used) for _, used, _, _ in log] == ahead_expected(log), log
    if batch:
        assert max(n for n, used, _, _ in log if used) == len(PROMPTS), log
    else:
        assert seen["ahead_used"] == totals["rounds"] - len(PROMPTS) > 0, (seen, totals)


@pytest.mark.parametrize("skips", [False, True])
def test_batched_blocks_drafted_ahead_are_the_blocks_drafted_in_place(skips: bool, models: Dict[str, Any],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch's rows accepting different counts (zero, partial, full in one round): the blocks one call drafts
    ahead, each row past its own accepted count, are the drafter's own blocks drafted after the host read the
    outcome, row by row and round by round. ``skips``: the second row drafts nothing in every third round (its
    one token from the round's forward, as a paused row's), and its block drafted ahead serves the round after."""
    m = models["llama"]
    drafted = {}
    for mode in ("on", "off"):
        host, target = dflash_host(monkeypatch, models, ahead=mode)
        seen = {"ahead_used": 0, "rounds": 0}
        force(monkeypatch, m["refs"], itertools.cycle(CASES), seen)
        if skips:
            plan, asked = rnd._plan, {"n": 0}

            def skipping(row: Any, req: Any, draft: Any) -> Optional[int]:
                k = plan(row, req, draft)
                if row.tokens[: row.prompt_len] == PROMPTS[1]:
                    asked["n"] += 1
                    return None if asked["n"] % 3 == 2 else k
                return k

            monkeypatch.setattr(rnd, "_plan", skipping)
        tokens, _ = run(host, target, PROMPTS, batch=True)
        assert tokens == [m["refs"][tuple(p)] for p in PROMPTS]
        log = seen["log"]
        assert (seen["ahead_used"] > 0) == (mode == "on"), log
        if mode == "on":
            assert [bool(used) for _, used, _, _ in log] == ahead_expected(log), log
            # a round after one where a row drafted nothing took its blocks from the round before
            assert (not skips) or any(not a[3] and b[1] and b[0] == len(PROMPTS) for a, b in zip(log, log[1:])), log
        drafted[mode] = seen["drafted"]
        monkeypatch.undo()
    assert drafted["on"] == drafted["off"] and any(len(r) == len(PROMPTS) for r in drafted["on"])
    assert (not skips) or any([] in r for r in drafted["on"])


def test_rows_leaving_keep_the_others_blocks(models: Dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests of different lengths in one batch: as each ends, the blocks drafted ahead for the rows that stay
    serve them (two or more); the last row alone drafts in place once, then ahead again."""
    m = models["llama"]
    host, target = dflash_host(monkeypatch, models)
    seen = {"ahead_used": 0, "rounds": 0}
    force(monkeypatch, m["refs"], itertools.cycle(CASES), seen)
    lengths = [6, MAX_TOKENS, 12]
    tokens, _ = run(host, target, PROMPTS, batch=True, params=[no_stop(n) for n in lengths])
    assert tokens == [m["refs"][tuple(p)][:n] for p, n in zip(PROMPTS, lengths)]
    log = seen["log"]
    assert [bool(used) for _, used, _, _ in log] == ahead_expected(log), log
    steps = [(a[0], b[0], bool(b[1])) for a, b in zip(log, log[1:]) if a[0] != b[0]]
    assert (3, 2, True) in steps and (2, 1, False) in steps, log


def test_a_joining_row_drops_the_block_drafted_ahead(models: Dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    m = models["llama"]
    host, target = dflash_host(monkeypatch, models)
    seen = {"ahead_used": 0, "rounds": 0}
    force(monkeypatch, m["refs"], itertools.cycle(CASES), seen)
    tokens, _ = run(host, target, PROMPTS[:2], batch=False, join_after=3)
    assert tokens == [m["refs"][tuple(p)] for p in PROMPTS[:2]]
    log = seen["log"]  # alone, both rows, then the second alone once the first is done
    rows = [n for n, _, _, _ in log]
    assert rows[:2] == [1, 1] and rows.count(2) >= 2 and rows[-1] == 1, log
    # alone the rounds after the first drafted ahead; joined (the block drafted ahead dropped), in place, then
    # ahead for both; alone again, the first round in place (the batch's rows changed), then ahead again
    assert [bool(used) for _, used, _, _ in log] == ahead_expected(log), log
    joined = rows.index(2)
    assert not log[joined][1] and log[joined + 1][1] and rows[joined + 1] == 2, log


def test_plain_steps_between_rounds_drop_it(models: Dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing accepted, adaptive blocks: the controller pauses for plain steps after such rounds, whose
    captures the drafter appends first; the block drafted ahead before them is not used."""
    m = models["llama"]
    host, target = dflash_host(monkeypatch, models, block_size=None, adaptive=True)
    seen = {"ahead_used": 0, "rounds": 0}
    force(monkeypatch, m["refs"], itertools.repeat("zero"), seen)
    long = no_stop(60)
    tokens, states = run(host, target, PROMPTS[:1], batch=False, params=long)
    stats = states[0].report["speculative"]
    assert tokens[0][:MAX_TOKENS] == m["refs"][tuple(PROMPTS[0])]
    assert stats.plain_steps > 0 and stats.rounds >= 2 and stats.fallback is None, stats.to_dict()
    assert seen["ahead_used"] < seen["rounds"] - 1, (seen, stats.to_dict())


def test_a_second_prepare_keeps_the_block_taken_up(models: Dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/round_trace.py prepares once more before the round's own ``prepare``: nothing is left to catch up
    on then, and the block the first took up still serves the round."""
    m = models["llama"]
    host, target = dflash_host(monkeypatch, models)
    original = DFlashBatch.prepare

    def twice(self: DFlashBatch, rows: List[Any]) -> None:
        original(self, rows)
        original(self, rows)

    monkeypatch.setattr(DFlashBatch, "prepare", twice)
    seen = {"ahead_used": 0, "rounds": 0}
    force(monkeypatch, m["refs"], itertools.cycle(CASES), seen)
    tokens, states = run(host, target, PROMPTS, batch=False)
    assert tokens == [m["refs"][tuple(p)] for p in PROMPTS]
    assert seen["ahead_used"] == by_acceptance(states)["rounds"] - len(PROMPTS) > 0, seen


def test_more_drafts_wanted_than_drafted_ahead(models: Dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    m = models["llama"]
    host, target = dflash_host(monkeypatch, models)
    original = DFlashBatch.draft_ahead
    monkeypatch.setattr(DFlashBatch, "draft_ahead", lambda self, rows, unread, k: original(self, rows, unread, [1] * len(k)))
    seen = {"ahead_used": 0, "rounds": 0}
    force(monkeypatch, m["refs"], itertools.cycle(CASES), seen)
    tokens, states = run(host, target, PROMPTS, batch=False)
    assert tokens == [m["refs"][tuple(p)] for p in PROMPTS]
    counts = target.cache_policy.forward.counts
    assert seen["ahead_used"] == 0 and counts["compiled dflash draft"] == seen["rounds"] > 0, counts
    assert counts["compiled dflash draft ahead"] > 0  # drafted, its context kept, its one token not enough


@pytest.mark.parametrize("batch", [False, True])
@pytest.mark.parametrize("wrong", ["accepted", "bonus"])
def test_an_outcome_other_than_assumed_is_not_used(wrong: str, batch: bool, models: Dict[str, Any],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    m = models["llama"]
    host, target = dflash_host(monkeypatch, models)
    real = accept.RoundPlans.unread

    def skewed(plans: accept.RoundPlans) -> Any:
        a, bonus = real(plans)  # [B], [B]
        # a batch: one row's assumption wrong, the others' right
        off = (mx.arange(a.shape[0]) == 1) if batch else mx.ones(a.shape, dtype=mx.bool_)
        if wrong == "accepted":
            return a + off.astype(a.dtype), bonus
        return a, mx.where(off, (bonus + 1) % VOCAB, bonus).astype(bonus.dtype)

    monkeypatch.setattr(accept.RoundPlans, "unread", skewed)
    seen = {"ahead_used": 0, "rounds": 0}
    force(monkeypatch, m["refs"], itertools.cycle(CASES), seen)
    tokens, states = run(host, target, PROMPTS, batch=batch)
    assert tokens == [m["refs"][tuple(p)] for p in PROMPTS]
    assert seen["ahead_used"] == 0 and target.cache_policy.forward.counts["compiled dflash draft ahead"] > 0


def test_a_failing_ahead_falls_back_without_losing_a_token(models: Dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    m = models["llama"]
    host, target = dflash_host(monkeypatch, models)
    calls = {"n": 0}
    original = DFlashDrafter.draft

    def draft(self: DFlashDrafter, *args: Any) -> Any:
        if len(args) > 3 and args[3] is not None:  # features given: drafting ahead
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("ahead broke")
        return original(self, *args)

    monkeypatch.setattr(DFlashDrafter, "draft", draft)
    tokens, states = run(host, target, PROMPTS[:1], batch=False)
    assert tokens == [m["refs"][tuple(PROMPTS[0])]]  # nothing lost or repeated
    stats = states[0].report["speculative"]
    assert calls["n"] == 3 and "drafting ahead" in stats.fallback and "ahead broke" in stats.fallback
    assert stats.rounds == 3 and stats.plain_steps > 0


def test_sampled_rows_draft_in_place(models: Dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    params = no_stop(MAX_TOKENS, sampling=SamplingParams(temperature=0.8, seed=5))
    got = {}
    for mode in ("on", "off"):
        host, target = dflash_host(monkeypatch, models, ahead=mode)
        got[mode], states = run(host, target, PROMPTS[:2], batch=False, params=params)
        counts = target.cache_policy.forward.counts
        assert counts["compiled dflash draft ahead"] == counts["compiled dflash draft"] == 0, counts
        assert counts["compiled dflash block"] > 0
    assert got["on"] == got["off"]  # the same draws: nothing was drafted ahead


def test_modes(models: Dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    assert draft.ahead_mode() == "on" and draft.ahead_mode("ON") == "on" and draft.ahead_mode("off") == "off"
    assert draft.ahead_mode(" Verify ") == "verify"
    with pytest.raises(ValueError, match="MLX_SPEC_DRAFT_AHEAD: got 'fast'; allowed: on, verify, off"):
        draft.ahead_mode("fast")
    # the bench's --draft-ahead: modes joined by commas, each once, or both
    assert draft.ahead_modes("verify, on,off") == ["verify", "on", "off"] and draft.ahead_modes("both") == ["on", "off"]
    for bad in ("on,on", "on,fast", ""):
        with pytest.raises(ValueError, match=f"--draft-ahead: got {bad!r}; allowed: on, verify, off, distinct ones"):
            draft.ahead_modes(bad)
    monkeypatch.setenv(draft.AHEAD_ENV, "fast")
    host = make_host({"draft_model": str(models["dflash"]), "kind": "dflash"})
    with pytest.raises(ValueError, match="MLX_SPEC_DRAFT_AHEAD: got 'fast'; allowed: on, verify, off"):
        host.load(str(models["llama"]["target"]))


@pytest.mark.parametrize("drafts,target,expect", [
    ([3, 4, 5], [3, 4, 5, 6], (3, 6)), ([3, 4, 5], [9, 4, 5, 6], (0, 9)), ([3, 4, 5], [3, 4, 7, 6], (2, 7)),
])
def test_accepted_prefix_on_the_device_is_the_hosts(drafts: List[int], target: List[int], expect: Tuple[int, int]) -> None:
    a, bonus = accept.accepted_prefix(mx.array(drafts, dtype=mx.uint32), mx.array(target, dtype=mx.uint32))
    assert (int(a.item()), int(bonus.item())) == accept.accept_prefix(drafts, target) == expect


def test_the_batch_wide_greedy_walk_is_each_rows_own() -> None:
    """``greedy_batch`` against the per-row walk it replaces (``row_logprobs``, argmax, ``accepted_prefix``): rows
    of 0, partial and full acceptance, one that drafted nothing, filler past each row's drafts; bit for bit."""
    V, W = 50, 8
    mx.random.seed(3)
    logits = mx.random.normal((5, W, V)) * 4  # [B, W, V]
    y = mx.argmax(logits, axis=-1).tolist()
    counts = [7, 3, 4, 0, 5]
    fed = []
    for b, k in enumerate(counts):  # row 0 full, 1 partial (2 of 3), 2 none (first draft wrong), 4 partial (4 of 5)
        drafts = list(y[b][:k])
        if b == 1:
            drafts[2] = (drafts[2] + 1) % V
        if b == 2:
            drafts[0] = (drafts[0] + 1) % V
        if b == 4:
            drafts[4] = (drafts[4] + 1) % V
        pending = 7
        fed.append([pending] + drafts + [pending] * (W - 1 - k))  # filler: the pending token, as verify.inputs
    fed_a = mx.array(fed, dtype=mx.uint32)
    logp, yb, a, bonus = accept.greedy_batch(logits, fed_a, counts)
    expect = [(7, y[0][7]), (2, y[1][2]), (0, y[2][0]), (0, y[3][0]), (4, y[4][4])]
    assert list(zip(a.tolist(), bonus.tolist())) == expect
    for b, k in enumerate(counts):
        lp = accept.row_logprobs(SimpleNamespace(logits_processors=None), logits[b : b + 1], fed[b][1 : 1 + k])
        assert mx.array_equal(logp[b, : k + 1], lp).item() and yb[b, : k + 1].tolist() == mx.argmax(lp, axis=-1).tolist()
        if k:
            one = accept.accepted_prefix(fed_a[b, 1 : 1 + k], mx.argmax(lp, axis=-1))
            assert (int(one[0].item()), int(one[1].item())) == expect[b]


def test_a_row_decoding_plainly_leaves_the_others_drafting_ahead(models: Dict[str, Any],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch whose second row decodes plainly (its request turned speculation off): the drafting rows' outcomes
    and captures reach the drafter as their own batch (plugin/draft_ahead.py takes them out of the round's), blocks
    drafted ahead serve them, and every row's tokens are its plain ones."""
    m = models["llama"]
    host, target = dflash_host(monkeypatch, models)
    seen = {"ahead_used": 0, "rounds": 0}
    force(monkeypatch, m["refs"], itertools.cycle(CASES), seen)
    params = [no_stop(MAX_TOKENS, options={"speculative": False} if i == 1 else {}) for i in range(len(PROMPTS))]
    tokens, states = run(host, target, PROMPTS, True, params)
    assert tokens == [m["refs"][tuple(p)] for p in PROMPTS]
    assert not states[1].report.get("speculative")
    assert all(s.report["speculative"].rounds and s.report["speculative"].fallback is None for s in states[::2])
    assert seen["ahead_used"] > 0 and max(n for n, used, _, _ in seen["log"] if used) == len(PROMPTS) - 1, seen["log"]
