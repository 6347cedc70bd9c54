"""Adaptive block size: shrink quickly when recent acceptance collapses, grow back slowly to the cap.

Why: a round verifies B positions whatever the drafter gets right, so a block much longer than
what is accepted wastes verify work (on GPUs the waste is small up to ~16 positions, docs/architecture.md;
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
  that collapses again doubles the pause (up to ``max_pause``); a round that paid for itself (``paid``)
  resets it. Once both costs are measured a pause is at least long enough that its probe
  round costs no more than ``probe_budget`` of it: (round / plain step - 1) / probe_budget steps.
  No probe when fewer tokens are left than the pause before it (``skip_probe``). A request's first pause goes
  on from its target's latest, and its acceptance estimate starts from its target's recent rate (``Recent``: the
  requests of one deployment draft alike), and where the target's latest round is older than a few requests the
  next one opens with a probe. In a batch on a
  shape-stable target a paused row drafts in the rounds the other rows run (plugin/round.py ``_ride``); such a
  round that paid ends its pause.

Costs come from the loaded target's ``CostTable`` (plugin/costs.py): a round of each (rows, verify width) and a
plain step of each row count, each timed from the host's asking the plugin to its asking again (plugin/round.py
``_price``), each priced by its least observation (not a running average of wall clock, so
that a request's decisions do not move with the machine's load); before a plain step of the
row count was measured only the acceptance rules apply. ``shape`` is the (rows, verify width) of the row's
latest round: a row in a batch pays its share, so it loses when (1 + accepted) / round < 1 / plain step.

Growth may pass the drafter's own block size up to ``cap`` (a drafter's ``max_block_size``: a draft model
accepting everything at its default 4 does better at 8 and more), but only while the costs measured say the
bigger block returns more tokens per second (``pays_to_grow``); a size whose round was never measured is tried.
``alpha`` is the per-position acceptance estimate (accepted drafts over drafts tried until the first
rejection, over the latest ``window_size`` rounds, or the request's before there are as many) that prices a
block: 1 + alpha + ... + alpha**k tokens a round.

On shape-stable targets (the CUDA policy: a verify costs about the same for 2 or 16 positions, and a shape met
for the first time compiles for seconds) the acceptance-rate rules above hold only until both costs of the
row's shape are measured; from then on the costs decide: a pause when the round loses against the plain
steps it replaces, a smaller block only where its shape was measured and returns more tokens per second
(``decide_by_costs``). A block of 16 accepting 3 drafts a round still triples a plain step's yield there.

An explicit ``block_size`` pins the size (``adaptive=False``). ``history`` holds the size each
round used; the stats report it (``SpecStats.block_sizes``).
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field
from typing import Callable, Deque, List, Optional, Sequence, Tuple

from .costs import CostTable, expected_tokens


def latest(window: Sequence[Tuple[int, int]], enough: int) -> Tuple[int, int]:
    """(accepted, tried) summed over the latest rounds of ``window`` until they tried ``enough`` drafts (or all)."""
    accepted = tried = 0
    for a, t in reversed(window):
        accepted, tried = accepted + a, tried + t
        if tried >= enough:
            break
    return accepted, tried


@dataclass
class Recent:
    """What one target's latest rounds saw, shared by its requests' controllers (``Attachment.recent``; the server's
    warm-up rows, whose drafts are the target's own, neither read nor feed it): the latest pause (0 once a round
    paid) and the drafts accepted and tried over the latest rounds. A new request's first pause goes on from the
    former, and ``alpha``'s prior is the latter's rate, not a fixed guess. Why, measured on an H100 with drafts
    never accepted (oracle tau 1, 256-token requests): each request climbed the backoff again (12, 24, 48, 64
    steps) and, its prior of 4 drafts at ``good_rate`` giving way one rejected draft a round, ran 5 rounds alone and
    9 in a batch of 8 before its first pause: 7 and 14.6 rounds a request, 8 clients at 0.76x plain batching."""

    pause: int = 0
    window: Deque[Tuple[int, int]] = field(default_factory=lambda: collections.deque(maxlen=64))
    window_tried: int = 32  # drafts tried over the latest rounds that ``alpha`` reads
    min_tried: int = 8  # ... and the fewest it takes (a rejected round tries one)
    starts: int = 0  # requests started since the latest round
    plain: int = 0  # ... and the plain steps its requests took since (one a row)
    stale_after: int = 8  # requests past which the next one opens with a probe (``opens_with_probe``)

    def add(self, accepted: int, tried: int) -> None:
        self.window.append((accepted, tried))
        self.starts = self.plain = 0

    def opens_with_probe(self, costs: CostTable, budget: float) -> bool:
        """A request starts: whether it opens with a probe round, which no veto stops. Where this target's latest
        rounds accepted nothing, a new request's estimate is that, its first round is vetoed and its pause is the
        target's (64 steps on a GPU), so requests shorter than that never draft and the estimate never renews:
        speculation would stay off for good after one bad stretch. The next request probes once ``stale_after``
        started with no round since and their plain steps keep the probe's cost within ``budget`` of them at
        ``costs`` (``CostTable.probe_steps``)."""
        self.starts += 1
        if self.window and self.starts > self.stale_after and self.plain >= costs.probe_steps(budget):
            self.starts = self.plain = 0
            return True
        return False

    @property
    def alpha(self) -> Optional[float]:
        """Accepted over tried over the latest rounds that tried ``window_tried`` drafts, or all of them where they
        tried at least ``min_tried`` (None: fewer so far)."""
        accepted, tried = latest(self.window, self.window_tried)
        return accepted / tried if tried >= self.min_tried else None


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
    max_pause: int = 64  # the backoff's cap: longer, a stream whose acceptance recovers stays plain to its end
    probe_budget: float = 0.05  # a probe round costs at most this share of the pause before it
    start: int = 0  # the first rounds' size (0: the cap); the drafter's own block where the cap is above it
    costs: CostTable = field(default_factory=CostTable)  # the target's, shared by its requests (round.py)
    shape: Tuple[int, int] = (1, 0)  # (rows, verify width) of the latest round (width 0: its block size)
    width_for: Callable[[int], int] = lambda n: n  # the verify width a block of n positions takes (the cache policy's)
    accepted_total: int = 0  # drafts accepted over the request's rounds ...
    tried_total: int = 0  # ... and drafts tried up to each round's first rejection
    prior: float = 4.0  # drafts tried at ``prior_rate`` in the request-long estimate
    prior_rate: float = -1.0  # ``shared``'s rate when the request started, else ``good_rate``
    pause: int = 0  # length of the next pause, in plain steps (0: not pausing)
    paused_left: int = 0  # plain steps still to take before the next probe round
    plain_steps: int = 0  # plain steps taken while paused, for the stats
    probing: bool = False  # a pause is over: the next round is its probe
    pause_reason: str = ""  # why the latest pause began, for the stats
    shape_stable: bool = False  # the target's cache policy keeps shapes (CUDA): measured costs decide (above)
    window: List[Tuple[int, int]] = field(default_factory=list)  # (accepted, tried) of the latest rounds
    window_size: int = 64  # rounds kept
    window_tried: int = 32  # drafts tried over the latest rounds that ``alpha`` reads
    shared: Optional[Recent] = None  # the target's latest rounds (None: the request's own alone)
    opening: bool = False  # the first round is a probe the target's stale estimate asked for (``Recent``)
    _good: int = 0

    def __post_init__(self) -> None:
        # Taken when the request starts: rows decoding together do not move each other's estimates.
        rate = self.shared.alpha if self.shared is not None else None
        self.prior_rate = self.good_rate if rate is None else rate
        if self.shared is not None:
            self.pause = self.shared.pause
            self.probing = self.opening = self.shared.opens_with_probe(self.costs, self.probe_budget)
        if self.cap < self.floor:
            self.floor = max(2, self.cap)
        self.size = min(self.cap, self.start) if self.start >= self.floor else self.cap
        self.recent_accepted = float(self.size - 1)
        if self.recent_rate < 0:
            self.recent_rate = self.good_rate

    def next(self) -> int:
        self.history.append(self.size)
        return self.size

    def take_plain_steps(self, limit: Optional[int] = None) -> int:
        """While paused: the plain one-token steps to take now instead of rounds (else 0), at most ``limit``."""
        n = self.paused_left if limit is None else min(limit, self.paused_left)
        self.paused_left -= n
        self._count_plain(n)
        if n and not self.paused_left:
            self.probing = True
        return n

    def end_pause(self) -> None:
        """Probe now: the drafter has a likely proposal (e.g. an n-gram match appeared), the pause's steps left go."""
        if self.paused_left:
            self.paused_left = 0
            self.probing = True

    def skip_probe(self, remaining: int) -> bool:
        """The next round would probe after a pause, with no more tokens left than that pause:
        it could not pay for itself, so the rest are plain steps (``plain_to_end``). A request's opening probe
        (``Recent.opens_with_probe``) runs whatever is left."""
        return self.probing and not self.opening and remaining <= self.pause

    def plain_to_end(self, steps: int) -> int:
        self._count_plain(steps)
        return steps

    def _count_plain(self, steps: int) -> None:
        self.plain_steps += steps
        if self.shared is not None:
            self.shared.plain += steps

    @property
    def alpha(self) -> float:
        """Per-position acceptance estimate: over the latest rounds that tried ``window_tried`` drafts, else over
        the request's rounds with ``prior`` drafts tried at ``prior_rate`` added (the target's recent rate when the
        request started, ``Recent``; else ``good_rate``). Not a fast average: with a weight
        of 1/2 on the newest round, two rejected rounds between good ones halved it and one served row at tau 5.9
        paused 12 times in 30 s (H100). Nor a window of a fixed number of rounds: 8 rounds at tau 3 try ~24 drafts,
        and their estimate fell below break-even often enough that a round worth 1.41x plain ran at 1.17x (the
        controller simulated, block 16, round 2.1 plain steps); over 32 drafts tried it runs at 1.29x."""
        accepted, tried = latest(self.window, self.window_tried)
        if tried >= self.window_tried:
            return accepted / tried
        return (self.accepted_total + self.prior_rate * self.prior) / (self.tried_total + self.prior)

    @property
    def round_seconds(self) -> float:
        """A round of this row's latest shape, as measured (0: not yet)."""
        rows, width = self.shape
        return self.costs.get("round", rows, width or self.size) or 0.0

    @property
    def plain_seconds(self) -> float:
        """A plain step of as many rows, as measured (0: not yet)."""
        return self.costs.get("plain", self.shape[0], 1) or 0.0

    def losing(self) -> bool:
        """Rounds yield fewer tokens per second than plain steps, at the measured costs (this row's share)."""
        r, p = self.round_seconds, self.plain_seconds
        return r > 0 and p > 0 and (1 + self.recent_accepted) * p < r

    def paid(self, accepted: int, rate: float) -> bool:
        """A round that paid for itself: at the measured costs, its tokens took less time than as many plain steps;
        before both are measured, it accepted at least ``good_rate`` of its drafts. (``good_rate`` alone asks 12 of
        15 drafts at block 16, which a round of a tau-6 stream rarely meets, so that a pause's probes kept the dip
        that paused it in the window and each doubled the pause: 169 of 256 tokens plain at tau 3 in simulation.)"""
        r, p = self.round_seconds, self.plain_seconds
        if r > 0 and p > 0:
            return (1 + accepted) * p >= r
        return rate >= self.good_rate

    def pays_to_grow(self, new: int, untried: bool = True) -> bool:
        """Whether blocks of ``new`` positions return more tokens per second than blocks of ``size`` at this
        alpha, at the measured costs of the row's shape (a size never measured: ``untried``)."""
        rows = self.shape[0]
        old_cost = self.costs.get("round", rows, self.width_for(self.size))
        new_cost = self.costs.get("round", rows, self.width_for(new))
        if old_cost is None or new_cost is None:
            return untried
        a = self.alpha
        return expected_tokens(a, new - 1) / new_cost >= expected_tokens(a, self.size - 1) / old_cost

    @property
    def decide_by_costs(self) -> bool:
        """Shape-stable target and both costs of the row's shape measured: the costs decide (module doc)."""
        return self.shape_stable and self.round_seconds > 0 and self.plain_seconds > 0

    def pause_now(self, detail: str = "") -> None:
        """Pause: the batch's round would lose against plain steps at the measured costs (plugin/round.py)."""
        if self.adaptive:
            self._pause("acceptance below break-even: the batch's round yields fewer tokens per second than plain "
                        "steps at the costs measured for its shape" + (f" ({detail})" if detail else ""))

    def _pause(self, reason: str) -> None:
        self.pause_reason = reason
        backoff = min(self.max_pause, self.pause * 2) if self.pause else self.min_pause
        probe_paid = 0
        r, p = self.round_seconds, self.plain_seconds
        if r > 0 and p > 0:
            extra = max(0.0, r / p - 1.0)
            probe_paid = min(4 * self.max_pause, math.ceil(extra / self.probe_budget))
        self.pause = max(backoff, probe_paid)
        self.paused_left = self.pause
        self._good = 0
        if self.shared is not None:
            self.shared.pause = self.pause

    def update(self, accepted: int, draft_tokens: int) -> None:
        probe, self.probing, self.opening = self.probing, False, False
        if not self.adaptive or draft_tokens == 0:
            return
        rate = accepted / draft_tokens
        tried = accepted + (accepted < draft_tokens)
        paid = self.paid(accepted, rate)
        # A probe that paid for itself starts the window afresh: the rounds that paused are history.
        start = [] if probe and paid else self.window
        self.window = (start + [(accepted, tried)])[-self.window_size:]
        self.accepted_total += accepted
        self.tried_total += tried
        if self.shared is not None:
            self.shared.add(accepted, tried)
        self.recent_rate = self.decay * rate + (1 - self.decay) * self.recent_rate
        self.recent_accepted = self.decay * accepted + (1 - self.decay) * self.recent_accepted
        collapsed = self.recent_rate < self.collapse_rate
        if paid:
            self.pause = 0  # the next pause starts short again
            if self.shared is not None:
                self.shared.pause = 0
            self.paused_left = 0  # a paused row drafting in its batch's round (plugin/round.py ``_ride``)
        if self.decide_by_costs:
            self._by_costs(collapsed, accepted, rate)
        elif collapsed and rate < self.collapse_rate and (self.size == self.floor or accepted == 0):
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
        else:
            self._after(rate)

    def _after(self, rate: float) -> None:
        """A round that neither paused nor shrank: a good one ends a pause's backoff and, after ``grow_after`` in a
        row, grows the block one step where that pays."""
        if rate < self.good_rate:
            self._good = 0
            return
        self._good += 1
        if self._good >= self.grow_after and self.size < self.cap:
            new = min(self.cap, self.size + max(1, self.size // 4))
            if self.pays_to_grow(new):
                self.size = new
            self._good = 0

    def _by_costs(self, collapsed: bool, accepted: int, rate: float) -> None:
        # ``alpha`` (the latest rounds, or the request's), not the fast average the acceptance rules use: two rounds
        # accepting nothing between good ones should not pause rounds that pay on average.
        expected = expected_tokens(self.alpha, self.size - 1)
        if expected * self.plain_seconds < self.round_seconds:
            self._pause(f"acceptance below break-even: a round ({1000 * self.round_seconds:.1f} ms) costs more than "
                        f"the {expected:.1f} plain steps it replaces ({1000 * self.plain_seconds:.1f} ms each)")
            return
        if collapsed:
            fit = max(self.floor, 2 * math.ceil(min(self.recent_accepted, accepted)) + 2)
            if fit < self.size and self.pays_to_grow(fit, untried=False):
                self.size = fit
            self._good = 0
        else:
            self._after(rate)
