"""The adaptive block-size controller: quick shrink on collapse, slow growth to the cap, pinning."""

from __future__ import annotations

from mlx_speculative.plugin.adaptive import BlockSizeController


def run(c: BlockSizeController, accepted_share: float, rounds: int) -> list[int]:
    sizes = []
    for _ in range(rounds):
        size = c.next()
        sizes.append(size)
        k = size - 1
        c.update(int(round(accepted_share * k)), k)
    return sizes


def test_collapse_shrinks_quickly_to_the_floor() -> None:
    c = BlockSizeController(cap=16)
    sizes = run(c, 0.0, 6)
    assert sizes[:2] == [16, 16]  # one bad round alone does not shrink
    assert sizes[2] <= 8 and sizes[4] == 2 and c.size == 2


def test_one_bad_round_after_good_ones_keeps_the_block() -> None:
    c = BlockSizeController(cap=16)
    run(c, 0.6, 6)
    c.update(0, 15)
    assert c.size == 16


def test_growth_is_slow_and_capped() -> None:
    c = BlockSizeController(cap=16)
    run(c, 0.0, 6)
    sizes = run(c, 1.0, 40)
    assert sizes == sorted(sizes) and max(sizes) == 16 and c.size == 16
    steps = [i for i in range(1, len(sizes)) if sizes[i] > sizes[i - 1]]
    assert all(b - a >= 2 for a, b in zip(steps, steps[1:]))  # at least two good rounds per step
    assert all(sizes[i] - sizes[i - 1] <= max(1, sizes[i - 1] // 4) for i in steps)
    assert len(steps) >= 5  # 2 -> 16 takes many steps, not one jump


def test_partial_acceptance_holds_the_size() -> None:
    c = BlockSizeController(cap=8)
    run(c, 0.0, 5)
    small = c.size
    run(c, 0.5, 10)
    assert c.size == small


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
    for expect in (32, 64, 128, 128):  # doubling up to max_pause
        c.update(0, 1)
        assert c.take_plain_steps() == expect
    c.update(1, 1)  # a good probe ends the backoff
    assert c.pause == 0 and c.plain_steps == 8 + 16 + 32 + 64 + 128 + 128
    c.update(0, 1)
    c.update(0, 1)
    assert c.paused_left == 8
    pinned = BlockSizeController(cap=2, adaptive=False)
    pinned.update(0, 1)
    assert not pinned.take_plain_steps()
