"""The scheduler: requests of one target from prompt to last token, in batches.

The CLI runs one request through it, the server many (hooks/server.py, on its generation thread).
Each ``step()``:

1. rows whose prefill finished join a batch: the main batch (one target forward per decode step
   for all its rows) when their caches merge, else a batch of their own. Seeded sampling requests
   batch like greedy ones: each position's draw is keyed by the seed and the position alone
   (docs/lossless.md), so what runs beside a row changes its tokens no more than a greedy row's.
2. requests still prefilling feed their prompts, oldest first, in chunks of ``prefill_step_size``
   tokens until one chunk's worth was fed this step (several short prompts start in one step; a
   long prompt feeds one chunk), so a long prompt never stalls the rows that are decoding;
3. every batch takes one decode step (``hooks.step``): a plugin's round or the host's plain step.

Then each emitted token goes through the request's stop / length / detokenizer handling, the one
place that decides where a request ends (``RowEvents``).

With a prompt cache (the server's, hooks/prompt_cache.py) a new request starts from copies of the
caches of the longest usable cached prefix and prefills only the rest; a request that ends (or is
cancelled) leaves a copy of its caches there, with its plugins' state (``host_save_row``), and so
does the end of its prompt on targets whose caches cannot be trimmed (recurrent, sliding windows).
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import mlx.core as mx

from .batch import DecodeBatch, mergeable
from .host import GenerationParams, Host, HostEvent
from .prompt_cache import PromptCache, always_trimmable, copy_caches, trim_caches, trimmable
from .state import DecodeState, GeneratedToken, LoadedTarget
from .step import BatchDecoder

log = logging.getLogger("mlx_speculative.server")


class RowEvents:
    """Stop and length handling plus streaming text of one request."""

    def __init__(self, target: LoadedTarget, params: GenerationParams):
        ids = params.stop_token_ids
        self.stop = set(ids if ids is not None else target.tokenizer.eos_token_ids)
        self.matcher = params.stop_sequences.matcher() if params.stop_sequences is not None else None
        # A target without a tokenizer (the bench's synthetic ones) streams tokens without text.
        self.detok = target.tokenizer.detokenizer if target.tokenizer is not None else _NoText()
        self.detok.reset()
        self.max_tokens = params.max_tokens
        self.emitted = 0

    def event(self, gen: GeneratedToken) -> HostEvent:
        """The ``HostEvent`` of one generated token; ``finish_reason`` set ends the request."""
        if gen.token in self.stop:
            self.detok.finalize()
            return HostEvent(gen.token, self.detok.last_segment, gen.logprobs, "stop", emitted=False)
        self.emitted += 1
        self.detok.add_token(gen.token)
        finish = None
        if self.matcher is not None and self.matcher.advance(gen.token):
            finish = "stop"  # a stop sequence completed (the host's text clean-up strips it)
        elif self.emitted >= self.max_tokens:
            finish = "length"
        if finish is not None:
            self.detok.finalize()
        return HostEvent(gen.token, self.detok.last_segment, gen.logprobs, finish)


class _NoText:
    last_segment = ""

    def reset(self) -> None: ...

    def add_token(self, token: int) -> None: ...

    def finalize(self) -> None: ...


@dataclass
class Request:
    """One request on its way through the scheduler."""

    id: int
    state: DecodeState
    params: GenerationParams
    events: RowEvents
    caches: List[Any] = field(default_factory=list)  # its own caches while it prefills
    prefill: Optional[Iterator[int]] = None
    fed: int = 0  # prompt positions in ``caches`` while it prefills
    batch: Optional[DecodeBatch] = None
    done: bool = False
    cancelled: bool = False
    finish_reason: Optional[str] = None  # stop | length | cancelled | error
    error: Optional[str] = None


class Scheduler:
    """Prefill and decode steps for the requests of one target."""

    def __init__(self, host: Host, target: LoadedTarget, batching: bool = True, raise_errors: bool = True,
                 prompt_cache: Optional[PromptCache] = None):
        self.host = host
        self.target = target
        self.batching = batching
        self.prompt_cache = prompt_cache  # None (the CLI): every request prefills its whole prompt
        # False (the server): a request whose prefill or batch step raises ends with finish_reason
        # "error" and ``error`` set; the other batches go on. True (the CLI): the exception propagates.
        self.raise_errors = raise_errors
        self.prefilling: List[Request] = []
        self.ready: List[Request] = []  # prefilled, waiting to join a batch
        self.decoders: List[BatchDecoder] = []  # the main batch first, then batches of their own
        self.rows: dict = {}  # id(DecodeState) -> Request
        self._ids = itertools.count()
        self.steps = 0
        self.decoded: List[int] = []  # rows of each batch the last step decoded (one target forward each)
        self.seconds = {"prefill": 0.0, "decode": 0.0}  # the last step's wall clock in prompt chunks and in decoding

    # requests ---------------------------------------------------------------------------------
    def submit(self, prompt: Sequence[int], params: GenerationParams) -> Request:
        state = self.host.new_state(self.target, prompt, params)
        request = Request(next(self._ids), state, params, RowEvents(self.target, params))
        state.saved = self.prompt_cache is not None and params.max_kv_size is None
        if params.max_tokens <= 0:
            request.done, request.finish_reason = True, "length"
            self.host.finished(state, 0)
            return request
        request.caches = self._restore(state, params) or self.host.new_caches(self.target, params)
        request.fed = state.cached
        request.prefill = self.host.prefill(state, request.caches, params.prefill_step_size)
        self.prefilling.append(request)
        return request

    def _restore(self, state: DecodeState, params: GenerationParams) -> Optional[List[Any]]:
        """Caches holding the longest usable cached prefix of the prompt (``state.cached`` set), or None."""
        if self.prompt_cache is None or params.max_kv_size is not None:
            return None
        hit = self.prompt_cache.fetch(state.tokens[: state.prompt_len], captures=bool(state.capture_layers))
        if hit is None:
            return None
        state.cached, state.restored = hit.positions, hit.snapshots
        return hit.caches

    def _keep(self, request: Request, caches: List[Any], held: int, own: int, batch: Optional[DecodeBatch]) -> None:
        """Copy ``caches`` (they hold ``state.tokens[:held]``) into the prompt cache. ``own``: the
        length of the request's own sequence (tokens after a stop token in the same round are not
        its own); trimmable caches keep ``own - 1`` positions of it, so a next turn always finds the
        same count, the rest only as they are (snapshots)."""
        assert self.prompt_cache is not None
        state = request.state
        trim = trimmable(caches)
        positions = min(held, own - 1) if trim else held
        if positions <= state.cached:
            return  # the entry it came from holds as much
        try:
            copies = copy_caches(caches)
            if trim:
                trim_caches(copies, held - positions)
            saved = self.host.pm.hook.host_save_row(state=state, batch=batch, positions=positions)
            snapshots = {s.name: s for s in saved if s is not None and 0 < s.positions <= positions}
            self.prompt_cache.insert(state.tokens[:positions], copies, snapshots, bool(state.capture_layers))
        except Exception as e:  # noqa: BLE001 - the request's output stands; only the cache entry is lost
            log.warning("prompt cache: could not keep request %d's caches: %s: %s", request.id, type(e).__name__, e,
                        exc_info=True)

    def cancel(self, request: Request) -> None:
        """Stop a request at the next step (its caches are released then)."""
        request.cancelled = True

    @property
    def active(self) -> int:
        return len(self.prefilling) + len(self.ready) + len(self.rows)

    @property
    def busy(self) -> bool:
        return self.active > 0

    def batches(self) -> List[DecodeBatch]:
        return [d.batch for d in self.decoders if d.batch.rows]

    # one step -----------------------------------------------------------------------------------
    def step(self) -> List[Tuple[Request, HostEvent]]:
        """One scheduling step; returns the events it emitted, in order."""
        out: List[Tuple[Request, HostEvent]] = []
        self.decoded = []
        self._drop_cancelled()
        self._join_ready()
        budget = self.prefilling[0].params.prefill_step_size if self.prefilling else 0
        t0 = time.perf_counter()
        while self.prefilling and budget > 0:
            budget -= self._prefill_chunk(self.prefilling[0], out)
        t1 = time.perf_counter()
        for decoder in list(self.decoders):
            if decoder.batch.rows:
                self._decode(decoder, out)
        self.seconds = {"prefill": t1 - t0, "decode": time.perf_counter() - t1}
        self.decoders = [d for d in self.decoders if d.batch.rows or d is self._main(create=False)]
        self.steps += 1
        if self.steps % 256 == 0:
            mx.clear_cache()
        return out

    def _main(self, create: bool = True) -> Optional[BatchDecoder]:
        main = next((d for d in self.decoders if not d.batch.single), None)
        if main is None and create:
            main = self.host.decoder(DecodeBatch(self.target))
            self.decoders.insert(0, main)
        return main

    def _batchable(self, request: Request) -> bool:
        return self.batching and mergeable(request.caches)

    def _join_ready(self) -> None:
        waiting = []
        for request in self.ready:
            decoder = self._main() if self._batchable(request) else None
            if decoder is not None and decoder.in_run:
                waiting.append(request)  # joins once the main batch's plain run ends
                continue
            if decoder is None:
                decoder = self.host.decoder(DecodeBatch(self.target, single=True))
                self.decoders.append(decoder)
            decoder.batch.join(request.state, request.caches)
            request.batch, request.caches = decoder.batch, []
            self.rows[id(request.state)] = request
        self.ready = waiting

    def _prefill_chunk(self, request: Request, out: List[Tuple[Request, HostEvent]]) -> int:
        """Feed one chunk of the request's prompt; returns the tokens it fed (at least 1)."""
        assert request.prefill is not None
        try:
            fed = next(request.prefill)
        except Exception as e:  # noqa: BLE001 - one request fails, the others go on
            self.prefilling.remove(request)
            self._failed([request], e)
            return 1
        chunk, request.fed = max(1, fed - request.fed), fed
        state = request.state
        if fed < state.prompt_len:
            if (fed == state.prompt_len - 1 and self.prompt_cache is not None
                    and not always_trimmable(request.caches)):
                self._keep(request, request.caches, fed, fed + 1, None)  # a snapshot at the prompt's end
            return chunk
        self.prefilling.remove(request)
        request.prefill = None
        event = request.events.event(GeneratedToken(state.pending, state.pending_logprobs))
        out.append((request, event))
        if event.finish_reason is not None:
            self._finish(request, event.finish_reason, 0)
        else:
            self.ready.append(request)
        return chunk

    def _decode(self, decoder: BatchDecoder, out: List[Tuple[Request, HostEvent]]) -> None:
        main = decoder is self._main(create=False)
        more = (lambda: not self.ready) if main else (lambda: True)
        self.decoded.append(len(decoder.batch.rows))
        try:
            emitted = decoder.step(more)
        except Exception as e:  # noqa: BLE001 - the batch's requests fail, the others go on
            self.decoders.remove(decoder)  # nothing of the failed step's caches is reused
            self._failed([self.rows[id(s)] for s in list(decoder.batch.rows)], e)
            return
        for state, tokens in emitted:
            request = self.rows[id(state)]
            for i, gen in enumerate(tokens):
                event = request.events.event(gen)
                out.append((request, event))
                if event.finish_reason is not None:
                    self._finish(request, event.finish_reason, len(tokens) - i - 1)
                    break

    def _finish(self, request: Request, reason: Optional[str], discarded: int) -> None:
        request.done, request.finish_reason = True, reason
        state = request.state
        keep = self.prompt_cache is not None and reason != "error"
        if keep and request.batch is not None:
            decoder = next((d for d in self.decoders if d.batch is request.batch), None)
            # A plain run queued its next step: the caches already hold the pending token too.
            ahead = decoder is not None and decoder.in_run
            if decoder is not None:
                decoder.hand_over(state)  # what a plain run under way captured for it
            held = len(state.tokens) - (0 if ahead else 1)
            self._keep(request, request.batch.row_caches(state), held, len(state.tokens) - discarded, request.batch)
        elif keep and request.caches:
            self._keep(request, request.caches, request.fed, len(state.tokens), None)
        state.restored = {}  # read by the plugins at the row's first step; the entries keep their own
        if request.batch is not None:
            request.batch.leave(request.state)
            for decoder in self.decoders:
                if decoder.batch is request.batch:
                    decoder.emptied()
            request.batch = None
        self.rows.pop(id(request.state), None)
        request.caches = []
        self.host.finished(request.state, discarded)

    def _drop_cancelled(self) -> None:
        for request in [r for r in self.prefilling + self.ready + list(self.rows.values()) if r.cancelled and not r.done]:
            if request in self.prefilling:
                self.prefilling.remove(request)
                if request.prefill is not None:
                    request.prefill.close()
            if request in self.ready:
                self.ready.remove(request)
            self._finish(request, "cancelled", 0)

    def _failed(self, requests: List[Request], error: Exception) -> None:
        for request in requests:
            request.error = f"{type(error).__name__}: {error}"
            self._finish(request, "error", 0)
        if self.raise_errors:
            raise error
