"""What a drafter family provides. Built-in and third-party families implement the same classes.

A *family* is a checkpoint architecture (or a weightless rule) mapped to one *kind* (the round
loop it runs). A family module exposes a ``DrafterFamily`` object and registers it under the
entry-point group ``mlx_speculative.drafters``::

    [project.entry-points."mlx_speculative.drafters"]
    my_family = "my_package:family"

A loaded ``Drafter`` drafts for the rows of a batch through a ``DraftBatch``. Drafters whose rows
are independent (a lookup rule, a table) implement only ``new_session`` (one ``DraftSession`` per
request) and get the batch for free (``SessionBatch``); drafters with a forward implement
``new_batch`` so that one drafter forward serves every row.

Terms, used everywhere in this project:
- **round**: draft a block, verify it with one ordinary forward of the target, accept, commit.
- **block size B**: positions verified per round: the pending token plus up to B-1 draft tokens.
- **draft tokens**: the drafter's proposals in a round (k <= B-1 of them).
- **accepted**: draft tokens the target agrees with (greedy: equal to its argmax; sampling: kept
  by rejection sampling, or equal to its sample under ``acceptance: exact``).
- **bonus**: the one target token emitted after the accepted prefix (the correction at the first
  rejection, or the next token after a fully accepted block). A round emits accepted + 1 tokens.
- **mean acceptance length** tau = tokens emitted per round = 1 + accepted / rounds (bonus included).
- **acceptance rate** = accepted / draft tokens.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import mlx.core as mx

from ..hooks.api import DraftBackend


class DrafterError(ValueError):
    """A drafter that cannot be used; the message names the field, the value and what was expected."""


@dataclass
class Proposal:
    """A drafter's proposal for one row in one round."""

    # The k draft tokens: ints, or a [k] integer array that may still be unevaluated (the round
    # then queues its verify behind the drafter's kernels and checks the tokens afterwards).
    tokens: Union[List[int], mx.array]
    # [k, V] log-probabilities the tokens were drawn from (q in the papers); None = one-hot q.
    logprobs: Optional[mx.array] = None


@dataclass
class Verified:
    """What a round committed for one row, handed to the drafter's ``commit``."""

    accepted: int  # draft tokens kept
    drafted: int  # draft tokens proposed (k)
    # layer -> [1, accepted + 1, H]: the target's outputs at the committed positions (the pending
    # token and the accepted drafts), for the layers the drafter captures.
    captures: Dict[int, mx.array] = field(default_factory=dict)
    # (layer -> [B, W, H]: the round's whole verify outputs, this row's index in them): the same values, for a
    # drafter that takes a batch's rows in one go instead of one slice each.
    source: Optional[Tuple[Dict[int, mx.array], int]] = None


@dataclass
class Unread:
    """A round's outcome for the drafter's rows while the host has not read it yet: what a drafter may draft the
    next round from (``DraftBatch.draft_ahead``) while the device still verifies. Row b is the drafter's row b."""

    accepted: mx.array  # [B] int32: a_b, leading draft tokens kept (the host learns them after the drafting is queued)
    bonus: mx.array  # [B] uint32: each row's bonus, its next round's pending token
    # layer -> [B, W, H]: the target's outputs at every position the verify fed; row b keeps its first a_b + 1.
    captures: Dict[int, mx.array] = field(default_factory=dict)


@dataclass
class DraftTarget:
    """What a family may read of the target to check and attach a drafter."""

    config: Dict[str, Any]
    path: Optional[Path] = None
    model: Any = None  # the loaded mlx-lm model, when loading (None for config-only checks)
    tokenizer: Any = None
    num_layers: Optional[int] = None
    # What a drafter may use of the target's backend (hooks/backend.py): its own models' caches
    # (``backend.kv_cache``, shape-stable like the target's where the backend's are), prewarm bounds,
    # compiled calls, and ``backend.route(model)`` for its models' attention and projections.
    backend: DraftBackend = field(default_factory=DraftBackend)


@dataclass
class Compatibility:
    """A family's verdict on a drafter for a target, with one reason per checked field."""

    ok: bool = True
    reasons: List[str] = field(default_factory=list)  # why it is incompatible
    notes: List[str] = field(default_factory=list)  # what was checked and matched

    def fail(self, reason: str) -> None:
        self.ok = False
        self.reasons.append(reason)


@dataclass
class DraftState:
    """A row's drafting state for its first ``positions`` tokens (``row.tokens[:positions]``),
    kept by the server's prompt cache across requests (``DraftBatch.export_row`` / ``restore_row``).

    ``value`` is the family's own; it never changes after ``export_row`` returns it (a restore
    copies what it will write: ``hooks.prompt_cache.copy_caches``). ``nbytes``: the memory it holds,
    counted against ``server.prompt_cache_bytes``.
    """

    positions: int
    value: Any
    nbytes: int = 0


class DraftSession(abc.ABC):
    """One request's drafting state, for drafters whose rows are independent."""

    @abc.abstractmethod
    def propose(self, state: Any, max_drafts: int) -> Proposal:
        """Up to ``max_drafts`` draft tokens to follow ``state.tokens`` (which end in the pending token)."""

    def caches(self) -> List[Any]:
        """The session's own caches; the round rolls them back with the round."""
        return []

    def commit(self, state: Any, verified: Verified) -> int:
        """After verification: how many of the positions this round wrote into ``caches()`` stay."""
        return 0

    def worth_probing(self, state: Any) -> bool:
        """``DraftBatch.worth_probing`` for this request (False by default)."""
        return False


class DraftBatch(abc.ABC):
    """The drafting state of the rows of one batch (``hooks.batch.DecodeBatch``) using one drafter.

    Per round the plugin calls, in this order: ``sync`` (every decode step, with the rows now
    drafting), ``prepare`` (catch up with committed tokens: kept whatever the round decides),
    ``propose`` (inside a cache transaction over ``cache_groups()``), ``draft_ahead`` (optional:
    the next round's drafting, queued before the host reads this round's outcome; then ``ahead_drafts``
    where the round also queues the next verify), then ``commit``
    with what the round kept. An exception anywhere rolls the round back and the rows decode plainly.
    """

    forwards = 0  # drafter forwards run so far (one per draft step for all rows)
    # True: each drafter forward drafts every row of the batch (the most drafts any row asks for), so a row drafting
    # no more than the others costs the drafter nothing (plugin/round.py ``_ride``). False: per-row work.
    rows_draft_together = False

    @abc.abstractmethod
    def sync(self, rows: Sequence[Any]) -> None:
        """These rows (``DecodeState``s, in batch order) draft from now on: rows not seen before
        join, rows gone leave. Reads what the host handed over this step (``row.captures``)."""

    def prepare(self, rows: Sequence[Any]) -> None:
        """Feed what was committed since the rows last drafted (nothing by default)."""

    @abc.abstractmethod
    def propose(self, rows: Sequence[Any], max_drafts: Sequence[int]) -> List[Proposal]:
        """One proposal per row, at most ``max_drafts[b]`` tokens each (0: none)."""

    def cache_groups(self) -> List[Tuple[List[Any], List[int]]]:
        """(caches, indices of the rows they hold) that ``propose`` writes; rolled back with the round."""
        return []

    def commit(self, rows: Sequence[Any], verified: Sequence[Verified]) -> List[int]:
        """Per row: positions of ``propose``'s writes to its caches that stay (0 by default)."""
        return [0] * len(rows)

    def worth_probing(self, row: Any) -> bool:
        """Whether a row the adaptive controller paused (its drafts were not paying) is likely to draft well now,
        told without drafting (e.g. an n-gram match appeared in its tokens): it then probes at once instead of
        waiting out its pause, and is asked every few plain steps while paused. False by default."""
        return False

    def drafts_ahead(self, rows: Sequence[Any]) -> bool:
        """Whether ``draft_ahead`` may draft for these rows this round (the round then computes their outcomes
        on the device for it). False by default."""
        return False

    def draft_ahead(self, rows: Sequence[Any], unread: Unread, max_drafts: Sequence[int]) -> None:
        """Optional: queue the next round's drafting now, after the verify and before the host reads its
        outcome, so that the device drafts while the host commits, emits and builds the next verify.

        Called after ``propose`` with the same rows (``max_drafts[b]`` 0: row b drafted nothing; its
        outcome in ``unread`` is then 0 accepted and its one token as the bonus) and before ``commit``. Whatever it writes to its caches must stay invisible until the next
        ``prepare``/``propose`` take it up, and those must check that the rows are what it assumed (the
        same rows, nothing fed in between, the outcome the host read, no more than ``max_drafts``
        tokens wanted) and otherwise draft as usual. Nothing by default."""

    def ahead_drafts(self, rows: Sequence[Any], unread: Unread) -> Optional[List[mx.array]]:
        """After ``draft_ahead``: per row, the draft tokens [k] (on the device, unevaluated) that the next
        ``propose`` will serve if the outcome is ``unread``'s, so that the round can queue the next verify
        over them (plugin/cuda/verify_ahead.py; the next round checks them against what ``propose`` serves).
        None (the default): nothing drafted ahead."""
        return None

    # The server's prompt cache (optional; the defaults keep nothing) ---------------------------
    def export_row(self, row: Any, positions: int) -> Optional[DraftState]:
        """A copy of ``row``'s drafting state (a row of this batch, or one restored into it that
        has not drafted yet) for at most its first ``positions`` tokens, evaluated and unchanged by
        later rounds; None: nothing worth keeping (the default). Between rounds: what the host
        handed over since the last step (``row.captures``) belongs to the row's state too."""
        return None

    def restore_row(self, row: Any, saved: DraftState, n: int) -> bool:
        """Before ``sync`` first sees ``row``, whose target caches were restored with its first n
        tokens (``row.cached``; captures cover only the positions after them): start its state
        from ``saved`` (this family's ``export_row`` for the same tokens) trimmed to those n
        tokens, leaving ``saved`` unchanged. False (the default): nothing restored; ``sync`` takes
        the row as new and the family derives its state from ``row.tokens``. A family that reads
        captures must restore: the host reuses only positions its saved state covers. State that
        also depends on the token after a position (EAGLE-3's and the MTP heads' entries: position
        t's features with token t + 1) is kept with what re-makes it for a row whose token n differs
        (``drafters/feature_log.py``). A family that reads captures but needs none restored (the
        Gemma 4 assistant) exports a state of no bytes covering its positions."""
        return False


class SessionBatch(DraftBatch):
    """Rows drafting one at a time through per-request ``DraftSession``s."""

    def __init__(self, drafter: "Drafter"):
        self.drafter = drafter
        self.sessions: Dict[int, DraftSession] = {}  # id(row) -> session
        self.rows: List[Any] = []

    def sync(self, rows: Sequence[Any]) -> None:
        keep = {id(r) for r in rows}
        self.sessions = {k: s for k, s in self.sessions.items() if k in keep}
        for row in rows:
            if id(row) not in self.sessions:
                self.sessions[id(row)] = self.drafter.new_session(row)
        self.rows = list(rows)

    def propose(self, rows: Sequence[Any], max_drafts: Sequence[int]) -> List[Proposal]:
        return [self.sessions[id(r)].propose(r, m) if m > 0 else Proposal([]) for r, m in zip(rows, max_drafts)]

    def cache_groups(self) -> List[Tuple[List[Any], List[int]]]:
        return [(self.sessions[id(r)].caches(), [b]) for b, r in enumerate(self.rows) if self.sessions[id(r)].caches()]

    def commit(self, rows: Sequence[Any], verified: Sequence[Verified]) -> List[int]:
        return [self.sessions[id(r)].commit(r, v) for r, v in zip(rows, verified)]

    def worth_probing(self, row: Any) -> bool:
        session = self.sessions.get(id(row))
        return session is not None and session.worth_probing(row)


class ForwardingDraftBatch(DraftBatch):
    """Another ``DraftBatch`` (``inner``), wrapped: every method is the inner batch's, and a subclass overrides only
    what it changes (e.g. a benchmark's oracle replaces the proposals after the drafter really ran)."""

    def __init__(self, inner: DraftBatch):
        self.inner = inner

    @property
    def forwards(self) -> int:  # type: ignore[override]
        return self.inner.forwards

    @property
    def rows_draft_together(self) -> bool:  # type: ignore[override]
        return self.inner.rows_draft_together

    def sync(self, rows: Sequence[Any]) -> None:
        self.inner.sync(rows)

    def prepare(self, rows: Sequence[Any]) -> None:
        self.inner.prepare(rows)

    def propose(self, rows: Sequence[Any], max_drafts: Sequence[int]) -> List[Proposal]:
        return self.inner.propose(rows, max_drafts)

    def cache_groups(self) -> List[Tuple[List[Any], List[int]]]:
        return self.inner.cache_groups()

    def commit(self, rows: Sequence[Any], verified: Sequence[Verified]) -> List[int]:
        return self.inner.commit(rows, verified)

    def worth_probing(self, row: Any) -> bool:
        return self.inner.worth_probing(row)

    def drafts_ahead(self, rows: Sequence[Any]) -> bool:
        return self.inner.drafts_ahead(rows)

    def draft_ahead(self, rows: Sequence[Any], unread: Unread, max_drafts: Sequence[int]) -> None:
        self.inner.draft_ahead(rows, unread, max_drafts)

    def ahead_drafts(self, rows: Sequence[Any], unread: Unread) -> Optional[List[mx.array]]:
        return self.inner.ahead_drafts(rows, unread)

    def export_row(self, row: Any, positions: int) -> Optional[DraftState]:
        return self.inner.export_row(row, positions)

    def restore_row(self, row: Any, saved: DraftState, n: int) -> bool:
        return self.inner.restore_row(row, saved, n)


class Drafter(abc.ABC):
    """A loaded drafter, shared by every request on one target."""

    kind: str = ""
    family: str = ""
    default_block_size: int = 4
    # Adaptive blocks may grow past the default up to this while the measured costs say it pays (None: the
    # default is the most: e.g. a DFlash drafter drafts the block it was trained for).
    max_block_size: Optional[int] = None

    def capture_layers(self) -> List[int]:
        """Target decoder layers whose outputs this drafter reads (0-based: layer i's output)."""
        return []

    def new_session(self, state: Any) -> DraftSession:
        """Per-request drafting state (drafters whose rows are independent)."""
        raise NotImplementedError(f"{type(self).__name__} drafts through new_batch()")

    def new_batch(self) -> DraftBatch:
        """Drafting state for the rows of one batch; default: one ``new_session`` per row."""
        return SessionBatch(self)


@dataclass
class DrafterFamily:
    """A registered family. ``detect`` decides from config.json alone whether a checkpoint is one."""

    name: str
    kind: str
    description: str
    load: Callable[[Optional[Path], Dict[str, Any], DraftTarget, Dict[str, Any]], Drafter]
    check: Callable[[Optional[Path], Dict[str, Any], DraftTarget], Compatibility]
    detect: Callable[[Dict[str, Any]], bool] = lambda config: False
    needs_weights: bool = True
    # Higher wins when several families detect the same config (generic draft LMs are lowest).
    priority: int = 0
    distribution: str = ""  # filled by the registry: the package it came from
    trainer: Optional[Callable[[], Any]] = None  # the family's FamilyTrainer class (drafters/training), lazily
    # What of this family a target's own checkpoint can carry (vLLM's ``method: mtp``): a run naming the
    # family's kind and no draft model uses the target's checkpoint when ``detect`` accepts the target's
    # config. Empty: never inside a target (a draft LM the target could "be" is no drafter of its own).
    in_target: str = ""
