"""One decode step of a batch: a plugin's step (``host_decode_step``) or the host's own plain step.

The plain step is mlx-lm's ``generate_step`` for every row of the batch: feed each row's pending
token, apply the row's logits processors to its own history, sample with the row's own sampler
(and key stream). Runs of plain steps are pipelined like ``generate_step``: the next forward is
queued before the current tokens are read. While a run is under way the caches are one token ahead
of ``pending``; the last step of a run queues nothing, so the invariant of ``host_decode_step``
holds again before the plugins are asked. A run ends after the plain steps every plugin allowed,
when every row is about to finish, or when the caller says so (``more``: rows waiting to join).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import mlx.core as mx
import pluggy

from .batch import DecodeBatch
from .state import DecodeState, GeneratedToken, StepOutput

Emitted = List[Tuple[DecodeState, List[GeneratedToken]]]


class PlainRun:
    """Pipelined one-token steps for every row of ``batch``, at most ``limit`` of them."""

    def __init__(self, batch: DecodeBatch, limit: Optional[int]):
        self.batch = batch
        self.limit = limit
        self.steps = 0
        self.done = False
        self._histories: Dict[int, mx.array] = {}  # id(row) -> its tokens, the lazy sampled ones too
        self._queued: Optional[Tuple[List[DecodeState], mx.array, List[mx.array]]] = None
        # Each step's tapped outputs for the whole batch, {layer: [B, 1, H]}, with its rows: handed to the rows at
        # the run's end (``_hand_over``), a few operations a run instead of a slice and a concatenation per row,
        # layer and step (each one encoded on the host: 8 rows x 5 layers doubled an H100's 8-row plain step).
        self._captured: List[Tuple[List[DecodeState], Dict[int, mx.array]]] = []

    def _queue(self, rows: List[DecodeState], fed: Optional[mx.array]) -> None:
        """Queue one step for ``rows``: ``fed`` [B] is the lazy tokens to feed (None: the pending ones)."""
        inputs = mx.array([[r.pending] for r in rows], dtype=mx.uint32) if fed is None else fed[:, None]
        logits, captured = self.batch.forward(inputs)  # [B, 1, V]
        if captured and any(r.capture_layers for r in rows):
            self._captured.append((rows, captured))
        if len(rows) > 1 and all(r.sampling.greedy and not r.logits_processors for r in rows):
            # Every row greedy as is: the batch's log-probabilities and argmax in one go (mlx-lm's greedy sampler
            # is the argmax), not a few operations per row, each encoded on the host.
            last = logits[:, -1, :]  # [B, V]
            lp = last - mx.logsumexp(last, axis=-1, keepdims=True)
            y = mx.argmax(lp, axis=-1).astype(mx.uint32)  # [B]
            mx.async_eval(y, lp, list(captured.values()))
            self._queued = (rows, y, [lp[b : b + 1] for b in range(len(rows))])
            return
        sampled, logprobs = [], []
        for b, row in enumerate(rows):
            last = logits[b : b + 1, -1, :]  # [1, V]
            if row.logits_processors:
                history = self._histories.get(id(row))
                if history is None:
                    history = mx.array(row.tokens, dtype=mx.uint32)  # ends with the pending token
                elif fed is not None:
                    history = mx.concatenate([history, fed[b : b + 1]])
                self._histories[id(row)] = history
                last = row.apply_processors(history, last)
            lp = last - mx.logsumexp(last, axis=-1, keepdims=True)  # [1, V]
            logprobs.append(lp)
            sampled.append(row.sample(lp, offset=0 if fed is None else 1).reshape(1))  # fed: not in tokens yet
        y = mx.concatenate(sampled) if len(sampled) > 1 else sampled[0]  # [B]
        mx.async_eval(y, logprobs, list(captured.values()))
        self._queued = (rows, y, logprobs)

    def hand_over_row(self, row: DecodeState) -> None:
        """The run's tapped outputs so far to ``row``, which leaves mid-run (it finished): the prompt cache saves
        what its drafter holds, captures included, before the run ends (``_hand_over`` skips it then)."""
        if not row.capture_layers:
            return
        for rows, captured in self._captured:
            b = next((b for b, r in enumerate(rows) if r is row), None)
            if b is not None:
                row.add_captures({i: captured[i][b : b + 1] for i in row.capture_layers if i in captured})

    def _hand_over(self) -> None:
        """The run's tapped outputs to each row still in the batch, in step order: steps with the same rows joined
        per layer first ([B, n, H]), then one slice per row and layer."""
        present = {id(r) for r in self.batch.rows}
        runs: List[Tuple[List[DecodeState], Dict[int, List[mx.array]]]] = []
        for rows, captured in self._captured:
            if runs and [id(r) for r in runs[-1][0]] == [id(r) for r in rows]:
                for i, h in captured.items():
                    runs[-1][1][i].append(h)
            else:
                runs.append((rows, {i: [h] for i, h in captured.items()}))
        self._captured = []
        for rows, parts in runs:
            joined = {i: mx.concatenate(hs, axis=1) if len(hs) > 1 else hs[0] for i, hs in parts.items()}  # [B, n, H]
            for b, row in enumerate(rows):
                if id(row) in present and row.capture_layers:
                    row.add_captures({i: joined[i][b : b + 1] for i in row.capture_layers if i in joined})

    def next(self, more: Callable[[], bool]) -> Emitted:
        """This step's token for every row in the batch now (rows that left are dropped)."""
        if self._queued is None:
            self._queue(list(self.batch.rows), None)
        assert self._queued is not None
        rows, y, logprobs = self._queued
        self._queued = None
        present = {id(r) for r in self.batch.rows}
        keep = [b for b, r in enumerate(rows) if id(r) in present]
        if len(keep) < len(rows):  # rows left since this step was queued
            rows, logprobs = [rows[b] for b in keep], [logprobs[b] for b in keep]
            y = y[mx.array(keep)] if keep else y
        self.steps += 1
        last = (not rows or (self.limit is not None and self.steps >= self.limit)
                or all(r.remaining <= 1 for r in rows) or not more())
        if not last:
            self._queue(rows, y)
        tokens = y.tolist() if rows else []
        out: Emitted = []
        for row, token, lp in zip(rows, tokens, logprobs):
            gen = GeneratedToken(int(token), lp[0])
            row.tokens.append(gen.token)
            row.pending_logprobs = gen.logprobs
            out.append((row, [gen]))
        if last:
            self.done = True
            self._hand_over()
            runs = self.batch.plain
            runs.steps, runs.rows, runs.runs = self.steps, len(rows), runs.runs + 1
        if self.steps % 256 == 0:
            mx.clear_cache()
        return out


class BatchDecoder:
    """Steps one batch: asks the plugins, or runs the host's own plain steps."""

    def __init__(self, pm: pluggy.PluginManager, batch: DecodeBatch):
        self.pm = pm
        self.batch = batch
        self.run: Optional[PlainRun] = None

    @property
    def in_run(self) -> bool:
        """A plain step is queued: the caches are one token ahead; rows may not join now."""
        return self.run is not None

    def hand_over(self, row: DecodeState) -> None:
        """``row`` leaves mid-run: its captures of the run so far (``PlainRun.hand_over_row``)."""
        if self.run is not None:
            self.run.hand_over_row(row)

    def emptied(self) -> None:
        """The batch's last row left: a step queued for it has no one to serve."""
        if not self.batch.rows:
            self.run = None

    def step(self, more: Callable[[], bool] = lambda: True) -> Emitted:
        """One decode step for every row; ``more()`` False ends a plain run at this step."""
        if self.run is None:
            answer = self._ask()
            if answer is not None:
                return answer
        assert self.run is not None
        out = self.run.next(more)
        if self.run.done:
            self.run = None
        return out

    def _ask(self) -> Optional[Emitted]:
        """The plugins' step, or None after starting a plain run."""
        batch = self.batch
        rows = list(batch.rows)
        outs: Optional[List[StepOutput]] = self.pm.hook.host_decode_step(batch=batch)
        for row in rows:
            row.captures = {}  # handed over
        if outs is not None and len(outs) != len(rows):
            raise RuntimeError(f"host_decode_step returned {len(outs)} steps for {len(rows)} rows")
        if outs is not None and any(o.tokens for o in outs):
            if not all(o.tokens for o in outs):
                raise RuntimeError("host_decode_step must step every row of the batch or none")
            emitted: Emitted = []
            for row, o in zip(rows, outs):
                row.tokens.extend(g.token for g in o.tokens)
                row.pending_logprobs = o.tokens[-1].logprobs
                emitted.append((row, list(o.tokens)))
            batch.compact()
            return emitted
        limits = [o.plain_steps for o in outs or [] if o.plain_steps is not None]
        self.run = PlainRun(batch, max(1, min(limits)) if limits else None)
        return None

