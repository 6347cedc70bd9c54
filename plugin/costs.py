"""What a round and a plain step cost, by shape, measured once: the adaptive controller's prices.

Why: deciding from a running average of wall-clock times makes a request's tau move with the machine's
load (the same tokens gave tau 3.47 and 4.45 on a busy and an idle CPU), and one slow step (a new shape
compiling, a garbage collection) shifts every later decision. Here each shape has its own entry: a round
of ``rows`` x ``width`` (the verify width; the drafter's work for the same rows included) and a plain step of
``rows``; an entry takes the median of its first ``samples`` observations after the first (which pays for
compiling the shape) and is then fixed. Rows of a batch share their rounds, so the table belongs to the
loaded target (``Attachment.costs``), not to a request.

``tokens_per_second`` prices a choice: a round whose rows expect ``expected`` tokens in all, against
``rows`` tokens per plain step.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

Key = Tuple[str, int, int]  # ("round" | "plain", rows, width)


@dataclass
class CostTable:
    samples: int = 5  # observations an entry takes (after the first) before it is fixed
    seen: Dict[Key, List[float]] = field(default_factory=dict)
    fixed: Dict[Key, float] = field(default_factory=dict)

    def observe(self, kind: str, rows: int, width: int, seconds: float) -> None:
        key = (kind, rows, width)
        if key in self.fixed or seconds <= 0:
            return
        got = self.seen.setdefault(key, [])
        got.append(seconds)
        if len(got) > self.samples:  # the first paid for the shape's compile
            self.fixed[key] = statistics.median(got[1:])
            del self.seen[key]

    def get(self, kind: str, rows: int, width: int) -> Optional[float]:
        """The shape's cost: fixed, else the median of what was seen after the first (None: nothing yet)."""
        key = (kind, rows, width)
        if key in self.fixed:
            return self.fixed[key]
        got = self.seen.get(key)
        return statistics.median(got[1:]) if got and len(got) > 1 else None

    def round_loses(self, rows: int, width: int, expected: float) -> bool:
        """A round of ``rows`` x ``width`` expecting ``expected`` tokens in all yields fewer tokens per second
        than plain steps of those rows, at the costs measured (False while either is unknown)."""
        r, p = self.get("round", rows, width), self.get("plain", rows, 1)
        if r is None or p is None:
            return False
        return expected / r < rows / p

    def report(self) -> Dict[str, float]:
        out = {f"{k}:{b}x{w}": round(v * 1e3, 3) for (k, b, w), v in sorted(self.fixed.items())}
        out.update({f"{k}:{b}x{w} (so far)": round(self.get(k, b, w) * 1e3, 3) for (k, b, w) in sorted(self.seen)})
        return out


def expected_tokens(alpha: float, drafts: int) -> float:
    """Tokens a round emits for a row verifying ``drafts`` draft tokens accepted each with probability ``alpha``
    (the first rejection ends the run), the bonus included: 1 + alpha + ... + alpha**drafts."""
    if drafts <= 0:
        return 1.0
    if alpha >= 1.0:
        return float(drafts + 1)
    return (1.0 - alpha ** (drafts + 1)) / (1.0 - alpha)
