"""`mlx-spec serve` with mlx-lm's server flags, and Ctrl-C (SIGINT) while a stream is in flight: one real
server process for all of it."""

from __future__ import annotations

import http.client as httpclient
import json
import signal
import urllib.parse
from pathlib import Path
from typing import Dict, List, Optional

import pytest

from conftest import greedy_reference
from test_server import PROMPTS, _completion, _ids, start_server

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


def test_mlx_lm_serve_flags_and_sigint_mid_stream(llama_pair: Dict[str, Path], tmp_path: Path) -> None:
    from mlx_lm import load

    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ prefix }}{{ m['content'] }}\n{% endfor %}")
    s = start_server(tmp_path / "s", {"model": str(llama_pair["target"])}, args=[
        "--temp", "0.8", "--top-k", "1", "--top-p", "0.9", "--min-p", "0.05", "--chat-template", str(template),
        "--chat-template-args", '{"prefix": "say: "}', "--allowed-origins", "http://ui.example",
        "--log-level", "DEBUG", "--prompt-cache-size", "1"])
    try:
        model, tokenizer = load(str(llama_pair["target"]))
        # --temp/--top-k/...: the defaults of requests that leave them out (top-k 1: the greedy tokens at temp
        # 0.8; a request's own top_k 0 samples at the server's temp 0.8, seeded)
        def ids(**body: object) -> List[int]:
            r = s.post("/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 24, "logprobs": True, **body})
            assert r.status_code == 200, r.text
            return _ids(r.json()["choices"][0])

        greedy = greedy_reference(model, tokenizer.encode(PROMPTS[1]), 24)
        assert ids() == greedy[: len(ids())] and ids(top_k=0, seed=3) != greedy[: len(ids(top_k=0, seed=3))]
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
        u = urllib.parse.urlsplit(s.url)
        conn = httpclient.HTTPConnection(u.hostname, u.port, timeout=60)
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": PROMPTS[1], "max_tokens": 4000,
                                                                 "stream": True}),
                     headers={"Content-Type": "application/json"})
        reply = conn.getresponse()
        assert reply.status == 200
        assert [reply.readline() for _ in range(4)][0].startswith(b"data: ")
        s.proc.send_signal(signal.SIGINT)
        events: List[str] = [line[6:] for line in reply.read().decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        final = json.loads(events[-2])
        assert final["choices"][0]["finish_reason"] == "interrupted" and final["timings"]["predicted_n"] < 4000
        assert s.proc.wait(30) == 0
    finally:
        s.stop()
    log = s.log
    assert "shutting down" in log and "Traceback" not in log and "terminate called" not in log, log
