"""Speculative-decoding statistics: per request (``SpecStats``) and process-wide (``METRICS``).

Names follow vLLM's spec_decode counters so that users' dashboards carry over; the server shows
them through the ``host_metrics`` hook.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional

from ..hooks.api import DecodeReport, Metric, PlainTokens
from .accept import RoundOutcome


# A round's steps in order (plugin/round.py), each timed from the end of the one before: wall clock on the host,
# nothing synchronised on top, so a step that waits for the device (``read``: the verify's outcome) shows it.
ROUND_STEPS = ("draft", "adopt", "verify", "plan", "draft_ahead", "queue", "read", "commit", "commit_drafter", "settle")
# The phases the stats (``SpecStats.seconds``) and the adaptive controller (drafting and verifying) time a round by.
PHASES = {"draft": ("draft",), "verify": ("adopt", "verify", "plan", "draft_ahead", "queue", "read", "commit"),
          "commit": ("commit_drafter",)}


class Laps:
    """Seconds of a round's steps (``ROUND_STEPS``), each from the end of the one timed before."""

    def __init__(self) -> None:
        self.last = time.perf_counter()
        self.seconds: Dict[str, float] = {}

    def __call__(self, step: str) -> None:
        assert step in ROUND_STEPS, step
        now = time.perf_counter()
        self.seconds[step] = self.seconds.get(step, 0.0) + now - self.last
        self.last = now

    @contextmanager
    def phase(self, step: str) -> Iterator[None]:
        """Lap ``step`` where the block ends (also where it raises); the time before the block counts too."""
        try:
            yield
        finally:
            self(step)

    def total(self, *steps: str) -> float:
        return sum(self.seconds.get(s, 0.0) for s in steps)


def _bucket(accepted: int, drafted: int) -> str:
    return "zero" if accepted == 0 else "full" if accepted == drafted else "partial"


@dataclass
class SpecStats:
    kind: str
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: List[int] = field(default_factory=list)
    block_sizes: List[int] = field(default_factory=list)
    # rounds whose drafts were all rejected / partly accepted / all accepted
    rounds_by_acceptance: Dict[str, int] = field(default_factory=lambda: {"zero": 0, "partial": 0, "full": 0})
    plain_steps: int = 0  # one-token steps the host took while the request drafted (pauses, nothing to draft)
    round_tokens: int = 0  # tokens the rounds emitted (accepted + bonus), those past the request's end left out
    generated: int = 0  # the request's tokens, set when it ends (``finish``)
    paused_steps: int = 0  # plain steps the adaptive controller paused for (plugin/adaptive.py)
    fallback_tokens: int = 0  # tokens after the drafter failed
    pause_reason: str = ""  # why its latest pause began
    verified_ahead: int = 0  # rounds whose verify forward the round before had queued (plugin/cuda/verify_ahead.py)
    fallback: Optional[str] = None  # why the request fell back to plain decoding, if it did
    steps: Dict[str, float] = field(default_factory=dict)  # seconds in each of ``ROUND_STEPS``, summed over rounds
    last: Optional[RoundOutcome] = None  # the latest round, until the request ends

    def record(self, outcome: RoundOutcome) -> None:
        self.rounds += 1
        self.round_tokens += outcome.emitted
        self.draft_tokens += outcome.draft_tokens
        self.accepted_tokens += outcome.accepted
        if len(self.accepted_per_position) < outcome.draft_tokens:
            self.accepted_per_position += [0] * (outcome.draft_tokens - len(self.accepted_per_position))
        for i in range(outcome.accepted):
            self.accepted_per_position[i] += 1
        self.rounds_by_acceptance[_bucket(outcome.accepted, outcome.draft_tokens)] += 1
        self.last = outcome
        METRICS.record(outcome)

    def truncate_last(self, discarded: int) -> None:
        """The request ended inside its latest round: ``discarded`` of its emitted tokens were not
        used (a stop token or max_tokens came first). The round counts as if it had drafted only up to the
        request's end: its last used token the bonus, the drafts before it drafted (and accepted where they were),
        the drafts after it neither (a block keeps its size up to the end on shape-stable caches: round.py)."""
        o = self.last
        if o is None or discarded <= 0:
            return
        self.round_tokens -= min(discarded, o.emitted)
        inside = max(0, o.emitted - discarded - 1)  # draft positions before the last used token
        cut, cut_drafts = o.accepted - min(o.accepted, inside), o.draft_tokens - min(o.draft_tokens, inside)
        if cut <= 0 and cut_drafts <= 0:
            return
        self.accepted_tokens -= cut
        self.draft_tokens -= cut_drafts
        for i in range(o.accepted - cut, o.accepted):
            self.accepted_per_position[i] -= 1
        self.rounds_by_acceptance[_bucket(o.accepted, o.draft_tokens)] -= 1
        self.rounds_by_acceptance[_bucket(o.accepted - cut, o.draft_tokens - cut_drafts)] += 1
        METRICS.unrecord(o, cut, cut_drafts)

    def finish(self, generated: int, fallback_tokens: int, paused_steps: int, pause_reason: str) -> None:
        self.generated, self.fallback_tokens = generated, fallback_tokens
        self.paused_steps, self.pause_reason = paused_steps, pause_reason

    @property
    def plain_tokens(self) -> PlainTokens:
        """The request's tokens that came from one-token steps, by why: ``paused`` (the adaptive controller
        found rounds below break-even), ``fallback`` (after the drafter failed), ``other`` (the prefill's
        first token, steps with nothing left to draft)."""
        plain = max(0, self.generated - self.round_tokens)
        fallback = min(self.fallback_tokens, plain)
        paused = min(self.paused_steps, plain - fallback)
        return PlainTokens(paused=paused, fallback=fallback, other=plain - paused - fallback)

    @property
    def mean_acceptance_length(self) -> float:
        """tau: tokens emitted per round, the bonus included."""
        return 1.0 + self.accepted_tokens / self.rounds if self.rounds else 0.0

    @property
    def seconds(self) -> Dict[str, float]:
        """Seconds in each of ``PHASES`` (draft, verify, commit), summed over rounds."""
        return {phase: sum(self.steps.get(s, 0.0) for s in group) for phase, group in PHASES.items()}

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    def report(self) -> DecodeReport:
        """The request's report for the host (``state.report[NAME]``), as it stands now."""
        return DecodeReport(
            kind=self.kind, rounds=self.rounds, draft_tokens=self.draft_tokens, accepted_tokens=self.accepted_tokens,
            mean_acceptance_length=self.mean_acceptance_length, acceptance_rate=self.acceptance_rate,
            accepted_per_position=list(self.accepted_per_position), rounds_by_acceptance=dict(self.rounds_by_acceptance),
            block_sizes=list(self.block_sizes), plain_steps=self.plain_steps, round_tokens=self.round_tokens,
            plain_tokens=self.plain_tokens, generated=self.generated, pause_reason=self.pause_reason or None,
            verified_ahead=self.verified_ahead, fallback=self.fallback, seconds=self.seconds,
            steps={k: self.steps[k] for k in ROUND_STEPS if k in self.steps},
        )

    def to_dict(self) -> Dict[str, Any]:
        return self.report().to_dict()

    def record_steps(self, laps: Laps, *steps: str) -> None:
        """``steps`` of a round's ``laps`` (all where none are named) into ``steps``."""
        for k in steps or tuple(laps.seconds):
            if k in laps.seconds:
                self.steps[k] = self.steps.get(k, 0.0) + laps.seconds[k]


class Metrics:
    """Process-wide counters (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos: Dict[int, int] = {}
        self.fallbacks = 0
        self.verify_forwards = 0  # verify forwards (one per round, for every row of its batch)
        self.verify_positions = 0  # their rows' real positions: each row's pending token and its drafts
        self.verify_slots = 0  # their rows x width: the real positions and the filler after shorter rows

    def record(self, outcome: RoundOutcome) -> None:
        with self._lock:
            self.num_drafts += 1
            self.num_draft_tokens += outcome.draft_tokens
            self.num_accepted_tokens += outcome.accepted
            for i in range(outcome.draft_tokens):
                self.accepted_per_pos[i] = self.accepted_per_pos.get(i, 0) + (1 if i < outcome.accepted else 0)

    def unrecord(self, outcome: RoundOutcome, cut: int, cut_drafts: int = 0) -> None:
        """The last ``cut`` accepted tokens of ``outcome`` were not used after all, nor its last ``cut_drafts``
        draft tokens (past the request's end)."""
        with self._lock:
            self.num_accepted_tokens -= cut
            self.num_draft_tokens -= cut_drafts
            for i in range(outcome.accepted - cut, outcome.accepted):
                self.accepted_per_pos[i] -= 1

    def record_verify(self, positions: int, slots: int) -> None:
        with self._lock:
            self.verify_forwards += 1
            self.verify_positions += positions
            self.verify_slots += slots

    def record_fallback(self) -> None:
        with self._lock:
            self.fallbacks += 1

    def snapshot(self) -> Dict[str, Any]:
        with self._lock:
            return {
                "spec_decode_num_drafts_total": self.num_drafts,
                "spec_decode_num_draft_tokens_total": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens_total": self.num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos_total": dict(self.accepted_per_pos),
                "spec_decode_fallbacks_total": self.fallbacks,
                "mlx_spec_verify_forwards_total": self.verify_forwards,
                "mlx_spec_verify_positions_total": self.verify_positions,
                "mlx_spec_verify_slots_total": self.verify_slots,
            }

    def prometheus(self) -> List[Metric]:
        snap = self.snapshot()
        per_pos = snap["spec_decode_num_accepted_tokens_per_pos_total"]
        return [
            Metric("spec_decode_num_drafts_total", "counter", "Speculative rounds (drafts verified).",
                   [("", snap["spec_decode_num_drafts_total"])]),
            Metric("spec_decode_num_draft_tokens_total", "counter", "Draft tokens proposed and verified.",
                   [("", snap["spec_decode_num_draft_tokens_total"])]),
            Metric("spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted (and used).",
                   [("", snap["spec_decode_num_accepted_tokens_total"])]),
            Metric("spec_decode_num_accepted_tokens_per_pos_total", "counter",
                   "Draft tokens accepted, by position in the block.",
                   [(f'{{position="{i}"}}', per_pos[i]) for i in sorted(per_pos)]),
            Metric("spec_decode_fallbacks_total", "counter", "Drafter failures mid-request (plain decoding after).",
                   [("", snap["spec_decode_fallbacks_total"])]),
            Metric("mlx_spec_verify_forwards_total", "counter", "Verify forwards (one per round for all its rows).",
                   [("", snap["mlx_spec_verify_forwards_total"])]),
            Metric("mlx_spec_verify_positions_total", "counter",
                   "Positions the verify forwards checked: each row's pending token and its draft tokens.",
                   [("", snap["mlx_spec_verify_positions_total"])]),
            Metric("mlx_spec_verify_slots_total", "counter",
                   "Rows x width of the verify forwards: the positions and the filler after shorter rows.",
                   [("", snap["mlx_spec_verify_slots_total"])]),
        ]


METRICS = Metrics()
