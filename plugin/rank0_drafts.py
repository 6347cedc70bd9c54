"""``distributed: {drafter: rank0}``: the drafter runs on rank 0 alone and every round's proposals are broadcast.

Every rank must verify the same drafts: rank 0 drafts, then one broadcast (``all_sum`` of a tensor that is zero on
the other ranks) carries, as int32, [status, has_q, k_0 .. k_{B-1}, q_0 .. q_{B-1} (row b has q), the B x K draft tokens, zero-padded] where K is
the round's most drafts a row may propose (the same on every rank: the block sizes are decided identically); a
second one carries the drafts' log-probabilities q [B, K, V] (float32) where the drafter gave them (sampling).
Every rank, rank 0 included, verifies the broadcast values, so the acceptance is computed from the same bits.

A drafter failure on rank 0 (in ``sync``, ``prepare``, ``propose`` or ``commit``) is held until the next
``propose`` and sent as status 1: every rank then raises there and the rows fall back to plain decoding together.
Drafting ahead and ``worth_probing`` (decisions only rank 0 could make) are off.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import mlx.core as mx

from ..drafters.base import DraftBatch, Drafter, Proposal, Verified
from .draft import DraftError

OK, FAILED = 0, 1


class Rank0Drafts(DraftBatch):
    """The rows' drafting: the real ``DraftBatch`` on rank 0 (``inner``), proposals received elsewhere."""

    def __init__(self, inner: Optional[DraftBatch], cluster: Any):
        self.inner = inner if cluster.primary else None
        self.cluster = cluster
        self.error: Optional[BaseException] = None  # rank 0's drafter failed: sent at the next propose
        if self.inner is not None and hasattr(self.inner, "replay_group"):
            self.replay_group = self.inner.replay_group  # rolls its caches back like the real batch's

    @property
    def forwards(self) -> int:  # type: ignore[override]
        return self.inner.forwards if self.inner is not None else 0

    def _held(self, call: Any, *args: Any) -> Any:
        if self.inner is None or self.error is not None:
            return None
        try:
            return call(*args)
        except Exception as e:  # noqa: BLE001 - every rank learns of it at the next propose
            self.error = e
            return None

    def sync(self, rows: Sequence[Any]) -> None:
        self._held(lambda: self.inner.sync(rows))

    def prepare(self, rows: Sequence[Any]) -> None:
        self._held(lambda: self.inner.prepare(rows))

    def cache_groups(self) -> List[Tuple[List[Any], List[int]]]:
        return self.inner.cache_groups() if self.inner is not None and self.error is None else []

    def propose(self, rows: Sequence[Any], max_drafts: Sequence[int]) -> List[Proposal]:
        B, K = len(rows), max(max_drafts, default=0)
        mine: Optional[List[Proposal]] = None
        if self.inner is not None and self.error is None:
            mine = self._held(lambda: self.inner.propose(rows, max_drafts))
            if mine is not None and len(mine) != B:
                self.error = DraftError(f"the drafter returned {len(mine)} proposals for {B} rows")
        header = [FAILED if (self.cluster.primary and self.error is not None) else OK, 0] + [0] * (2 * B)
        parts: List[mx.array] = []
        if self.cluster.primary and self.error is None and mine is not None:
            header[1] = int(any(p.logprobs is not None for p in mine))
            for b, (p, m) in enumerate(zip(mine, max_drafts)):
                tokens = p.tokens if isinstance(p.tokens, mx.array) else mx.array([int(t) for t in p.tokens], mx.int32)
                tokens = tokens[: min(m, K)].astype(mx.int32)  # [k_b], maybe unevaluated
                header[2 + b] = int(tokens.shape[0])
                header[2 + B + b] = int(p.logprobs is not None)
                parts.append(mx.pad(tokens, [(0, K - tokens.shape[0])]) if tokens.shape[0] < K else tokens)
        body = mx.concatenate(parts) if parts else mx.zeros((B * K,), mx.int32)  # [B * K]
        message = self.cluster.broadcast(mx.concatenate([mx.array(header, mx.int32), body]))
        head = message[: 2 + 2 * B].tolist()
        if head[0] == FAILED:
            error = self.error
            self.error = None if self.cluster.primary else self.error
            raise DraftError(f"the drafter on rank 0 failed: {type(error).__name__}: {error}" if error is not None
                             else "the drafter on rank 0 failed (its error is in rank 0's log)")
        ks, has_q = head[2 : 2 + B], head[2 + B :]
        drafts = message[2 + 2 * B :].reshape(B, K) if K else None
        q = self._broadcast_q(rows, mine, ks, K) if head[1] else None
        return [Proposal(drafts[b, : ks[b]] if drafts is not None and ks[b] else [],
                         q[b, : ks[b]] if q is not None and has_q[b] and ks[b] else None) for b in range(B)]

    def _broadcast_q(self, rows: Sequence[Any], mine: Optional[List[Proposal]], ks: List[int], K: int) -> mx.array:
        """[B, K, V] float32: each row's q from rank 0, zero-padded (a row without q sends zeros, and gets None)."""
        V = int(rows[0].pending_logprobs.shape[-1])
        block = mx.zeros((len(rows), K, V), mx.float32)
        if mine is not None:
            rows_q = []
            for p, k in zip(mine, ks):
                q = p.logprobs[:k].astype(mx.float32) if p.logprobs is not None and k else mx.zeros((0, V), mx.float32)
                rows_q.append(mx.pad(q, [(0, K - q.shape[0]), (0, 0)]) if q.shape[0] < K else q)
            block = mx.stack(rows_q)
        return self.cluster.broadcast(block)

    def commit(self, rows: Sequence[Any], verified: Sequence[Verified]) -> List[int]:
        kept = self._held(lambda: self.inner.commit(rows, verified))
        return list(kept) if kept is not None else [0] * len(rows)


class Rank0Drafter(Drafter):
    """The loaded drafter as the round sees it on every rank (its settings and taps); its batches draft on rank 0."""

    def __init__(self, inner: Drafter, cluster: Any):
        self.inner = inner
        self.cluster = cluster
        self.kind, self.family = inner.kind, inner.family
        self.default_block_size, self.max_block_size = inner.default_block_size, inner.max_block_size

    def __getattr__(self, name: str) -> Any:  # anything else the plugin reads of the drafter (description, paths)
        return getattr(self.__dict__["inner"], name)

    def capture_layers(self) -> List[int]:
        return self.inner.capture_layers()

    def new_batch(self) -> DraftBatch:
        return Rank0Drafts(self.inner.new_batch() if self.cluster.primary else None, self.cluster)


def for_ranks(drafter: Drafter, costs: Any, cluster: Any) -> Drafter:
    """A drafter and its cost table on a target sharded over ``cluster``'s ranks: every rank decides from rank 0's
    costs (``CostTable.agree``), and with ``drafter: rank0`` the drafter runs on rank 0 alone (``Rank0Drafter``)."""
    costs.agree = cluster.agree
    return Rank0Drafter(drafter, cluster) if cluster.config.drafter == "rank0" else drafter
