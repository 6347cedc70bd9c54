"""``mlx-spec serve``: an OpenAI-compatible HTTP server whose generation runs through ``Host``.

Every token comes from ``Host.stream``, so the speculative plugin (``speculative:`` in the host
YAML, MLX_VLM_* variables, CLI flags) applies exactly as in ``mlx-spec generate``. What requests
mean (parameters, chat templates, stop words, response shapes) is mlx-lm's, through
``hooks.openai_compat``, the one module coupled to mlx-lm's server.

Scheduling policy (one generation thread; mlx arrays and streams are not shared across threads):
- Every model call (loading, prefill, rounds, logprobs) runs on the generation thread.
- Batched (``server.batching``, default, where ``Host.batch_refusal`` finds nothing against it):
  admitted requests (at most ``max_active``) are prefilled alone, then join one ``DecodeBatch``
  (hooks/batch.py) and every step is one forward of the target for all of them
  (``host_decode_batch``: the plugin's batched round, per-row acceptance and commits). Seeded
  sampling requests are interleaved beside the batch.
- Interleaved (otherwise): admitted requests take one decode step at a time, round robin.
- Either way each request has its own draft session and stop state and its rows of the caches, so
  its tokens are exactly those it gets alone. A seeded sampling request draws from its own key
  stream (hooks/state.KeyStream), so it reproduces exactly whatever runs beside it.
- Further requests wait in a FIFO queue of at most ``max_queue``; beyond that the answer is 503.
- A client that disconnects is noticed within ~0.25 s (failed write or closed socket); its
  request is dropped from the queue or stopped, and its caches are released.
"""

from __future__ import annotations

import argparse
import collections
import hmac
import json
import logging
import queue
import select
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional, Tuple

from . import openai_compat as oc
from .config import load_host_config, model_or_demo
from .batch import DecodeBatch, RowEvents
from .host import GenerationParams, Host, HostEvent
from .manager import make_plugin_manager
from .server_settings import ServerSettings, check_port, request_defaults, serve_overrides, server_settings
from .state import DecodeState, GeneratedToken, HostConfig, LoadedTarget

log = logging.getLogger("mlx_speculative.server")

MAX_BODY_BYTES = 16 << 20
POLL_SECONDS = 0.25


# Counters of the host's own (the plugin's spec_decode_* counters live in plugin.metrics) ---------

class HostCounters:
    """Requests, tokens and fallbacks, thread-safe; rendered by /metrics."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Dict[Tuple[str, str], int] = collections.Counter()  # (endpoint, outcome)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.speculative_off_requests = 0  # requests that asked for plain decoding
        self.fallback_requests = 0  # requests whose drafter failed mid-way (plain decoding after)
        self.startup_fallback = 0  # 1: the drafter could not be attached at start, serving plain
        self.running = 0
        self.waiting = 0
        self.batching = 0  # 1: batched decode steps (see Engine)
        self.batched_steps = 0
        self.batched_rows = 0  # rows over all batched steps: / batched_steps = mean rows per forward

    def request(self, endpoint: str, outcome: str) -> None:
        with self._lock:
            self.requests[(endpoint, outcome)] += 1

    def finished(self, endpoint: str, outcome: str, prompt: int, generated: int, off: bool, fallback: bool) -> None:
        with self._lock:
            self.requests[(endpoint, outcome)] += 1
            self.prompt_tokens += prompt
            self.generation_tokens += generated
            self.speculative_off_requests += int(off)
            self.fallback_requests += int(fallback)


def render_metrics(counters: HostCounters, speculative_active: bool) -> str:
    """Prometheus text format: vLLM's spec_decode_* counters plus the host's own."""
    from ..plugin.metrics import METRICS

    snap = METRICS.snapshot()
    lines: List[str] = []

    def metric(name: str, kind: str, help_: str, samples: List[Tuple[str, Any]]) -> None:
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(f"{name}{labels} {value}" for labels, value in samples)

    metric("spec_decode_num_drafts_total", "counter", "Speculative rounds (drafts verified).",
           [("", snap["spec_decode_num_drafts_total"])])
    metric("spec_decode_num_draft_tokens_total", "counter", "Draft tokens proposed and verified.",
           [("", snap["spec_decode_num_draft_tokens_total"])])
    metric("spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted.",
           [("", snap["spec_decode_num_accepted_tokens_total"])])
    per_pos = snap["spec_decode_num_accepted_tokens_per_pos_total"]
    metric("spec_decode_num_accepted_tokens_per_pos_total", "counter", "Draft tokens accepted, by position in the block.",
           [(f'{{position="{i}"}}', per_pos[i]) for i in sorted(per_pos)])
    metric("spec_decode_fallbacks_total", "counter", "Drafter failures mid-request (plain decoding after).",
           [("", snap["spec_decode_fallbacks_total"])])
    with counters._lock:
        requests = sorted(counters.requests.items())
        values = dict(vars(counters))
    metric("mlx_spec_requests_total", "counter", "HTTP generation requests by endpoint and outcome.",
           [(f'{{endpoint="{e}",outcome="{o}"}}', n) for (e, o), n in requests])
    metric("mlx_spec_prompt_tokens_total", "counter", "Prompt tokens processed.", [("", values["prompt_tokens"])])
    metric("mlx_spec_generation_tokens_total", "counter", "Tokens generated.", [("", values["generation_tokens"])])
    metric("mlx_spec_speculative_off_requests_total", "counter", "Requests that asked for plain decoding.",
           [("", values["speculative_off_requests"])])
    metric("mlx_spec_speculative_fallback_requests_total", "counter",
           "Requests whose drafter failed mid-way and finished with plain decoding.", [("", values["fallback_requests"])])
    metric("mlx_spec_speculative_startup_fallback", "gauge",
           "1 when speculative decoding was configured but the drafter could not be attached.",
           [("", values["startup_fallback"])])
    metric("mlx_spec_speculative_active", "gauge", "1 when a drafter is attached.", [("", int(speculative_active))])
    metric("mlx_spec_batched_scheduling", "gauge", "1 when requests share batched decode steps, 0 when interleaved.",
           [("", values["batching"])])
    metric("mlx_spec_batched_steps_total", "counter", "Batched decode steps (one target forward each).",
           [("", values["batched_steps"])])
    metric("mlx_spec_batched_rows_total", "counter", "Request rows over all batched decode steps.",
           [("", values["batched_rows"])])
    metric("mlx_spec_requests_running", "gauge", "Requests being generated.", [("", values["running"])])
    metric("mlx_spec_requests_waiting", "gauge", "Requests queued.", [("", values["waiting"])])
    return "\n".join(lines) + "\n"


def timings(prompt_n: int, prompt_s: float, predicted_n: int, predicted_s: float, spec: Any) -> Dict[str, Any]:
    """llama.cpp's per-request ``timings`` (draft_n, draft_n_accepted...) plus the round summary."""
    def per(n: int, s: float) -> Tuple[float, float]:
        return (round(1000 * s / n, 3) if n else 0.0), (round(n / s, 3) if s > 0 else 0.0)

    prompt_per_token, prompt_per_second = per(prompt_n, prompt_s)
    predicted_per_token, predicted_per_second = per(predicted_n, predicted_s)
    out = {
        "prompt_n": prompt_n, "prompt_ms": round(1000 * prompt_s, 3),
        "prompt_per_token_ms": prompt_per_token, "prompt_per_second": prompt_per_second,
        "predicted_n": predicted_n, "predicted_ms": round(1000 * predicted_s, 3),
        "predicted_per_token_ms": predicted_per_token, "predicted_per_second": predicted_per_second,
        "draft_n": spec.draft_tokens if spec is not None else 0,
        "draft_n_accepted": spec.accepted_tokens if spec is not None else 0,
    }
    if spec is not None:
        out.update(draft_kind=spec.kind, draft_rounds=spec.rounds,
                   mean_acceptance_length=round(spec.mean_acceptance_length, 4),
                   acceptance_rate=round(spec.acceptance_rate, 4), draft_fallback=spec.fallback)
    return out


# The generation thread ---------------------------------------------------------------------------

@dataclass
class TokenOut:
    token: int
    text: str
    finish_reason: Optional[str]
    logprob: Optional[Dict[str, Any]] = None


@dataclass
class Finished:
    outcome: str  # ok | error | cancelled
    prompt_tokens: int = 0
    completion_tokens: int = 0
    timings: Dict[str, Any] = field(default_factory=dict)
    error: Optional[str] = None


class Job:
    """One request on its way through the engine."""

    def __init__(self, request: oc.ParsedRequest, endpoint: str):
        self.request = request
        self.endpoint = endpoint
        self.id = ("chatcmpl-" if endpoint == "chat" else "cmpl-") + uuid.uuid4().hex
        self.out: "queue.Queue[Any]" = queue.Queue()
        self.cancelled = threading.Event()
        # Generation-thread state.
        self.events: Optional[Iterator[HostEvent]] = None
        self.holder: List[DecodeState] = []
        self.matcher: Any = None
        self.completion_tokens = 0
        self.t_start = 0.0
        self.t_first: Optional[float] = None
        self.checked = time.monotonic()  # when the HTTP thread last looked for a disconnect
        # A row of the engine's DecodeBatch (batched scheduling): its state and its stop/text handling.
        self.row: Optional[DecodeState] = None
        self.row_events: Optional[RowEvents] = None


class Engine:
    """Owns the host and the target; runs every model call on its one thread."""

    def __init__(self, load: Callable[[], Tuple[Host, LoadedTarget]], settings: ServerSettings, counters: HostCounters):
        self._load = load
        self.settings = settings
        self.counters = counters
        self.host: Optional[Host] = None
        self.target: Optional[LoadedTarget] = None
        self.cond = threading.Condition()
        self.waiting: Deque[Job] = collections.deque()
        self.active: List[Job] = []
        self.stopping = False
        self.ready = threading.Event()
        self.load_error: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._run, name="mlx-spec-generation", daemon=True)
        # Batched scheduling: the rows decoded together, or why the target's requests are interleaved.
        self.batch: Optional[DecodeBatch] = None
        self.batch_reason: Optional[str] = None

    def start(self) -> None:
        self.thread.start()
        self.ready.wait()
        if self.load_error is not None:
            raise self.load_error

    @property
    def healthy(self) -> bool:
        return self.thread.is_alive() and not self.stopping

    def submit(self, job: Job) -> None:
        with self.cond:
            if len(self.waiting) >= self.settings.max_queue:
                raise oc.APIError(503, f"the server is busy: {len(self.active)} requests running and {len(self.waiting)} "
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
                self._finish(job, "cancelled")
            self.cond.notify()

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify()

    def _run(self) -> None:
        try:
            self.host, self.target = self._load()
        except BaseException as e:  # noqa: BLE001 - reported by start()
            self.load_error = e
            self.ready.set()
            return
        try:
            self.batch_reason = (self.host.batch_refusal(self.target) if self.settings.batching
                                 else "server.batching is false")
        except Exception as e:  # noqa: BLE001 - interleaving always works
            self.batch_reason = f"{type(e).__name__}: {e}"
        if self.batch_reason is None:
            self.batch = DecodeBatch(self.target)
            self.counters.batching = 1
        self.ready.set()
        import mlx.core as mx

        while True:
            with self.cond:
                while not self.stopping and not self.active and not self.waiting:
                    mx.clear_cache()
                    self.cond.wait()
                if self.stopping:
                    return
                self._admit()
                jobs = list(self.active)
            for job in jobs:
                self._advance(job)
            if self.batch is not None and self.batch.rows:
                self._batch_step()

    def _admit(self) -> None:
        while self.waiting and len(self.active) < self.settings.max_active:
            head = self.waiting[0]
            if head.cancelled.is_set():
                self.waiting.popleft()
                self._finish(head, "cancelled")
                continue
            self.active.append(self.waiting.popleft())
        self.counters.waiting = len(self.waiting)
        self.counters.running = len(self.active)

    def _params(self, job: Job) -> GenerationParams:
        assert self.target is not None
        req = job.request
        stops, _ = oc.stop_machinery(self.target.tokenizer, req.stop_words)
        job.matcher = stops.matcher()
        job.t_start = time.perf_counter()
        return GenerationParams(
            max_tokens=req.max_tokens, sampling=req.sampling, logits_processors=oc.logits_processors(req),
            prefill_step_size=self.settings.prefill_step_size,
            extras={"speculative_enabled": False} if req.speculative is False else {},
        )

    def _start(self, job: Job) -> None:
        assert self.host is not None and self.target is not None
        params = self._params(job)
        job.events = self.host.stream(self.target, job.request.prompt, params, state_out=job.holder)

    def _batchable(self, job: Job) -> bool:
        # A seeded sampling request stays interleaved: its draws then come from the same per-request
        # forwards as alone, bit for bit (a batched forward may differ in the last bits of a logit).
        sampling = job.request.sampling
        return self.batch is not None and (sampling.greedy or sampling.seed is None)

    def _start_row(self, job: Job) -> None:
        """Prefill the request on its own caches, emit its first token, then join the batch."""
        assert self.host is not None and self.target is not None and self.batch is not None
        params = self._params(job)
        state = self.host.new_state(self.target, job.request.prompt, params)
        job.holder = [state]
        if params.max_tokens <= 0:  # as Host.stream: nothing to emit
            self._finish(job, "ok")
            return
        job.row_events = RowEvents(self.target, params.max_tokens, params.stop_token_ids)
        self.host.prefill(state, params.prefill_step_size)
        if self._emit(job, job.row_events.event(GeneratedToken(state.pending, state.pending_logprobs))):
            return
        self.batch.join(state)
        job.row = state

    def _batch_step(self) -> None:
        """One decode step (a batched round or one-token step) for every row of the batch."""
        assert self.host is not None and self.batch is not None
        by_row = {id(j.row): j for j in self.active if j.row is not None}
        jobs = [by_row[id(s)] for s in self.batch.rows]
        try:
            outs = self.host.decode_batch(self.batch)
        except Exception as e:  # noqa: BLE001 - the rows fail, the server keeps serving
            log.exception("batched step of %d requests failed", len(jobs))
            for job in jobs:
                self._finish(job, "error", f"{type(e).__name__}: {e}")
            self.batch = DecodeBatch(self.batch.target)  # nothing of the failed step's caches is reused
            return
        with self.counters._lock:
            self.counters.batched_steps += 1
            self.counters.batched_rows += len(jobs)
        if self.counters.batched_steps % 256 == 0:
            import mlx.core as mx

            mx.clear_cache()
        for job, out in zip(jobs, outs):
            for gen in out.tokens:
                assert job.row_events is not None
                if self._emit(job, job.row_events.event(gen)):
                    break

    def _advance(self, job: Job) -> None:
        if job.cancelled.is_set():
            self._finish(job, "cancelled")
            return
        if job.row is not None:
            return  # a batch row: advanced by _batch_step
        try:
            if job.events is None and job.row_events is None and self._batchable(job):
                self._start_row(job)
                return
            if job.events is None:
                self._start(job)
            event = next(job.events)
        except StopIteration:
            self._finish(job, "ok")
            return
        except Exception as e:  # noqa: BLE001 - one request fails, the server keeps serving
            log.exception("request %s failed", job.id)
            self._finish(job, "error", f"{type(e).__name__}: {e}")
            return
        self._emit(job, event)

    def _emit(self, job: Job, event: HostEvent) -> bool:
        """Send one token to the client; True when the request finished with it."""
        if job.t_first is None:
            job.t_first = time.perf_counter()
        finish = event.finish_reason
        if finish != "stop":
            job.completion_tokens += 1
        if job.matcher.advance(event.token) and finish is None:
            finish = "stop"  # a stop word completed (mlx-lm matches them on tokens)
        req = job.request
        entry = None
        if (req.logprobs or req.top_logprobs) and event.finish_reason != "stop":
            entry = oc.logprob_entry(self.target.tokenizer, event.logprobs, event.token, req.top_logprobs)
        job.out.put(TokenOut(event.token, event.text, finish, entry))
        if finish is not None:
            self._finish(job, "ok")
            return True
        return False

    def _finish(self, job: Job, outcome: str, error: Optional[str] = None) -> None:
        if job.events is not None:
            job.events.close()  # unwinds Host.stream; with holder cleared the caches are freed
        if job.row is not None and self.batch is not None:
            self.batch.leave(job.row)  # its positions leave the batch caches
        job.row, job.row_events = None, None
        state = job.holder[0] if job.holder else None
        spec = state.report.get("speculative") if state is not None else None
        now = time.perf_counter()
        first = job.t_first or now
        prompt_n = len(job.request.prompt)
        t = timings(prompt_n, first - job.t_start if job.t_start else 0.0, job.completion_tokens, now - first, spec)
        job.out.put(Finished(outcome, prompt_n, job.completion_tokens, t, error))
        job.events, job.holder, job.matcher = None, [], None
        if job in self.active:
            self.active.remove(job)
        self.counters.running = len(self.active)
        off = job.request.speculative is False
        self.counters.finished(job.endpoint, outcome, prompt_n if job.t_start else 0, job.completion_tokens, off,
                               spec is not None and spec.fallback is not None)
        if spec is not None and spec.rounds:
            how = (f"speculative {spec.kind}: {spec.rounds} rounds, tau {spec.mean_acceptance_length:.2f}, "
                   f"acceptance {spec.acceptance_rate:.0%} ({spec.accepted_tokens}/{spec.draft_tokens})")
            if spec.fallback:
                how += f", fell back: {spec.fallback}"
        else:
            how = "speculative off" + (" (requested)" if off else "")
        log.info("request %s %s %s: prompt %d tokens, completion %d tokens, %.3f s, %.1f tok/s, %s%s",
                 job.id, job.endpoint, outcome, prompt_n, job.completion_tokens, now - (job.t_start or now),
                 t["predicted_per_second"], how, f", error: {error}" if error else "")


# HTTP ---------------------------------------------------------------------------------------------

class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    # Connections waiting for accept(); the stdlib's 5 reset clients in bursts that the queue (503) would answer.
    request_queue_size = 1024

    def __init__(self, address: Tuple[str, int], engine: Engine, counters: HostCounters, limits: oc.ServingLimits,
                 settings: ServerSettings, models: List[Dict[str, Any]], speculative: Dict[str, Any]):
        super().__init__(address, Handler)
        self.engine = engine
        self.counters = counters
        self.limits = limits
        self.settings = settings
        self.models = models
        self.speculative = speculative
        self.fingerprint = oc.system_fingerprint()


class ClientGone(Exception):
    pass


class Handler(BaseHTTPRequestHandler):
    server: Server
    server_version = "mlx-speculative"
    timeout = 300  # seconds a socket read/write may block (a client that sends less than Content-Length)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's name
        log.debug("%s %s", self.address_string(), format % args)

    # plumbing
    def _send_json(self, status: int, payload: Dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()

    def _send_error(self, e: oc.APIError) -> None:
        try:
            self._send_json(e.status, e.to_dict())
        except OSError:
            pass

    def _authorized(self) -> bool:
        key = self.server.settings.api_key
        if key is None or self.path.split("?")[0] == "/health":
            return True
        got = self.headers.get("Authorization", "")
        if got.startswith("Bearer ") and hmac.compare_digest(got[7:].strip().encode(), key.encode()):
            return True
        self._send_error(oc.APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                     None, "invalid_api_key", "authentication_error"))
        return False

    def _client_gone(self) -> bool:
        """The client closed its connection (nothing more is ever sent after the body)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            if not readable:
                return False
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    # routes
    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        path = self.path.split("?")[0].rstrip("/")
        if path == "/health":
            ok = self.server.engine.healthy
            self._send_json(200 if ok else 503, {"status": "ok" if ok else "unavailable"})
            return
        if not self._authorized():
            return
        if path == "/metrics":
            data = render_metrics(self.server.counters, self.server.speculative.get("active", False)).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        elif path == "/v1/models":
            self._send_json(200, {"object": "list", "data": self.server.models})
        elif path.startswith("/v1/models/"):
            name = path[len("/v1/models/"):]
            found = [m for m in self.server.models if m["id"] == name]
            if found:
                self._send_json(200, found[0])
            else:
                self._send_error(oc.APIError(404, f"model {name!r} is not served here; allowed: "
                                             f"{self.server.limits.model_id!r}", "model", "model_not_found"))
        else:
            self._send_error(oc.APIError(404, f"no route GET {path}; routes: /health, /metrics, /v1/models", None,
                                         "not_found"))

    def do_POST(self) -> None:  # noqa: N802
        path = self.path.split("?")[0].rstrip("/")
        endpoint = {"/v1/chat/completions": "chat", "/chat/completions": "chat", "/v1/completions": "text"}.get(path)
        if endpoint is None:
            self._send_error(oc.APIError(404, f"no route POST {path}; routes: /v1/chat/completions, /v1/completions",
                                         None, "not_found"))
            return
        if not self._authorized():
            return
        counters = self.server.counters
        try:
            length = self.headers.get("Content-Length")
            if length is None:
                raise oc.APIError(411, "the Content-Length header is required", None, "length_required")
            try:
                n = int(length)
            except ValueError:
                raise oc.APIError(400, f"Content-Length: got {length!r}; expected an integer", None, "invalid_header") from None
            if not 0 <= n <= MAX_BODY_BYTES:
                raise oc.APIError(413, f"the request body has {n} bytes; allowed: at most {MAX_BODY_BYTES}", None,
                                  "body_too_large")
            body = oc.parse_body(self.rfile.read(n))
            request = oc.parse_request(endpoint, body, self.server.engine.target.tokenizer, self.server.limits)
            job = Job(request, endpoint)
            self.server.engine.submit(job)
        except oc.APIError as e:
            counters.request(endpoint, "rejected" if e.status == 503 else "invalid")
            log.info("%s request refused (%d): %s", endpoint, e.status, e.message)
            self._send_error(e)
            return
        try:
            if request.stream:
                self._stream(job)
            else:
                self._complete(job)
        except ClientGone:
            self.server.engine.cancel(job)
            self.close_connection = True
            self._drain(job)

    def _next(self, job: Job) -> Any:
        """The job's next output; raises ClientGone when the client disconnects first."""
        while True:
            if time.monotonic() - job.checked >= POLL_SECONDS:
                # Checked while tokens flow too: a non-streaming client never fails a write.
                job.checked = time.monotonic()
                if self._client_gone():
                    raise ClientGone()
            try:
                return job.out.get(timeout=POLL_SECONDS)
            except queue.Empty:
                if not self.server.engine.healthy:
                    return Finished("error", error="the generation thread stopped")

    def _drain(self, job: Job) -> None:
        """Wait (briefly) until the engine has released the cancelled job."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and self.server.engine.healthy:
            try:
                if isinstance(job.out.get(timeout=POLL_SECONDS), Finished):
                    return
            except queue.Empty:
                continue

    def _write(self, data: bytes) -> None:
        try:
            self.wfile.write(data)
            self.wfile.flush()
        except OSError:
            raise ClientGone() from None

    def _chunk(self, payload: Dict[str, Any]) -> None:
        self._write(f"data: {json.dumps(payload)}\n\n".encode())

    def _stream(self, job: Job) -> None:
        req, srv = job.request, self.server
        tokenizer = srv.engine.target.tokenizer
        _, text_sm = oc.stop_machinery(tokenizer, req.stop_words)
        out = oc.ResponseText(tokenizer, text_sm, req.tools, req.initial_state, streaming=True)
        created = int(time.time())
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.end_headers()
        except OSError:
            raise ClientGone() from None
        pending_lp: List[Dict[str, Any]] = []
        finish = "length"

        def body(text: str, reason: Optional[str], reasoning: str = "", calls: Optional[list] = None) -> Dict[str, Any]:
            return oc.response_body(job.endpoint, job.id, req.model, created, srv.fingerprint, True, text, reason,
                                    reasoning, calls, pending_lp or None)

        while True:
            item = self._next(job)
            if isinstance(item, Finished):
                break
            if item.logprob is not None:
                pending_lp.append(item.logprob)
            out.feed(item.text, item.finish_reason)
            if item.finish_reason is not None:
                finish = item.finish_reason
            elif out.ready():
                self._chunk(body(*_text_parts(out.take())))
                pending_lp = []
        if item.outcome == "error":
            self._chunk(oc.APIError(500, f"generation failed: {item.error}", None, "generation_error",
                                    "server_error").to_dict())
        else:
            finish = out.finish(finish)
            final = body(*_text_parts(out.take(), finish))
            final["timings"] = item.timings
            self._chunk(final)
            if req.include_usage:
                self._chunk({"id": job.id, "system_fingerprint": srv.fingerprint, "object": final["object"],
                             "model": req.model, "created": created, "choices": [],
                             "usage": oc.usage(item.prompt_tokens, item.completion_tokens), "timings": item.timings})
        self._write(b"data: [DONE]\n\n")
        self.close_connection = True

    def _complete(self, job: Job) -> None:
        req, srv = job.request, self.server
        tokenizer = srv.engine.target.tokenizer
        _, text_sm = oc.stop_machinery(tokenizer, req.stop_words)
        out = oc.ResponseText(tokenizer, text_sm, req.tools, req.initial_state, streaming=False)
        logprobs: List[Dict[str, Any]] = []
        finish = "length"
        text, reasoning = "", ""
        while True:
            item = self._next(job)
            if isinstance(item, Finished):
                break
            if item.logprob is not None:
                logprobs.append(item.logprob)
            out.feed(item.text, item.finish_reason)
            if item.finish_reason is not None:
                finish = item.finish_reason
        if item.outcome == "error":
            self._send_error(oc.APIError(500, f"generation failed: {item.error}", None, "generation_error", "server_error"))
            return
        finish = out.finish(finish)
        text, reasoning, calls = out.take()
        payload = oc.response_body(job.endpoint, job.id, req.model, int(time.time()), srv.fingerprint, False, text,
                                   finish, reasoning, calls, logprobs or None)
        payload["usage"] = oc.usage(item.prompt_tokens, item.completion_tokens)
        payload["timings"] = item.timings
        try:
            self._send_json(200, payload)
        except OSError:
            raise ClientGone() from None


def _text_parts(parts: Tuple[str, str, list], finish: Optional[str] = None) -> Tuple[str, Optional[str], str, list]:
    text, reasoning, calls = parts
    return text, finish, reasoning, calls


# Start-up -----------------------------------------------------------------------------------------

def load_target(config: HostConfig, model: str) -> Tuple[Host, LoadedTarget, Optional[str]]:
    """Load the target with the plugins; if a plugin cannot even start, serve plain decoding.

    The config is non-strict, so a drafter that fails to load or is incompatible already gives
    a warning and plain decoding; this also covers settings the plugin refuses.
    """
    host = Host(config)
    try:
        return host, host.load(model), None
    except Exception as e:  # noqa: BLE001
        reason = f"{type(e).__name__}: {e}"
    plain = Host(config, pm=make_plugin_manager(load_entry_points=False))
    target = plain.load(model)  # a problem with the model itself raises again here: fatal
    log.warning("the plugins could not start (%s); serving %s with plain decoding", reason, model)
    return plain, target, reason


def _speculative_info(target: LoadedTarget, startup_error: Optional[str]) -> Dict[str, Any]:
    att = target.attachments.get("speculative")
    if att is None:
        return {"active": False, "error": startup_error}
    s = att.settings
    info: Dict[str, Any] = {
        "active": att.drafter is not None, "enabled": s.enabled, "kind": s.kind, "draft_model": s.draft_model,
        "block_size": att.block_size or s.block_size, "adaptive": s.adaptive, "acceptance": s.acceptance,
        "sources": dict(s.sources), "error": att.error or startup_error,
    }
    if att.drafter is not None:
        info.update(kind=att.drafter.kind, family=att.drafter.family)
    return info


def build_server(config: HostConfig, model: str, settings: ServerSettings) -> Server:
    counters = HostCounters()
    box: Dict[str, Any] = {}

    def load() -> Tuple[Host, LoadedTarget]:
        host, target, error = load_target(config, model)
        box["error"] = error
        return host, target

    engine = Engine(load, settings, counters)
    engine.start()
    assert engine.target is not None
    target = engine.target
    try:
        from ..plugin.hookimpls import describe_attachment

        for line in describe_attachment(target):
            log.info("%s", line)
    except ImportError:
        pass
    spec = _speculative_info(target, box.get("error"))
    if spec.get("error"):
        log.warning("speculative decoding is off: %s", spec["error"])
    if (spec.get("enabled") or box.get("error")) and not spec["active"]:
        counters.startup_fallback = 1
    cfg = target.model_config
    ctx = settings.context_length or cfg.get("max_position_embeddings") or (cfg.get("text_config") or {}).get(
        "max_position_embeddings")
    vocab = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
    att = target.attachments.get("speculative")
    names: Tuple[str, ...] = ()
    if att is not None and att.drafter is not None:
        names = tuple(n for n in (att.settings.draft_model, att.drafter.kind) if n)
    limits = oc.ServingLimits(
        model_id=settings.model_name or model, context_length=ctx, **request_defaults(config, settings),
        chat_template_args=dict(settings.chat_template_args), vocab_size=vocab, drafter_names=names,
        draft_tokens=att.block_size - 1 if att is not None and att.drafter is not None else None,
    )
    models = [{"id": limits.model_id, "object": "model", "created": int(time.time()), "owned_by": "mlx-speculative",
               "context_length": ctx, "speculative": spec}]
    server = Server((settings.host, settings.port), engine, counters, limits, settings, models, spec)
    log.info("model %s (id %r), context %s tokens; up to %d requests active, %d queued (503 beyond)%s",
             model, limits.model_id, ctx, settings.max_active, settings.max_queue,
             "; API key required" if settings.api_key else "")
    if engine.batch is not None:
        log.info("scheduling: batched decode steps (one target forward per step for all active requests; "
                 "speculative rounds with per-row acceptance and per-row cache commits; seeded sampling "
                 "requests interleaved)")
    else:
        log.info("scheduling: interleaved, one request's decode step at a time, round robin (no batched steps: %s)",
                 engine.batch_reason)
    return server


def cmd_serve(args: argparse.Namespace, speculative_overrides: Dict[str, Any]) -> int:
    warning = oc.check_mlx_lm_version()
    logging.getLogger("mlx_speculative").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    if warning:
        log.warning("%s", warning)
    overrides = {"speculative": speculative_overrides, "server": serve_overrides(args)}
    config = load_host_config(args.config, overrides, strict=False)
    settings = server_settings(config)
    check_port(settings.host, settings.port)
    model = model_or_demo(args.model, config, speculative_overrides)
    if settings.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("binding %s: the server is reachable from other machines%s", settings.host,
                    "" if settings.api_key else " and no API key is set")
    server = build_server(config, model, settings)
    host, port = server.server_address[:2]
    print(f"[mlx-spec] listening on http://{host}:{port}", file=sys.stderr, flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.engine.stop()
        server.server_close()
    return 0
