"""Adaptive block size: shrink quickly when recent acceptance collapses, grow back slowly to the cap.

Why: a round verifies B positions whatever the drafter gets right, so a block much longer than
what is accepted wastes verify work (on GPUs the waste is small up to ~16 positions, DESIGN.md;
on a CPU it is linear in B). The controller watches the recent acceptance rate (an exponential
average over rounds, so that one bad round after good ones does not shrink the block):

- collapse (recent rate below ``collapse_rate``): cut the block at once to about twice the
  recently accepted length, and at least halve it;
- growth: after ``grow_after`` consecutive rounds that accepted (nearly) everything they drafted,
  one step up (+25 %, at least +1), never past the cap (the configured or the drafter's block size).

- pause: the next ``pause`` steps are plain one-token steps (the drafter catches up afterwards),
  then one probe round at the same size. Three things pause: a collapse while already at the floor
  (even one draft token per round does not pay for its drafter call and its 2-wide verify); a
  collapse round that accepted nothing (shrinking cannot help, and on GPUs, where a verify costs
  about the same for 2 or 16 positions, a smaller block only meets new shapes); and rounds that
  lose against plain decoding at the measured costs: (1 + accepted) * plain step < round. A probe
  that collapses again doubles the pause (up to ``max_pause``); a round that accepts most of its
  drafts resets it. Once both costs are measured a pause is at least long enough that its probe
  round costs no more than ``probe_budget`` of it: (round / plain step - 1) / probe_budget steps.
  No probe when fewer tokens are left than the pause before it (``skip_probe``).

Costs are the round loop's wall-clock measurements (``record_round``, ``record_plain``), averaged
like the rates; before a plain step was measured only the acceptance rules apply.

An explicit ``block_size`` pins the size (``adaptive=False``). ``history`` holds the size each
round used; the stats report it (``SpecStats.block_sizes``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional


@dataclass
class BlockSizeController:
    cap: int
    adaptive: bool = True
    floor: int = 2
    size: int = 0
    history: List[int] = field(default_factory=list)  # block size used by each round
    collapse_rate: float = 0.25  # recent acceptance rate below this: shrink
    good_rate: float = 0.75  # a round accepting at least this share of its drafts counts as good
    grow_after: int = 2  # good rounds in a row before one step up
    decay: float = 0.5  # weight of the newest round in the recent averages
    recent_rate: float = -1.0  # exponential average of accepted / drafted (starts at good_rate)
    recent_accepted: float = 0.0  # exponential average of accepted per round
    min_pause: int = 8
    max_pause: int = 256
    probe_budget: float = 0.05  # a probe round costs at most this share of the pause before it
    round_seconds: float = 0.0  # exponential average of a round's wall clock (0: not measured)
    plain_seconds: float = 0.0  # exponential average of a plain step's wall clock (0: not measured)
    pause: int = 0  # length of the next pause, in plain steps (0: not pausing)
    paused_left: int = 0  # plain steps still to take before the next probe round
    plain_steps: int = 0  # plain steps taken while paused, for the stats
    probing: bool = False  # a pause is over: the next round is its probe
    pause_reason: str = ""  # why the latest pause began, for the stats
    _good: int = 0

    def __post_init__(self) -> None:
        if self.cap < self.floor:
            self.floor = max(2, self.cap)
        self.size = self.cap
        self.recent_accepted = float(self.cap - 1)
        if self.recent_rate < 0:
            self.recent_rate = self.good_rate

    def next(self) -> int:
        self.history.append(self.size)
        return self.size

    def take_plain_steps(self, limit: Optional[int] = None) -> int:
        """While paused: the plain one-token steps to take now instead of rounds (else 0), at most ``limit``."""
        n = self.paused_left if limit is None else min(limit, self.paused_left)
        self.paused_left -= n
        self.plain_steps += n
        if n and not self.paused_left:
            self.probing = True
        return n

    def skip_probe(self, remaining: int) -> bool:
        """The next round would probe after a pause, with no more tokens left than that pause:
        it could not pay for itself, so the rest are plain steps (``plain_to_end``)."""
        return self.probing and remaining <= self.pause

    def plain_to_end(self, steps: int) -> int:
        self.plain_steps += steps
        return steps

    def _average(self, old: float, new: float) -> float:
        return new if old <= 0 else self.decay * new + (1 - self.decay) * old

    def record_round(self, seconds: float) -> None:
        """A round's wall clock, drafting to commit."""
        self.round_seconds = self._average(self.round_seconds, seconds)

    def record_plain(self, steps: int, seconds: float) -> None:
        """The wall clock of ``steps`` plain one-token steps taken during a pause."""
        if steps > 0 and seconds > 0:
            self.plain_seconds = self._average(self.plain_seconds, seconds / steps)

    def losing(self) -> bool:
        """Rounds yield fewer tokens per second than plain steps, at the measured costs."""
        if not (self.round_seconds > 0 and self.plain_seconds > 0):
            return False
        return (1 + self.recent_accepted) * self.plain_seconds < self.round_seconds

    def _pause(self, reason: str) -> None:
        self.pause_reason = reason
        backoff = min(self.max_pause, self.pause * 2) if self.pause else self.min_pause
        probe_paid = 0
        if self.round_seconds > 0 and self.plain_seconds > 0:
            extra = max(0.0, self.round_seconds / self.plain_seconds - 1.0)
            probe_paid = min(self.max_pause, math.ceil(extra / self.probe_budget))
        self.pause = max(backoff, probe_paid)
        self.paused_left = self.pause
        self._good = 0

    def update(self, accepted: int, draft_tokens: int) -> None:
        self.probing = False
        if not self.adaptive or draft_tokens == 0:
            return
        rate = accepted / draft_tokens
        self.recent_rate = self.decay * rate + (1 - self.decay) * self.recent_rate
        self.recent_accepted = self.decay * accepted + (1 - self.decay) * self.recent_accepted
        collapsed = self.recent_rate < self.collapse_rate
        if collapsed and rate < self.collapse_rate and (self.size == self.floor or accepted == 0):
            self._pause(f"acceptance below break-even: {self.recent_rate:.0%} of recent drafts accepted "
                        f"(< {self.collapse_rate:.0%}) at block {self.size}")
        elif collapsed:
            # Blocks of about twice what was recently accepted, the pending token included.
            fit = 2 * math.ceil(min(self.recent_accepted, accepted)) + 2
            self.size = max(self.floor, min(self.size // 2, fit))
            self._good = 0
        elif self.losing() and rate < self.good_rate:
            self._pause(f"acceptance below break-even: a round ({1000 * self.round_seconds:.1f} ms) costs more than "
                        f"the {1 + self.recent_accepted:.1f} plain steps it replaces ({1000 * self.plain_seconds:.1f} ms each)")
        elif rate >= self.good_rate:
            self.pause = 0
            self._good += 1
            if self._good >= self.grow_after and self.size < self.cap:
                self.size = min(self.cap, self.size + max(1, self.size // 4))
                self._good = 0
        else:
            self._good = 0
