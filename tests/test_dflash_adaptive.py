"""The adaptive block-size controller: quick shrink on collapse, slow growth to the cap, pinning,
pauses for plain steps sized by the measured costs."""

from __future__ import annotations

import collections
from typing import Optional

import pytest

from conftest import price
from mlx_speculative.plugin.adaptive import BlockSizeController, Recent
from mlx_speculative.plugin.costs import CostTable, expected_tokens

pytestmark = pytest.mark.unit


def run(c: BlockSizeController, accepted_share: float, rounds: int) -> list[int]:
    sizes = []
    for _ in range(rounds):
        size = c.next()
        sizes.append(size)
        k = size - 1
        c.update(int(round(accepted_share * k)), k)
    return sizes


def run_accepting(c: BlockSizeController, accepted: int, rounds: int) -> list[int]:
    sizes = []
    for _ in range(rounds):
        sizes.append(c.next())
        c.update(min(accepted, c.size - 1), c.size - 1)
    return sizes


def test_low_acceptance_shrinks_quickly() -> None:
    c = BlockSizeController(cap=16)
    sizes = run_accepting(c, 1, 6)
    assert sizes[:2] == [16, 16]  # one bad round alone does not shrink
    assert sizes[2] <= 4 and sizes[-1] == sizes[2] and c.paused_left == 0


def test_a_collapse_accepting_nothing_pauses_at_the_same_size() -> None:
    c = BlockSizeController(cap=16)
    assert run(c, 0.0, 2) == [16, 16]
    # Shrinking cannot help when nothing was accepted; the probe meets the shapes already seen.
    assert c.size == 16 and c.paused_left == c.min_pause


def test_measured_costs_size_the_pause() -> None:
    c = BlockSizeController(cap=16)
    price(c.costs, "round", 1, 16, 0.025)
    price(c.costs, "plain", 1, 1, 0.005)  # a probe round costs 4 plain steps more
    run(c, 0.0, 2)
    assert c.paused_left == 80  # 4 extra steps are 5 % of 80
    c.take_plain_steps()
    c.update(0, 15)
    assert c.paused_left == 80  # the backoff's cap (64) stays below what the probe's price asks
    d = BlockSizeController(cap=16)
    price(d.costs, "round", 1, 16, 0.010)
    price(d.costs, "plain", 1, 1, 0.005)  # a probe round costs 1 plain step more: 5 % of 20
    run(d, 0.0, 2)
    pauses = [d.paused_left]
    for _ in range(3):
        d.take_plain_steps()
        d.update(0, 15)
        pauses.append(d.paused_left)
    assert pauses == [20, 40, 64, 64]  # backoff past the cost rule, up to max_pause


def test_rounds_losing_to_plain_steps_pause() -> None:
    # 2 of 15 drafts accepted: 3 tokens a round. 20 ms rounds against 5 ms plain steps lose,
    # 10 ms rounds win; without a measured plain step only the acceptance rules apply.
    for round_s, plain_s, pauses in ((0.020, 0.005, True), (0.010, 0.005, False), (0.020, 0.0, False)):
        c = BlockSizeController(cap=16)
        c.shape = (1, 16)  # the rounds' shape: one row verifying 16 positions (what the round sets)
        price(c.costs, "round", 1, 16, round_s)  # priced as measured: the first observation and two more
        price(c.costs, "plain", 1, 1, plain_s)
        paused = []
        for _ in range(12):
            c.next()
            c.update(min(2, c.size - 1), c.size - 1)
            paused.append(c.take_plain_steps() > 0)
        assert any(paused) == pauses, (round_s, plain_s)


def test_one_bad_round_after_good_ones_keeps_the_block() -> None:
    c = BlockSizeController(cap=16)
    run(c, 0.6, 6)
    c.update(0, 15)
    assert c.size == 16


def test_growth_is_slow_and_capped() -> None:
    c = BlockSizeController(cap=16)
    c.size = c.floor
    sizes = run(c, 1.0, 40)
    assert sizes == sorted(sizes) and max(sizes) == 16 and c.size == 16
    steps = [i for i in range(1, len(sizes)) if sizes[i] > sizes[i - 1]]
    assert all(b - a >= 2 for a, b in zip(steps, steps[1:]))  # at least two good rounds per step
    assert all(sizes[i] - sizes[i - 1] <= max(1, sizes[i - 1] // 4) for i in steps)
    assert len(steps) >= 5  # 2 -> 16 takes many steps, not one jump


def test_partial_acceptance_holds_the_size() -> None:
    c = BlockSizeController(cap=8)
    c.size = 4
    run(c, 0.5, 10)
    assert c.size == 4 and c.paused_left == 0


def test_pinned_block_size_never_moves() -> None:
    c = BlockSizeController(cap=5, adaptive=False)
    assert run(c, 0.0, 5) + run(c, 1.0, 5) == [5] * 10
    assert c.history == [5] * 10


def test_cap_below_floor() -> None:
    c = BlockSizeController(cap=2)
    assert run(c, 0.0, 3) == [2, 2, 2] and run(c, 1.0, 5) == [2] * 5


def test_collapse_at_the_floor_pauses_with_backoff_and_probes() -> None:
    c = BlockSizeController(cap=8)
    c.size = c.floor
    c.recent_rate = 0.0
    c.update(0, 1)
    assert c.paused_left == 8 and [c.take_plain_steps(1) for _ in range(9)] == [1] * 8 + [0]
    c.update(0, 1)  # the probe collapses again: twice as long, handed out at once
    assert c.paused_left == 16 and c.take_plain_steps() == 16 and c.take_plain_steps() == 0
    for expect in (32, 64, 64):  # doubling up to max_pause
        c.update(0, 1)
        assert c.take_plain_steps() == expect
    c.update(1, 1)  # a good probe ends the backoff
    assert c.pause == 0 and c.plain_steps == 8 + 16 + 32 + 64 + 64
    c.update(0, 1)
    c.update(0, 1)
    assert c.paused_left == 8
    pinned = BlockSizeController(cap=2, adaptive=False)
    pinned.update(0, 1)
    assert not pinned.take_plain_steps()


def test_a_new_request_pauses_from_its_targets_latest_pause() -> None:
    shared = Recent()
    first = BlockSizeController(cap=16, shared=shared)
    run(first, 0.0, 2)  # two rounds accepting nothing: paused
    for expect in (8, 16, 32, 64):
        assert first.take_plain_steps() == expect
        first.update(0, 15)  # each probe rejected: the backoff doubles
    assert shared.pause == 64
    second = BlockSizeController(cap=16, shared=shared)
    assert not second.paused_left  # its first rounds run
    run(second, 0.0, 2)
    assert second.paused_left == 64  # alone: 8, and 8 rounds a 256-token request at tau 1
    good = BlockSizeController(cap=16, shared=shared)
    assert run(good, 1.0, 4) == [16] * 4 and not good.paused_left  # drafts accepted: never paused
    assert shared.pause == 0  # and the next request's pauses start short again
    third = BlockSizeController(cap=16, shared=shared)
    run(third, 0.0, 2)
    assert third.paused_left == 8
    alone = BlockSizeController(cap=16)
    run(alone, 0.0, 2)
    assert alone.paused_left == 8 and shared.pause == 8


def _in_8_rows(recent: Optional[Recent]) -> BlockSizeController:
    costs = CostTable()  # the target's, priced before its requests start
    price(costs, "round", 8, 16, 0.0193)  # an H100's 8-row round and plain step (served, 8 clients)
    price(costs, "plain", 8, 1, 0.0146)
    return BlockSizeController(cap=16, shape_stable=True, shared=recent, shape=(8, 16), costs=costs)


def _rounds_before_pause(c: BlockSizeController) -> int:
    n = 0
    while not c.paused_left and n < 50:
        c.next()
        c.update(0, 15)  # nothing accepted
        n += 1
    return n


def test_a_new_request_starts_from_its_targets_recent_acceptance() -> None:
    # Drafts never accepted: alone, the prior (4 drafts at the good rate) gives way one rejected draft a round, and
    # a row of an 8-row batch ran 9 rounds before it paused. Once its target's rounds tried a few drafts (8 here),
    # their rate is the next request's prior: its first round pauses it.
    assert [_rounds_before_pause(_in_8_rows(None)) for _ in range(3)] == [9, 9, 9]
    shared = Recent()
    assert shared.alpha is None  # nothing seen: the good rate
    assert [_rounds_before_pause(_in_8_rows(shared)) for _ in range(3)] == [9, 1, 1]
    assert shared.alpha == 0.0
    # Drafts accepted: the target's rate carries over too, and the block stays.
    good = Recent()
    for _ in range(3):
        c = _in_8_rows(good)
        assert run(c, 1.0, 6) == [16] * 6 and not c.paused_left
    assert good.alpha is not None and good.alpha > 0.99 and c.alpha > 0.99


def test_a_target_whose_latest_round_is_old_opens_the_next_request_with_a_probe() -> None:
    # Drafts never accepted: the target's estimate is 0 and its pause 64, so each new request's first round is vetoed
    # and a request shorter than 64 tokens never drafts; nothing would renew the estimate.
    shared = Recent()
    first = _in_8_rows(shared)
    _rounds_before_pause(first)
    while first.pause < 64:
        first.take_plain_steps()
        first.update(0, 15)
    assert shared.pause == 64 and shared.alpha == 0.0
    # A probe of 8 rows costs 19.3 against 14.6 ms: within the 5% budget of 8 x 0.32 / 0.05 = 52 plain steps.
    assert first.costs.probe_steps(first.probe_budget) == pytest.approx(8 * (19.3 / 14.6 - 1) / 0.05)
    for _ in range(shared.stale_after):  # requests that started with no round since, 10 plain steps each
        c = _in_8_rows(shared)
        assert not c.probing and c.prior_rate == 0.0
        c.plain_to_end(10)
    opener = _in_8_rows(shared)
    assert opener.probing and opener.opening and not opener.skip_probe(10)  # even with 10 tokens left
    opener.next()
    opener.update(15, 15)  # the workload changed: its drafts are accepted
    assert shared.pause == 0 and not opener.paused_left and not opener.opening
    later = _in_8_rows(shared)
    assert not later.probing and later.prior_rate > 0.4  # its rounds run: 2.0 tokens a round expected, 1.3 pay
    # Each opener starts the count afresh (its probe may not run: the request may end first); where the probe would
    # cost more than its budget of the plain steps since (short requests), later.
    stale = Recent(window=collections.deque([(0, 1)] * 40), pause=64)
    openers = []
    for _ in range(24):
        c = _in_8_rows(stale)
        openers.append(c.opening)
        c.plain_to_end(5)  # 5 plain steps a request: 11 requests to the 52 of the budget
    assert openers == [False] * 11 + [True] + [False] * 10 + [True, False]  # the opener's own 5 steps count
    assert not BlockSizeController(cap=16).opening  # a request of its own (no target's rounds shared)


def test_no_probe_when_fewer_tokens_are_left_than_the_pause() -> None:
    c = BlockSizeController(cap=16)
    run(c, 0.0, 2)  # paused for 8 steps
    assert not c.skip_probe(5)  # still pausing: no probe due yet
    assert c.take_plain_steps() == 8
    assert c.skip_probe(8) and not c.skip_probe(9)  # the probe would come with 8 tokens left
    c.update(3, 15)  # the probe ran (partial): later rounds are not probes
    assert c.pause and not c.skip_probe(1)


def test_growth_past_the_drafters_block_while_it_pays() -> None:
    c = BlockSizeController(cap=16, start=4)
    sizes = run(c, 1.0, 30)
    assert sizes[0] == 4 and max(sizes) == 16 and sizes == sorted(sizes)
    # Measured: a block of 5 costs 3x a block of 4; at full acceptance 5 tokens for 3x the cost of 4 do not pay.
    c = BlockSizeController(cap=16, start=4)
    price(c.costs, "round", 1, 4, 0.010)
    price(c.costs, "round", 1, 5, 0.030)
    assert max(run(c, 1.0, 30)) == 4
    # Where the policy pads blocks to powers of two, 5..8 positions cost what 8 do: priced as such.
    c = BlockSizeController(cap=16, start=4, width_for=lambda n: 1 << (n - 1).bit_length())
    price(c.costs, "round", 1, 4, 0.010)
    price(c.costs, "round", 1, 8, 0.011)
    assert max(run(c, 1.0, 30)) == 16  # 16 was never measured: tried


def test_alpha_is_the_per_position_acceptance() -> None:
    c = BlockSizeController(cap=16)
    for _ in range(30):  # every round accepts 3 of 15 and rejects the 4th: alpha 3/4
        c.update(3, 15)
    assert abs(c.alpha - 0.75) < 1e-6
    c = BlockSizeController(cap=16)
    for _ in range(30):
        c.update(15, 15)
    assert c.alpha > 0.999


def _priced(shape_stable: bool, round_s: float = 0.014, plain_s: float = 0.007) -> BlockSizeController:
    c = BlockSizeController(cap=16, shape_stable=shape_stable, width_for=lambda n: 1 << (n - 1).bit_length())
    c.shape = (1, 16)
    price(c.costs, "round", 1, 16, round_s)  # priced as measured: the first observation and two more
    price(c.costs, "plain", 1, 1, plain_s)
    return c


def test_shape_stable_targets_decide_from_measured_costs() -> None:
    # Block 16 accepting 0 or 5 drafts a round (recent rate below the collapse rate of 25 % after two zeros):
    # on a CPU the acceptance rules shrink or pause; on a shape-stable target a 14 ms round yielding ~3 tokens
    # beats 7 ms plain steps, and a smaller block is a shape never measured: the block stays, rounds go on.
    accepted = [5, 0, 5, 0, 0, 5, 0, 5, 0, 0, 5, 0]
    for shape_stable in (False, True):
        c = _priced(shape_stable)
        sizes, paused = [], 0
        for a in accepted:
            if c.paused_left:
                paused += c.take_plain_steps()
                continue
            sizes.append(c.next())
            c.update(min(a, c.size - 1), c.size - 1)
        if shape_stable:
            assert sizes == [16] * len(accepted) and paused == 0 and c.decide_by_costs
        else:
            assert min(sizes) < 16 or paused > 0
    # Nothing accepted: the round loses against the plain step it replaces, whatever the shape, once the request's
    # estimate (4 pseudo-drafts tried at the good rate) has seen a few rounds; not on the first alone.
    c = _priced(True)
    c.next()
    c.update(0, 15)
    assert c.paused_left == 0 and c.alpha == 0.6
    for _ in range(2):
        if not c.paused_left:
            c.next()
            c.update(0, 15)
    assert c.paused_left > 0 and "costs more than" in c.pause_reason and c.alpha <= 0.5
    # A smaller block whose shape was measured and pays is taken.
    c = _priced(True)
    for width, cost in ((4, 0.004), (2, 0.0035)):
        for _ in range(3):
            c.costs.observe("round", 1, width, cost)
    for _ in range(3):
        c.next()
        c.update(1, c.size - 1)
    assert c.size < 16 and c.width_for(c.size) in (2, 4) and c.paused_left == 0


def test_dips_in_acceptance_do_not_pause_a_row_that_pays() -> None:
    # Measured on an H200 (bench/results/served/h200-llama8b-d15.json): a 1x16 round 9.7 ms, a plain step 4.7 ms.
    # A row at tau ~5 whose rounds sometimes accept nothing twice in a row keeps drafting; the same row at zero
    # acceptance pauses within a few rounds; after a pause, a probe accepting most drafts starts afresh.
    accepted = [5, 7, 0, 0, 6, 4, 0, 0, 9, 5, 3, 0, 1, 6, 0, 0, 8, 4, 2, 0, 0, 7, 5, 6]
    c = _priced(True, round_s=0.0097, plain_s=0.0047)
    for a in accepted:
        assert c.paused_left == 0, (a, c.window, c.alpha)
        c.next()
        c.update(a, 15)
    assert 0.6 < c.alpha < 0.9 and len(c.window) == len(accepted)
    for _ in range(c.window_size):
        if not c.paused_left:
            c.next()
            c.update(0, 15)
    assert c.paused_left > 0 and "costs more than" in c.pause_reason
    assert expected_tokens(c.alpha, 15) * 0.0047 < 0.0097
    c.take_plain_steps()
    assert c.probing
    c.next()
    c.update(14, 15)  # the probe accepts 14 of 15: the window holds it alone
    assert c.window == [(14, 15)] and not c.paused_left


def test_a_probe_that_pays_for_itself_ends_the_pause_and_its_backoff() -> None:
    # 1x16 rounds 10 ms, plain steps 4.7 ms: a round pays from 2.13 tokens on. A tau-6 stream (5 of 15 drafts a
    # round) dips for 16 rounds and pauses; its probe accepts 3 drafts, 4 tokens for 10 ms where plain steps take
    # 18.8: the probe paid, so the dip leaves the estimate and rounds go on. (A probe judged by the share of its
    # drafts accepted, 3 of 15 below good_rate's 75 %, kept the dip and doubled the pause.)
    c = _priced(True, round_s=0.010, plain_s=0.0047)
    for _ in range(20):
        c.next()
        c.update(5, 15)
    for _ in range(16):
        if not c.paused_left:
            c.next()
            c.update(0, 15)
    assert c.paused_left > 0
    c.take_plain_steps()
    c.next()
    c.update(3, 15)
    assert c.paused_left == 0 and c.pause == 0 and c.window == [(3, 4)]
    c.next()
    c.update(5, 15)
    assert c.paused_left == 0


def test_a_stream_whose_rounds_pay_keeps_most_of_their_gain() -> None:
    # The controller over 200 simulated 256-token requests (seeded), per-position acceptance for tau 3 at block
    # 16; rounds 10 ms, plain steps 4.7 ms: rounds alone run at 1.41x plain. An estimate over too few drafts
    # tried dips below break-even and pauses (1.17x over windows of 8 rounds); over 32 drafts 1.29x.
    import random
    from mlx_speculative.benchmarks.oracle import alpha_for_tau
    r, p, alpha, seconds, tokens = 0.010, 0.0047, alpha_for_tau(3.0, 16), 0.0, 0
    for seed in range(200):
        rng, c, left = random.Random(seed), _priced(True, round_s=r, plain_s=p), 256
        while left > 0:
            n = min(c.take_plain_steps(), left)
            if n:
                left, seconds = left - n, seconds + n * p
                continue
            k, accepted = c.next() - 1, 0
            while accepted < k and rng.random() < alpha:
                accepted += 1
            c.update(accepted, k)
            left, seconds = left - 1 - accepted, seconds + r
        tokens += 256
    assert tokens / seconds * p > 1.25
