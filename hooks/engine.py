"""The server's generation thread: admission, the scheduler's steps, and each request's output queue.

Every model call (loading, prefill, rounds, logprobs) runs on this one thread (mlx arrays and
streams are not shared across threads); HTTP threads only parse requests and read output queues.
Requests wait in a FIFO queue of at most ``max_queue`` (beyond it: 503); at most ``max_active`` are
admitted to the scheduler (hooks/scheduler.py: chunked prefill interleaved with decode steps, rows
of one target in one batch, seeded sampling requests in batches of their own). A client that
disconnects is noticed by its HTTP thread, which cancels the request; its caches are released at
the next step. With ``server.prompt_cache_bytes`` > 0 the scheduler keeps finished requests' caches
for later requests sharing a prefix (hooks/prompt_cache.py); each response reports the reused
prompt tokens (``cached``).
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

from . import openai_compat as oc
from . import openai_output as reply
from . import prompt_cache as pc
from . import warmup
from .host import GenerationParams, Host, HostEvent, load_with_plugins
from .metrics import HostCounters, timings
from .openai_fields import APIError
from .scheduler import Request, Scheduler
from .server_settings import ServerSettings
from .state import HostConfig, LoadedTarget

log = logging.getLogger("mlx_speculative.server")
SPECULATIVE = "speculative"  # the request option a request that turns rounds off sets (``DecodeState.options``)


@dataclass
class TokenOut:
    token: int
    text: str
    finish_reason: Optional[str]
    logprob: Optional[Dict[str, Any]] = None
    emitted: bool = True  # False: a stop token (EOS), not part of the output


@dataclass
class Finished:
    outcome: str  # ok | error | cancelled | interrupted (the server shut down)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    timings: Dict[str, Any] = field(default_factory=dict)
    error: Optional[str] = None
    cached_tokens: int = 0  # prompt tokens reused from the prompt cache


class Job:
    """One HTTP request on its way through the engine."""

    def __init__(self, request: oc.ParsedRequest, endpoint: str):
        self.request = request
        self.endpoint = endpoint
        self.id = ("chatcmpl-" if endpoint == "chat" else "cmpl-") + uuid.uuid4().hex
        self.out: "queue.Queue[Any]" = queue.Queue()  # List[TokenOut] a step, then Finished
        self.cancelled = threading.Event()
        self.checked = time.monotonic()  # when the HTTP thread last looked for a disconnect
        # Generation-thread state.
        self.scheduled: Optional[Request] = None
        self.completion_tokens = 0
        self.t_start = 0.0
        self.t_first: Optional[float] = None
        self.held: List[TokenOut] = []  # a non-streaming request's tokens, handed over when it ends


class Engine:
    """Owns the host, the target and the scheduler; runs every model call on its one thread."""

    def __init__(self, load: Callable[[], Tuple[Host, LoadedTarget]], settings: ServerSettings, counters: HostCounters):
        self._load = load
        self.settings = settings
        self.counters = counters
        self.host: Optional[Host] = None
        self.target: Optional[LoadedTarget] = None
        self.scheduler: Optional[Scheduler] = None
        self.prompt_cache: Optional[pc.PromptCache] = None
        self.cond = threading.Condition()
        self.waiting: Deque[Job] = collections.deque()
        self.jobs: Dict[int, Job] = {}  # scheduler request id -> job
        self.stopping = False
        self.ready = threading.Event()
        self.load_error: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._run, name="mlx-spec-generation", daemon=True)
        # A target sharded over ranks: sends each step's admitted requests and cancellations to the other ranks
        # (hooks/distributed_serve.py). None: one process.
        self.relay: Any = None

    def start(self) -> None:
        self.thread.start()
        self.ready.wait()
        if self.load_error is not None:
            raise self.load_error

    @property
    def healthy(self) -> bool:
        return self.thread.is_alive() and not self.stopping

    @property
    def alive(self) -> bool:
        """The generation thread runs (while shutting down too: it still ends every request)."""
        return self.thread.is_alive()

    def submit(self, job: Job) -> None:
        with self.cond:
            if self.stopping:
                raise APIError(503, "the server is shutting down", None, "shutting_down", "server_error")
            if len(self.waiting) >= self.settings.max_queue:
                raise APIError(503, f"the server is busy: {len(self.jobs)} requests running and {len(self.waiting)} "
                                  f"queued (server.max_queue = {self.settings.max_queue}); retry later",
                                  None, "server_busy", "server_error")
            self.waiting.append(job)
            self.counters.waiting = len(self.waiting)
            self.cond.notify()

    def cancel(self, job: Job) -> None:
        """The client is gone: drop the job from the queue now, or stop it at its next step."""
        job.cancelled.set()
        with self.cond:
            if job in self.waiting:
                self.waiting.remove(job)
                self.counters.waiting = len(self.waiting)
                self._finished(job, "cancelled")
            self.cond.notify()

    def stop(self, timeout: float = 30.0) -> bool:
        """End every request (running ones after their current step, with what they have so far; queued
        ones with nothing) as ``interrupted``, and join the generation thread. Returns whether it ended
        within ``timeout`` seconds.

        Why the join: a thread that enters the interpreter while it exits is ended by CPython with
        pthread_exit, and that unwinding through mlx's C++ (noexcept) frames calls std::terminate: the
        process aborts with "terminate called without an active exception". The generation thread enters it
        mid-step, and at its very end too: C++ destroys its thread-local mx.compile cache, whose entries hold
        Python functions (mlx-lm's compiled samplers), after the Python thread is gone; ``_run`` empties that
        cache first (``mx.clear_streams``)."""
        with self.cond:
            self.stopping = True
            self.cond.notify()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(timeout)
        return not self.thread.is_alive()

    # the generation thread -----------------------------------------------------------------------
    def _run(self) -> None:
        import mlx.core as mx

        try:
            self._serve()
        finally:
            # This thread's mlx state goes now, while it holds the interpreter: its mx.compile cache keeps Python
            # functions, and released by the thread's C++ destructors after the interpreter began to exit it
            # would abort the process (see ``stop``).
            mx.clear_streams()

    def setup(self) -> None:
        """Load the target, make the prompt cache and the scheduler, warm up (on a rank that follows rank 0's engine
        too: hooks/distributed_serve.py)."""
        self.host, self.target = self._load()
        limit = self.settings.prompt_cache_bytes
        limit = pc.default_bytes(self.target.model) if limit is None else limit
        if self.relay is not None:  # every rank keeps what rank 0 keeps (the default depends on the machine's memory)
            limit = self.relay.agree_bytes(limit)
        entries = self.settings.prompt_cache_size
        self.prompt_cache = pc.PromptCache(limit, entries) if limit > 0 and entries != 0 else None
        self.scheduler = Scheduler(self.host, self.target, batching=self.settings.batching, raise_errors=False,
                                   prompt_cache=self.prompt_cache)
        rows = self.settings.warmup_rows
        rows = warmup.default_rows(self.settings.max_active) if rows is None else rows
        if rows:
            log.info("warming up: batches of 1..%d rows (server.warmup_rows)", rows)
            warmup.warm_up(self.host, self.target, rows, self.settings.batching, self.settings.warmup_tokens,
                           prefill_step_size=self.settings.prefill_step_size)

    def _serve(self) -> None:
        try:
            self.setup()
        except BaseException as e:  # noqa: BLE001 - reported by start()
            self.load_error = e
            self.ready.set()
            return
        self.counters.batching = int(self.settings.batching)
        self.ready.set()
        import mlx.core as mx

        while True:
            with self.cond:
                while not self.stopping and not self.jobs and not self.waiting:
                    mx.clear_cache()
                    heartbeat = self.relay.heartbeat_s if self.relay is not None else None
                    if not self.cond.wait(heartbeat) and heartbeat is not None:
                        break  # an empty step for the other ranks: one that died is noticed now, not at the next request
                if self.stopping:
                    if self.relay is not None:
                        self.relay.send([], [], stop=True)
                    self._interrupt_all()
                    return
                admitted = self._admit()
            cancels = [job for job in list(self.jobs.values()) if job.cancelled.is_set() and job.scheduled is not None]
            if self.relay is not None:  # the other ranks take the same requests, cancel the same, step alike
                self.relay.send([job.request for job in admitted], [job.scheduled.id for job in cancels])
            for job in admitted:
                self._start(job)
            for job in cancels:
                self.scheduler.cancel(job.scheduled)
            steps: Dict[int, Tuple[Job, List[TokenOut]]] = {}
            for request, event in self.scheduler.step():
                job = self.jobs.get(request.id)
                if job is not None and not job.cancelled.is_set():
                    steps.setdefault(request.id, (job, []))[1].append(self._token(job, event))
            for job, tokens in steps.values():
                # A step's tokens handed over at once: a round's ~6 tokens a row wake its HTTP thread once, not
                # six times, each wake-up contending with this thread for the interpreter. A non-streaming
                # request's HTTP thread has nothing to send before the end: its tokens wait for it there.
                if job.request.stream:
                    job.out.put(tokens)
                else:
                    job.held.extend(tokens)
            for rows in self.scheduler.decoded:
                self.counters.stepped(rows)
            self.counters.spent(**self.scheduler.seconds)
            for job in [j for j in self.jobs.values() if j.scheduled is not None and j.scheduled.done]:
                self._done(job)

    def _interrupt_all(self) -> None:
        """Shutting down: every request ends now, its caches released (called with ``cond`` held)."""
        assert self.scheduler is not None
        for job in self.jobs.values():
            if job.scheduled is not None:
                self.scheduler.cancel(job.scheduled)
        try:
            self.scheduler.step()  # releases the cancelled requests (the plugins see them end)
        except Exception:  # noqa: BLE001 - the requests end anyway
            log.exception("releasing the requests at shutdown")
        for job in list(self.waiting) + list(self.jobs.values()):
            self._finished(job, "interrupted")
        self.waiting.clear()
        self.jobs.clear()
        self.counters.waiting = self.counters.running = 0

    def _admit(self) -> List[Job]:
        admitted = []
        while self.waiting and len(self.jobs) + len(admitted) < self.settings.max_active:
            job = self.waiting.popleft()
            if job.cancelled.is_set():
                self._finished(job, "cancelled")
                continue
            admitted.append(job)
        self.counters.waiting = len(self.waiting)
        return admitted

    def _start(self, job: Job) -> None:
        assert self.scheduler is not None and self.target is not None
        req = job.request
        job.t_start = time.perf_counter()
        try:
            job.scheduled = self.scheduler.submit(req.prompt, self.params(req))
        except Exception as e:  # noqa: BLE001 - one request fails, the server keeps serving
            log.exception("request %s failed", job.id)
            self._finished(job, "error", f"{type(e).__name__}: {e}")
            return
        self.jobs[job.scheduled.id] = job
        self.counters.running = len(self.jobs)
        if job.scheduled.done:
            self._done(job)

    def params(self, req: oc.ParsedRequest) -> GenerationParams:
        """A parsed request's generation parameters (on the generation thread: the processors hold mx arrays)."""
        assert self.target is not None
        stops, _ = reply.stop_machinery(self.target.tokenizer, req.stop_words)
        return GenerationParams(
            max_tokens=req.max_tokens, sampling=req.sampling, logits_processors=oc.logits_processors(req),
            prefill_step_size=self.settings.prefill_step_size, stop_sequences=stops,
            options={SPECULATIVE: False} if req.speculative is False else {},
        )

    def _token(self, job: Job, event: HostEvent) -> TokenOut:
        """One token for the client (handed over with the rest of its step's)."""
        if job.t_first is None:
            job.t_first = time.perf_counter()
        if event.emitted:
            job.completion_tokens += 1
        req = job.request
        entry = None
        if (req.logprobs or req.top_logprobs) and event.emitted:
            assert self.target is not None
            entry = reply.logprob_entry(self.target.tokenizer, event.logprobs, event.token, req.top_logprobs)
        return TokenOut(event.token, event.text, event.finish_reason, entry, event.emitted)

    def _done(self, job: Job) -> None:
        request = job.scheduled
        assert request is not None
        self.jobs.pop(request.id, None)
        self.counters.running = len(self.jobs)
        if job.cancelled.is_set():
            outcome, error = "cancelled", None
        elif request.error is not None:
            log.error("request %s failed: %s", job.id, request.error)
            outcome, error = "error", request.error
        else:
            outcome, error = "ok", None
        self._finished(job, outcome, error)

    def _finished(self, job: Job, outcome: str, error: Optional[str] = None) -> None:
        state = job.scheduled.state if job.scheduled is not None else None
        spec = state.decode_report if state is not None else None
        now = time.perf_counter()
        first = job.t_first or now
        prompt_n = len(job.request.prompt)
        cached = state.cached if state is not None else 0
        t = timings(prompt_n, first - job.t_start if job.t_start else 0.0, job.completion_tokens, now - first, spec,
                    cached)
        if job.held:
            job.out.put(job.held)
            job.held = []
        job.out.put(Finished(outcome, prompt_n, job.completion_tokens, t, error, cached))
        off = job.request.speculative is False
        self.counters.finished(job.endpoint, outcome, prompt_n if job.t_start else 0, job.completion_tokens, off,
                               spec is not None and spec.fallback is not None)
        if spec is not None and spec.rounds:
            how = (f"speculative {spec.kind}: {spec.rounds} rounds, tau {spec.mean_acceptance_length:.2f}, "
                   f"acceptance {spec.acceptance_rate:.0%} ({spec.accepted_tokens}/{spec.draft_tokens})")
            if spec.plain_tokens.paused:
                how += f", paused for {spec.plain_tokens.paused} plain steps ({spec.pause_reason})"
            if spec.fallback:
                how += f", fell back: {spec.fallback}"
        else:
            how = "speculative off" + (" (requested)" if off else "")
        log.info("request %s %s %s: prompt %d tokens (%d cached), completion %d tokens, %.3f s, %.1f tok/s, %s%s",
                 job.id, job.endpoint, outcome, prompt_n, cached, job.completion_tokens, now - (job.t_start or now),
                 t["predicted_per_second"], how, f", error: {error}" if error else "")


def make_engine(config: HostConfig, model: str, settings: ServerSettings, pm: Optional[Any] = None,
                target: Optional[LoadedTarget] = None, relay: Optional[Any] = None) -> Tuple[Engine, Dict[str, Any]]:
    """The engine, not started, and a box that holds the plugins' start-up error once it loaded. ``relay``
    (hooks/distributed_serve.py): the target is sharded over the ranks of ``relay.cluster``."""
    counters = HostCounters()
    box: Dict[str, Any] = {}
    cluster = relay.cluster if relay is not None else None

    def load() -> Tuple[Host, LoadedTarget]:
        if target is not None:
            host = Host(config, pm=pm)
            host.apply_policy(target, host.pm.hook.host_cache_policy(target=target))
            return host, target
        host, loaded, error = load_with_plugins(config, model, pm, cluster=cluster)
        box["error"] = error
        if cluster is not None:  # a drafter that loaded on some ranks only would set them apart
            cluster.check_same([int(error is None)], "whether the plugins started (speculative decoding on or off)")
        return host, loaded

    engine = Engine(load, settings, counters)
    engine.relay = relay
    return engine, box
