"""What a round and a plain step cost, by shape, measured once: the adaptive controller's prices.

Why: deciding from a running average of wall-clock times makes a request's tau move with the machine's
load (the same tokens gave tau 3.47 and 4.45 on a busy and an idle CPU), and one slow step (a new shape
compiling, a garbage collection) shifts every later decision. Here each shape has its own entry: a round
of ``rows`` x ``width`` (the verify width; the drafter's work for the same rows included) and a plain step of
``rows``; an entry's price is the least of its observations after the first (which pays for compiling the
shape), once ``trust`` of them were seen: a shape priced by one stalled round (4.4 s for 2 rows x 16 on an
H200) lost to plain steps and so never ran again to correct it. A price only falls: a stall (a key length's
first compile on MLX-CUDA, a busy machine) never raises it, and it settles at what the shape costs on an idle
machine (a median of the first few observations was fixed too early on the GPU, where a server's warm-up sees
a compile in most of them). Rows of a batch share their rounds, so the table belongs to the loaded target
(``Attachment.costs``), not to a request.

``round_loses`` prices a choice: a round whose rows expect ``expected`` tokens in all, against ``rows`` tokens
per plain step; ``batch_loses`` asks it for a batch's round (plugin/round.py vetoes the round where it loses).
``ask_plain`` says when a batch should take a plain step to price its row count (``prices_plain``): rounds alone
never measure one, and without it a row count's rows are left to the acceptance rules.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Sequence, Tuple

if TYPE_CHECKING:
    from .adaptive import BlockSizeController

Key = Tuple[str, int, int]  # ("round" | "plain", rows, width)


@dataclass
class CostTable:
    seen: Dict[Key, int] = field(default_factory=dict)  # observations by shape
    least: Dict[Key, float] = field(default_factory=dict)  # the least observation after the first
    trust: int = 2  # observations after the first before ``least`` prices the shape
    asked: Dict[Key, int] = field(default_factory=dict)  # plain steps taken to price a row count (``ask_plain``)
    max_asks: int = 8  # per row count: a step in which rows joined is not priced, so a few more than trust + 1
    # A target sharded over ranks (hooks/distributed.py): every rank takes rank 0's measurement, so that all decide
    # the same block sizes and pauses. Called at the same observations on every rank.
    agree: Optional[Callable[[float], float]] = None

    def observe(self, kind: str, rows: int, width: int, seconds: float) -> None:
        if self.agree is not None:
            seconds = self.agree(seconds)
        key = (kind, rows, width)
        if seconds <= 0:
            return
        self.seen[key] = self.seen.get(key, 0) + 1
        if self.seen[key] > 1 and seconds < self.least.get(key, float("inf")):  # the first paid for the compile
            self.least[key] = seconds

    def get(self, kind: str, rows: int, width: int) -> Optional[float]:
        """The shape's price (None: fewer than ``trust`` observations past its first)."""
        key = (kind, rows, width)
        return self.least[key] if self.seen.get(key, 0) > self.trust else None

    def ask_plain(self, rows: int) -> bool:
        """Whether a batch of ``rows`` should take a plain step now to price it (counted as asked): its price is not
        known yet and it was asked fewer than ``max_asks`` times. Called at the same steps on every rank."""
        key = ("plain", rows, 1)
        if self.seen.get(key, 0) > self.trust or self.asked.get(key, 0) >= self.max_asks:
            return False
        self.asked[key] = self.asked.get(key, 0) + 1
        return True

    def round_loses(self, rows: int, width: int, expected: float) -> bool:
        """A round of ``rows`` x ``width`` expecting ``expected`` tokens in all yields fewer tokens per second
        than plain steps of those rows, at the costs measured or bounded (``priced``; False while unknown)."""
        got = self.priced(rows, width)
        return got is not None and loses_at(got, rows, expected)

    def priced(self, rows: int, width: int) -> Optional[Tuple[float, float]]:
        """(round of ``rows`` x ``width``, plain step of ``rows``): each shape's price, or where it has none yet the
        nearest priced row count's that bounds it in the round's favour (a step costs no less with more rows): a
        round's from fewer rows, a plain step's from more. None where either has no such bound. Rows join and leave
        a served batch so often that some row counts' rounds are never timed cleanly (``_price`` skips a step rows
        joined in): unpriced, they were never vetoed, and on a CPU, where a round costs dozens of plain steps, a
        4-client tau-1 load ran 64 of them in 8 s."""
        r = self._nearest("round", rows, width, fewer=True)
        p = self._nearest("plain", rows, 1, fewer=False)
        return None if r is None or p is None else (r, p)

    def probe_steps(self, budget: float) -> float:
        """Plain steps (one a row) that a probe round, costing what it costs over a plain step of its rows, takes at
        most ``budget`` of: the most over the priced rounds (0 where none is priced)."""
        most = 0.0
        for kind, rows, width in list(self.least):
            r, p = self.get(kind, rows, width), self._nearest("plain", rows, 1, fewer=False)
            if kind == "round" and r is not None and p:
                most = max(most, (r / p - 1.0) * rows / budget)
        return most

    def _nearest(self, kind: str, rows: int, width: int, fewer: bool) -> Optional[float]:
        """The price of the priced row count nearest ``rows`` (itself included) on the side ``fewer`` says."""
        near = [n for (k, n, w) in self.least if k == kind and w == width and (n <= rows if fewer else n >= rows)
                and self.get(k, n, w) is not None]
        return self.get(kind, max(near) if fewer else min(near), width) if near else None

    def report(self) -> Dict[str, float]:
        return {f"{k}:{b}x{w}": round(v * 1e3, 3) for (k, b, w), v in sorted(self.least.items())
                if self.seen[(k, b, w)] > self.trust}


def loses_at(prices: Tuple[float, float], rows: int, expected: float) -> bool:
    """A round yielding ``expected`` tokens yields fewer per second than plain steps of ``rows``, at ``prices``
    (round, plain step)."""
    return expected / prices[0] < rows / prices[1]


def expected_tokens(alpha: float, drafts: int) -> float:
    """Tokens a round emits for a row verifying ``drafts`` draft tokens accepted each with probability ``alpha``
    (the first rejection ends the run), the bonus included: 1 + alpha + ... + alpha**drafts."""
    if drafts <= 0:
        return 1.0
    if alpha >= 1.0:
        return float(drafts + 1)
    return (1.0 - alpha ** (drafts + 1)) / (1.0 - alpha)


def prices_plain(batch: Any, costs: CostTable, controllers: Sequence["BlockSizeController"]) -> bool:
    """Whether this step of ``batch`` (a ``DecodeBatch``) is a plain step taken to price a plain step of its row
    count (``CostTable.ask_plain``).

    On shape-stable targets the measured costs decide (plugin/adaptive.py), but only rows that pause make plain
    steps the plugin answers, so a row count whose rows all drafted had no plain price and its rows followed the
    acceptance rules: at tau 6 (a third of 15 drafts accepted, below a quarter over a few rounds often enough) they
    halved 4- and 8-row blocks, tau fell to 4.5 and 8 clients ran at 1.76x plain batching on an H100. A few plain
    steps per row count, once per loaded target (the server's warm-up takes them), price it instead."""
    if not batch.target.cache_policy.shape_stable or not all(c.adaptive for c in controllers):
        return False
    return costs.ask_plain(len(batch.rows))


def batch_loses(batch: Any, costs: CostTable, controllers: Sequence["BlockSizeController"],
                plans: Sequence[Optional[int]]) -> str:
    """Why a round of ``batch`` would yield fewer tokens per second than plain steps of it, at the costs measured
    for its shape and each drafting row's acceptance (``plans``: the drafts each row proposes, None or 0: none; rows
    that draft nothing yield their one token either way); "" where it would not."""
    drafting = [(c, k) for c, k in zip(controllers, plans) if k]
    if not all(c.adaptive for c, _ in drafting):
        return ""  # a pinned block is the user's choice
    if any(c.probing for c, _ in drafting):
        # A pause's probe is what renews the acceptance estimate; vetoed on the estimate that paused it, the row
        # paused again, doubling, and stayed plain to its end (254 of 256 tokens at tau 5.9, one client, H100).
        return ""
    rows = len(batch.rows)
    width = batch.target.cache_policy.verify_width(1 + max(k or 0 for k in plans))
    expected = rows - len(drafting) + sum(expected_tokens(c.alpha, k) for c, k in drafting)
    priced = costs.priced(rows, width)
    if priced is None or not loses_at(priced, rows, expected):
        return ""
    r, p = priced
    return f"{rows}x{width} round {1e3 * r:.1f} ms for {expected:.1f} tokens, plain step {1e3 * p:.1f} ms"
