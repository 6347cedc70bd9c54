"""`mlx-spec serve` with mlx-lm's server flags, and Ctrl-C (SIGINT) while a stream is in flight, on one real
server process; SIGTERM with a streamed and a whole request in flight, on another."""

from __future__ import annotations

import http.client as httpclient
import json
import signal
import threading
import urllib.parse
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest

from conftest import greedy_reference, wait_for
from test_server import PROMPTS, Reply, _completion, _ids, start_server

pytestmark = pytest.mark.server


def _options(url: str, origin: str) -> Optional[str]:
    u = urllib.parse.urlsplit(url)
    conn = httpclient.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request("OPTIONS", "/v1/completions", headers={"Origin": origin})
    r = conn.getresponse()
    assert r.status == 204
    allowed = r.getheader("Access-Control-Allow-Origin")
    conn.close()
    return allowed


def _stream(url: str, max_tokens: int) -> Tuple[httpclient.HTTPConnection, httpclient.HTTPResponse]:
    """A streaming completion, its first events read (it is generating)."""
    u = urllib.parse.urlsplit(url)
    conn = httpclient.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps({"prompt": PROMPTS[1], "max_tokens": max_tokens,
                                                             "stream": True}),
                 headers={"Content-Type": "application/json"})
    reply = conn.getresponse()
    assert reply.status == 200
    assert [reply.readline() for _ in range(4)][0].startswith(b"data: ")
    return conn, reply


def _ends_interrupted(reply: httpclient.HTTPResponse, max_tokens: int) -> None:
    """The rest of a stream the server's shutdown ended: a final chunk (finish_reason interrupted), [DONE]."""
    events: List[str] = [line[6:] for line in reply.read().decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    final = json.loads(events[-2])
    assert final["choices"][0]["finish_reason"] == "interrupted" and final["timings"]["predicted_n"] < max_tokens


def test_mlx_lm_serve_flags_and_sigint_mid_stream(llama_pair: Dict[str, Path], tmp_path: Path) -> None:
    from mlx_lm import load

    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ prefix }}{{ m['content'] }}\n{% endfor %}")
    # --top-k 1, --top-p 0.01 and --min-p 1 each keep only the most likely token: sampling at --temp 0.8
    # gives the greedy tokens unless a request lifts all three
    s = start_server(tmp_path / "s", {"model": str(llama_pair["target"])}, args=[
        "--temp", "0.8", "--top-k", "1", "--top-p", "0.01", "--min-p", "1", "--chat-template", str(template),
        "--chat-template-args", '{"prefix": "say: "}', "--allowed-origins", "http://ui.example",
        "--log-level", "DEBUG", "--prompt-cache-size", "1"])
    try:
        model, tokenizer = load(str(llama_pair["target"]))
        # --temp/--top-k/--top-p/--min-p: the defaults of requests that leave them out
        def ids(**body: object) -> List[int]:
            r = s.post("/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 24, "logprobs": True, "seed": 3,
                                           **body})
            assert r.status_code == 200, r.text
            return _ids(r.json()["choices"][0])

        greedy = greedy_reference(model, tokenizer.encode(PROMPTS[1]), 24)
        sampled = ids(top_k=0, top_p=1.0, min_p=0.0)  # at the server's temp 0.8
        assert sampled != greedy[: len(sampled)]
        for kept in ("top_k", "top_p", "min_p"):  # the server's value of this one alone keeps the top token
            lifted = ids(**{k: v for k, v in (("top_k", 0), ("top_p", 1.0), ("min_p", 0.0)) if k != kept})
            assert lifted == greedy[: len(lifted)], kept
        # --chat-template with --chat-template-args
        r = s.client().chat.completions.create(model="default_model", max_tokens=2,
                                               messages=[{"role": "user", "content": "the model"}])
        assert r.usage.prompt_tokens == len(tokenizer.encode("say: the model\n", add_special_tokens=False))
        # --allowed-origins
        assert _options(s.url, "http://ui.example") == "http://ui.example"
        assert _options(s.url, "http://elsewhere.example") is None
        # --prompt-cache-size 1: one entry kept, older ones evicted
        m = s.metrics()
        assert m["mlx_spec_prompt_cache_entries"] == 1 and m["mlx_spec_prompt_cache_evictions_total"] >= 1
        # --log-level DEBUG: the ignored fields are logged at debug
        _completion(s, PROMPTS[0], max_tokens=2, extra_body={"reasoning_effort": "low"})
        assert "ignoring fields reasoning_effort" in s.log and "at most 1 entries (server.prompt_cache_size)" in s.log

        # SIGINT while a stream is in flight: its final chunk, [DONE], exit 0
        _, reply = _stream(s.url, 4000)
        s.proc.send_signal(signal.SIGINT)
        _ends_interrupted(reply, 4000)
        assert s.proc.wait(30) == 0
    finally:
        s.stop()
    log = s.log
    assert "shutting down" in log and "Traceback" not in log and "terminate called" not in log, log


def test_sigterm_ends_every_request_in_flight(llama_pair: Dict[str, Path], tmp_path: Path) -> None:
    """SIGTERM (a service manager's stop) with two requests decoding speculatively, one streamed, one not."""
    s = start_server(tmp_path / "s", {"model": str(llama_pair["target"]),
                                      "speculative": {"draft_model": str(llama_pair["drafter"])}})
    try:
        answers: List[Reply] = []
        whole = threading.Thread(target=lambda: answers.append(s.post("/v1/completions", {
            "prompt": PROMPTS[0], "max_tokens": 4000})))
        _, reply = _stream(s.url, 4000)
        whole.start()
        wait_for(lambda: s.metrics()["mlx_spec_requests_running"] == 2, 30, lambda: f"not both running: {s.metrics()}")
        s.proc.send_signal(signal.SIGTERM)
        _ends_interrupted(reply, 4000)
        whole.join(60)
        assert len(answers) == 1 and answers[0].status_code == 200, answers
        choice = answers[0].json()["choices"][0]
        assert choice["finish_reason"] == "interrupted" and answers[0].json()["usage"]["completion_tokens"] < 4000
        assert s.proc.wait(30) == 0
    finally:
        s.stop()
    assert "shutting down" in s.log and "Traceback" not in s.log and "terminate called" not in s.log, s.log
