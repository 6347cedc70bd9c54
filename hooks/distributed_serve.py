"""``mlx-spec serve`` over a target sharded on several ranks: rank 0 serves HTTP, every other rank follows its engine.

Rank 0's generation thread (hooks/engine.py) sends, before each scheduler step, the requests it admits (parsed, as
the HTTP thread left them) and the scheduler ids it cancels (``Relay.send``); every other rank (``follow``) submits
and cancels the same, then takes the same ``Scheduler.step()``: the same rows in the same batches, the same rounds.
While rank 0 is idle it sends an empty step every ``HEARTBEAT_S`` seconds, so that a rank that died is noticed
within that time; a failed exchange ends the rank at once (``distributed.failed``), and with it the others.

A sampling request without a seed gets one from rank 0, so that every rank draws the same tokens.
A message is a length (one int32 broadcast), then, if anything is to be said, the pickled bytes (a uint8 broadcast).
The ranks trust each other (as mx.distributed's ring connections do).
"""

from __future__ import annotations

import dataclasses
import pickle
import secrets
from typing import Any, Dict, List, Sequence, Tuple

import mlx.core as mx

from . import distributed

HEARTBEAT_S = 1.0
Message = Tuple[List[Any], List[int], bool]  # (parsed requests admitted, scheduler ids cancelled, stop)


class Relay:
    """Rank 0's engine steps, sent to (rank 0) or received by (the others) every rank."""

    heartbeat_s = HEARTBEAT_S

    def __init__(self, cluster: distributed.Cluster):
        self.cluster = cluster

    def agree_bytes(self, limit: int) -> int:
        """Rank 0's prompt-cache size on every rank (its default depends on the machine's memory)."""
        try:
            return int(self.cluster.agree(float(limit)))
        except Exception as e:  # noqa: BLE001 - a failed exchange ends the rank
            distributed.failed(self.cluster, e)

    def _exchange(self, payload: bytes) -> bytes:
        (n,) = self.cluster.broadcast_ints([len(payload)], 1)
        if not n:
            return b""
        data = mx.array(list(payload) if self.cluster.primary else [0] * n, dtype=mx.uint8)
        return bytes(self.cluster.broadcast(data).tolist())

    def send(self, requests: Sequence[Any], cancels: Sequence[int], stop: bool = False) -> None:
        """Rank 0, before its scheduler step: what the other ranks must do alike (nothing: one int32 broadcast)."""
        for parsed in requests:  # without a seed each rank would draw its own entropy and sample apart
            if parsed.sampling.seed is None and not parsed.sampling.greedy:
                parsed.sampling = dataclasses.replace(parsed.sampling, seed=secrets.randbits(31))
        payload = pickle.dumps((list(requests), list(cancels), stop)) if requests or cancels or stop else b""
        try:
            self._exchange(payload)
        except Exception as e:  # noqa: BLE001 - a peer failed: every rank stops
            distributed.failed(self.cluster, e)

    def receive(self) -> Message:
        payload = self._exchange(b"")
        return pickle.loads(payload) if payload else ([], [], False)


def follow(engine: Any, relay: Relay) -> int:
    """A rank other than 0: load and warm up as rank 0 does, then repeat rank 0's engine steps until it stops."""
    try:
        engine.setup()
        scheduler = engine.scheduler
        requests: Dict[int, Any] = {}
        while True:
            admitted, cancels, stop = relay.receive()
            if stop:  # rank 0 shuts down: its requests end now (Engine._interrupt_all)
                for request in requests.values():
                    scheduler.cancel(request)
                scheduler.step()
                return 0
            for parsed in admitted:
                try:
                    request = scheduler.submit(parsed.prompt, engine.params(parsed))
                except Exception:  # noqa: BLE001 - rank 0's submit failed alike; the request never runs
                    continue
                requests[request.id] = request
            for rid in cancels:
                if rid in requests:
                    scheduler.cancel(requests[rid])
            scheduler.step()
            requests = {rid: r for rid, r in requests.items() if not r.done}
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - this rank ends, and with it the others
        distributed.failed(relay.cluster, e)
