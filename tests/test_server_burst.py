"""A burst of 64 simultaneous clients against `server.max_queue: 16`: every client gets an answer
(200 or 503, never a reset connection), and every 200 equals the prompt's answer when it runs alone."""

from __future__ import annotations

import http.client as httpclient
import json
import threading
import urllib.parse
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest

from test_server import PROMPTS, start_server

pytestmark = pytest.mark.server

CLIENTS = 64
MAX_TOKENS = 48


def _post(url: str, prompt: str) -> Tuple[int, Dict[str, Any]]:
    u = urllib.parse.urlsplit(url)
    conn = httpclient.HTTPConnection(u.hostname, u.port, timeout=120)
    try:
        body = json.dumps({"model": "default_model", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0})
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read().decode())
    finally:
        conn.close()


def test_burst_beyond_the_queue_gets_503_never_a_reset(llama_pair: Dict[str, Path], tmp_path: Path) -> None:
    config = {"model": str(llama_pair["target"]), "speculative": {"draft_model": str(llama_pair["drafter"])},
              "server": {"max_active": 8, "max_queue": 16}}
    server = start_server(tmp_path / "burst", config)
    try:
        results: List[Any] = [None] * CLIENTS
        start = threading.Barrier(CLIENTS)

        def client(i: int) -> None:
            start.wait()
            try:
                results[i] = _post(server.url, PROMPTS[i % len(PROMPTS)])
            except Exception as e:  # noqa: BLE001 - a connection error is what this test counts
                results[i] = e

        threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        alone = {p: _post(server.url, p) for p in PROMPTS}
    finally:
        server.stop()

    errors = [r for r in results if not isinstance(r, tuple)]
    assert errors == [], errors[:3]
    statuses = [status for status, _ in results]
    assert set(statuses) <= {200, 503}, statuses
    assert statuses.count(503) >= 1 and statuses.count(200) >= 16, statuses  # the queue alone holds 16
    for i, (status, body) in enumerate(results):
        prompt = PROMPTS[i % len(PROMPTS)]
        if status == 503:
            assert body["error"]["code"] == "server_busy" and "max_queue = 16" in body["error"]["message"]
            continue
        assert alone[prompt][0] == 200
        expected = alone[prompt][1]
        assert body["choices"][0]["text"] == expected["choices"][0]["text"], prompt
        # The same prompt alone may reuse the prompt cache (usage.prompt_tokens_details): the counts match.
        counts = ("prompt_tokens", "completion_tokens", "total_tokens")
        assert [body["usage"][k] for k in counts] == [expected["usage"][k] for k in counts]
