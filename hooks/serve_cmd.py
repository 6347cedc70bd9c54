"""``mlx-spec serve``'s start and end: settings checked before the model loads, the HTTP server bound
(hooks/server.py), and on SIGINT / SIGTERM an orderly shutdown: no new connections, every request in
flight ended (streams with their final chunk and ``[DONE]``), the generation thread joined, exit 0."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from typing import Any

from . import distributed
from . import openai_compat as oc
from .config import load_host_config, model_or_demo, plugin_overrides
from .distributed_serve import Relay, follow
from .engine import make_engine
from .manager import plugins
from .server import INTERRUPTED, SHUTDOWN_SECONDS, Server, build_server, log
from .server_settings import check_port, request_defaults, serve_overrides, server_settings


def cmd_serve(args: argparse.Namespace) -> int:
    pm = plugins(args)
    overrides = plugin_overrides(pm, args, "serve")
    warning = oc.check_mlx_lm_version()
    overrides.update(serve_overrides(args))
    config = load_host_config(args.config, overrides, strict=False)
    cluster = distributed.start(args, args.config)
    relay = Relay(cluster) if cluster is not None else None
    settings = server_settings(config)
    request_defaults(config, settings)  # the generation flags checked before the model loads
    level = settings.log_level or ("DEBUG" if args.verbose else "INFO")
    logging.getLogger("mlx_speculative").setLevel(level)
    if warning:
        log.warning("%s", warning)
    model = model_or_demo(args.model, config, pm)
    if relay is not None and not relay.cluster.primary:  # no HTTP here: repeat rank 0's engine steps
        return follow(make_engine(config, model, settings, relay=relay)[0], relay)
    check_port(settings.host, settings.port)  # before the model loads
    if settings.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("binding %s: the server is reachable from other machines%s", settings.host,
                    "" if settings.api_key else " and no API key is set")
    server = build_server(config, model, settings, relay=relay)
    host, port = server.server_address[:2]
    stopping = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        if stopping.is_set():  # a second Ctrl-C: no more waiting (os._exit: no interpreter exit to abort in)
            sys.stderr.write("[mlx-spec] interrupted again: exiting now\n")
            sys.stderr.flush()
            os._exit(130)
        stopping.set()
        threading.Thread(target=server.shutdown, name="mlx-spec-shutdown", daemon=True).start()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    print(f"[mlx-spec] listening on http://{host}:{port}", file=sys.stderr, flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        shut_down(server)
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 0


def shut_down(server: Server) -> None:
    """Stop accepting, end every request (streams get their final chunk and [DONE]), join the generation
    thread, and wait for the answers to go out."""
    server.server_close()  # no new connections
    log.info("shutting down: no new requests; the %d in flight end now with finish_reason %r",
             server.counters.running + server.counters.waiting, INTERRUPTED)
    if not server.engine.stop(SHUTDOWN_SECONDS):
        log.error("the generation thread did not end within %.0f s; exiting without it", SHUTDOWN_SECONDS)
        sys.stderr.flush()
        os._exit(1)  # the interpreter's exit would abort inside mlx (see Engine.stop)
    if not server.wait_handlers(SHUTDOWN_SECONDS):
        log.warning("some clients were still being answered after %.0f s", SHUTDOWN_SECONDS)
