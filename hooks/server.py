"""``mlx-spec serve``: an OpenAI-compatible HTTP server whose generation runs through ``Host``.

Every token comes from the same scheduler ``mlx-spec generate`` runs (hooks/scheduler.py, on the
engine's generation thread: hooks/engine.py), so the speculative plugin (``speculative:`` in the
host YAML, its variables and flags) applies exactly as there. What requests mean
(parameters, chat templates, stop words, response shapes) is mlx-lm's, through
``hooks.openai_compat`` (requests, their fields checked in ``hooks.openai_fields``) and ``hooks.openai_output``
(responses), the two modules coupled to mlx-lm's server. This module is the HTTP side:
routes, authentication, streaming, disconnects, and start-up (loading with the plugins: hooks/host.py).
"""

from __future__ import annotations

import hmac
import json
import logging
import queue
import select
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, List, Optional, Tuple

from . import openai_compat as oc
from . import validate
from . import openai_output as reply
from . import prompt_cache as pc
from .engine import Engine, Finished, Job, TokenOut, make_engine
from .host import describe
from .metrics import HostCounters, render
from .openai_fields import APIError
from .server_settings import ServerSettings, request_defaults
from .state import HostConfig, LoadedTarget

log = logging.getLogger("mlx_speculative.server")

MAX_BODY_BYTES = 16 << 20
POLL_SECONDS = 0.25
INTERRUPTED = "interrupted"  # the finish_reason of a request the server's shutdown ended
SHUTDOWN_SECONDS = 30.0  # at most this long for the generation thread to end its requests, then as long for the clients


# HTTP ---------------------------------------------------------------------------------------------

class Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # server_close() stops accepting; shut_down() waits for the answers in flight itself
    allow_reuse_address = True
    # Connections waiting for a handler thread; beyond the engine's queue the answer is a 503, never a reset.
    request_queue_size = 1024

    def __init__(self, address: Tuple[str, int], engine: Engine, counters: HostCounters, limits: oc.ServingLimits,
                 settings: ServerSettings, models: List[Dict[str, Any]]):
        super().__init__(address, Handler)
        self.engine = engine
        self.counters = counters
        self.limits = limits
        self.settings = settings
        self.models = models
        self.fingerprint = reply.system_fingerprint()
        self.inflight = 0  # POST requests being answered (a shutdown waits for their last bytes)
        self.inflight_cond = threading.Condition()

    def handling(self, delta: int) -> None:
        with self.inflight_cond:
            self.inflight += delta
            self.inflight_cond.notify_all()

    def wait_handlers(self, timeout: float) -> bool:
        """Wait until every POST request was answered; returns whether they all were in ``timeout`` seconds."""
        with self.inflight_cond:
            return self.inflight_cond.wait_for(lambda: self.inflight == 0, timeout)

    def metrics(self) -> str:
        assert self.engine.host is not None
        extra = [m for ms in self.engine.host.pm.hook.host_metrics() if ms for m in ms]
        return render(extra + self.counters.metrics() + pc.metrics(self.engine.prompt_cache))


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
        self._cors()
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()

    def _send_error(self, e: APIError) -> None:
        try:
            self._send_json(e.status, e.to_dict())
        except OSError:
            pass

    def _cors(self) -> None:
        """mlx-lm's CORS headers (``--allowed-origins``, default '*')."""
        allowed = self.server.settings.allowed_origins
        origin = self.headers.get("Origin")
        if "*" in allowed:
            self.send_header("Access-Control-Allow-Origin", "*")
        elif origin in allowed:
            self.send_header("Access-Control-Allow-Origin", origin)
            self.send_header("Vary", "Origin")
        self.send_header("Access-Control-Allow-Methods", "*")
        self.send_header("Access-Control-Allow-Headers", "*")

    def do_OPTIONS(self) -> None:  # noqa: N802 - the stdlib's name; a browser's CORS preflight
        self.send_response(204)
        self._cors()
        self.end_headers()

    def _authorized(self) -> bool:
        key = self.server.settings.api_key
        if key is None or self.path.split("?")[0] == "/health":
            return True
        got = self.headers.get("Authorization", "")
        if got.startswith("Bearer ") and hmac.compare_digest(got[7:].strip().encode(), key.encode()):
            return True
        self._send_error(APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
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
            data = self.server.metrics().encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self._cors()
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
                self._send_error(APIError(404, f"model {name!r} is not served here; allowed: "
                                             f"{self.server.limits.model_id!r}", "model", "model_not_found"))
        else:
            self._send_error(APIError(404, f"no route GET {path}; routes: /health, /metrics, /v1/models", None,
                                         "not_found"))

    def do_POST(self) -> None:  # noqa: N802
        path = self.path.split("?")[0].rstrip("/")
        endpoint = {"/v1/chat/completions": "chat", "/chat/completions": "chat", "/v1/completions": "text"}.get(path)
        if endpoint is None:
            self._send_error(APIError(404, f"no route POST {path}; routes: /v1/chat/completions, /v1/completions",
                                         None, "not_found"))
            return
        if not self._authorized():
            return
        self.server.handling(+1)
        try:
            self._post(endpoint)
        finally:
            self.server.handling(-1)

    def _post(self, endpoint: str) -> None:
        counters = self.server.counters
        try:
            length = self.headers.get("Content-Length")
            if length is None:
                raise APIError(411, "the Content-Length header is required", None, "length_required")
            try:
                n = int(length)
            except ValueError:
                raise APIError(400, f"Content-Length: got {length!r}; expected an integer", None, "invalid_header") from None
            if not 0 <= n <= MAX_BODY_BYTES:
                raise APIError(413, f"the request body has {n} bytes; allowed: at most {MAX_BODY_BYTES}", None,
                                  "body_too_large")
            body = oc.parse_body(self.rfile.read(n))
            request = oc.parse_request(endpoint, body, self.server.engine.target.tokenizer, self.server.limits)
            counters.ignored(request.ignored)
            job = Job(request, endpoint)
            self.server.engine.submit(job)
        except APIError as e:
            counters.request(endpoint, "rejected" if e.status == 503 else "invalid")
            log.info("%s request refused (%d): %s", endpoint, e.status, e.message)
            self._send_error(e)
            return
        except Exception as e:  # noqa: BLE001 - a bug reading a request: an answer, never a dropped connection
            log.exception("%s request failed while being read", endpoint)
            counters.request(endpoint, "error")
            self._send_error(APIError(500, f"the request could not be read: {type(e).__name__}: {e}", None,
                                         "internal_error", "server_error"))
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
        """The job's next output (a step's tokens, a list of ``TokenOut``, or ``Finished``); raises ClientGone when
        the client disconnects first."""
        while True:
            if time.monotonic() - job.checked >= POLL_SECONDS:
                # Checked while tokens flow too: a non-streaming client never fails a write.
                job.checked = time.monotonic()
                if self._client_gone():
                    raise ClientGone()
            try:
                return job.out.get(timeout=POLL_SECONDS)
            except queue.Empty:
                if not self.server.engine.alive:
                    return Finished("error", error="the generation thread stopped")

    def _drain(self, job: Job) -> None:
        """Wait (briefly) until the engine has released the cancelled job."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and self.server.engine.alive:
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
        _, text_sm = reply.stop_machinery(tokenizer, req.stop_words)
        out = reply.ResponseText(tokenizer, text_sm, req.tools, req.initial_state, streaming=True)
        created = int(time.time())
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self._cors()
            self.end_headers()
        except OSError:
            raise ClientGone() from None
        pending_lp: List[Dict[str, Any]] = []
        finish = "length"

        def body(text: str, reason: Optional[str], reasoning: str = "", calls: Optional[list] = None) -> Dict[str, Any]:
            return reply.response_body(job.endpoint, job.id, req.model, created, srv.fingerprint, True, text, reason,
                                    reasoning, calls, pending_lp or None)

        while True:
            item = self._next(job)
            if isinstance(item, Finished):
                break
            ended = _feed(out, item, pending_lp)  # a step's tokens, one chunk for them
            if ended is not None:
                finish = ended
            elif out.ready():
                self._chunk(body(*_text_parts(out.take())))
                pending_lp = []
        if item.outcome == "error":
            self._chunk(APIError(500, f"generation failed: {item.error}", None, "generation_error",
                                    "server_error").to_dict())
        else:
            finish = out.finish(INTERRUPTED if item.outcome == INTERRUPTED else finish)
            final = body(*_text_parts(out.take(), finish))
            final["timings"] = item.timings
            self._chunk(final)
            if req.include_usage:
                self._chunk({"id": job.id, "system_fingerprint": srv.fingerprint, "object": final["object"],
                             "model": req.model, "created": created, "choices": [],
                             "usage": reply.usage(item.prompt_tokens, item.completion_tokens, item.cached_tokens),
                             "timings": item.timings})
        self._write(b"data: [DONE]\n\n")
        self.close_connection = True

    def _complete(self, job: Job) -> None:
        req, srv = job.request, self.server
        tokenizer = srv.engine.target.tokenizer
        _, text_sm = reply.stop_machinery(tokenizer, req.stop_words)
        out = reply.ResponseText(tokenizer, text_sm, req.tools, req.initial_state, streaming=False)
        logprobs: List[Dict[str, Any]] = []
        finish = "length"
        text, reasoning = "", ""
        while True:
            item = self._next(job)
            if isinstance(item, Finished):
                break
            finish = _feed(out, item, logprobs) or finish
        if item.outcome == "error":
            self._send_error(APIError(500, f"generation failed: {item.error}", None, "generation_error", "server_error"))
            return
        finish = out.finish(INTERRUPTED if item.outcome == INTERRUPTED else finish)
        text, reasoning, calls = out.take()
        payload = reply.response_body(job.endpoint, job.id, req.model, int(time.time()), srv.fingerprint, False, text,
                                   finish, reasoning, calls, logprobs or None)
        payload["usage"] = reply.usage(item.prompt_tokens, item.completion_tokens, item.cached_tokens)
        payload["timings"] = item.timings
        try:
            self._send_json(200, payload)
        except OSError:
            raise ClientGone() from None


def _feed(out: reply.ResponseText, tokens: List[TokenOut], logprobs: List[Dict[str, Any]]) -> Optional[str]:
    """A step's tokens into the response text ``out`` and their logprob entries into ``logprobs``; the finish
    reason one of them carries, else None."""
    finish = None
    for token in tokens:
        if token.logprob is not None:
            logprobs.append(token.logprob)
        out.feed(token.text, token.finish_reason)
        finish = token.finish_reason or finish
    return finish


def _text_parts(parts: Tuple[str, str, list], finish: Optional[str] = None) -> Tuple[str, Optional[str], str, list]:
    text, reasoning, calls = parts
    return text, finish, reasoning, calls


# Start-up -----------------------------------------------------------------------------------------

def build_server(config: HostConfig, model: str, settings: ServerSettings, pm: Optional[Any] = None,
                 target: Optional[LoadedTarget] = None, relay: Optional[Any] = None) -> Server:
    """Load the target on the engine's thread and bind the HTTP server (``pm``: the plugins; default:
    the entry points). ``target``: one already loaded (benchmarks build synthetic ones in memory)."""
    engine, box = make_engine(config, model, settings, pm, target, relay)
    counters = engine.counters
    engine.start()
    assert engine.host is not None and engine.target is not None
    target = engine.target
    descriptions = describe(engine.host, target, box.get("error"))
    for d in descriptions:
        for line in d.lines:
            (log.info if d.active or not d.info.get("error") else log.warning)("%s", line)
    spec = next((d for d in descriptions if d.draft_tokens is not None), None)
    counters.speculative_active = int(spec is not None)
    if spec is None and any(d.info.get("error") or d.info.get("enabled") for d in descriptions):
        counters.startup_fallback = 1
    if settings.chat_template is not None:  # this server's tokenizer only, as mlx-lm's --chat-template
        target.tokenizer.chat_template = settings.chat_template
        target.tokenizer.has_chat_template = True
    cfg = target.model_config
    ctx = settings.context_length or validate.context_length(cfg)
    vocab = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
    limits = oc.ServingLimits(
        model_id=settings.model_name or model, context_length=ctx, **request_defaults(config, settings),
        chat_template_args=dict(settings.chat_template_args), vocab_size=vocab,
        drafter_names=spec.draft_names if spec is not None else (),
        draft_tokens=spec.draft_tokens if spec is not None else None,
    )
    entry: Dict[str, Any] = {"id": limits.model_id, "object": "model", "created": int(time.time()),
                             "owned_by": "mlx-speculative", "context_length": ctx}
    for d in descriptions:
        entry[d.name] = {"active": d.active, **d.info}
    server = Server((settings.host, settings.port), engine, counters, limits, settings, [entry])
    log.info("model %s (id %r), context %s tokens; up to %d requests active, %d queued (503 beyond)%s",
             model, limits.model_id, ctx, settings.max_active, settings.max_queue,
             "; API key required" if settings.api_key else "")
    log.info("scheduling: %s", "requests share decode steps (one target forward per step for the rows of a batch; "
             "per-row acceptance and cache commits; long prompts prefilled "
             f"in chunks of {settings.prefill_step_size} between decode steps)" if settings.batching
             else "each request decodes in a batch of its own (server.batching is false)")
    log.info("prompt cache: %s", pc.describe(engine.prompt_cache, settings.prompt_cache_bytes is not None,
                                             settings.prompt_cache_size))
    return server
