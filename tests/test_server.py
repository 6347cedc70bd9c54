"""`mlx-spec serve` as a real process on a free loopback port, driven with the `openai` client.

Tiny real mlx-lm checkpoints (conftest's llama_pair); every comparison is token for token.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import http.client as httpclient
import urllib.parse

import pytest
import yaml

from conftest import wait_for

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.server

PROMPTS = [
    "the model token draft verify",
    "red green blue one two three red green blue one two",
    "river stone light night day code",
    "accept commit accept commit accept commit accept",
    "one two three four five six seven eight nine ten",
]
N_TOKENS = 40


class Reply:
    """A plain HTTP answer (stdlib http.client: the tests need no HTTP library of their own)."""

    def __init__(self, status: int, text: str):
        self.status_code, self.text = status, text

    def json(self) -> Any:
        return json.loads(self.text)


def http(method: str, url: str, content: Optional[bytes] = None, headers: Optional[Dict[str, str]] = None,
         timeout: float = 60) -> Reply:
    u = urllib.parse.urlsplit(url)
    conn = httpclient.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        conn.request(method, u.path, body=content, headers=headers or {})
        r = conn.getresponse()
        return Reply(r.status, r.read().decode())
    finally:
        conn.close()


class ServerProc:
    def __init__(self, proc: subprocess.Popen, url: str, log_path: Path):
        self.proc, self.url, self.log_path = proc, url, log_path

    @property
    def log(self) -> str:
        return self.log_path.read_text()

    def client(self, api_key: str = "unused") -> "openai.OpenAI":
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=60)

    def post(self, path: str, body: Any, raw: Optional[bytes] = None, headers: Optional[Dict[str, str]] = None) -> Reply:
        content = raw if raw is not None else json.dumps(body).encode()
        return http("POST", self.url + path, content, {"Content-Type": "application/json", **(headers or {})})

    def get(self, path: str, headers: Optional[Dict[str, str]] = None) -> Reply:
        return http("GET", self.url + path, headers=headers)

    def metrics(self, headers: Optional[Dict[str, str]] = None) -> Dict[str, float]:
        text = self.get("/metrics", headers).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def start_server(tmp: Path, config: Dict[str, Any], env: Optional[Dict[str, str]] = None, args: List[str] = ()) -> ServerProc:
    """``python -m mlx_speculative.hooks.cli serve`` on port 0 (the server reports the port it got)."""
    tmp.mkdir(parents=True, exist_ok=True)
    cfg = tmp / "host.yaml"
    cfg.write_text(yaml.safe_dump(config))
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MLX_VLM_") and k != "MLX_SPEC_API_KEY"}
    environ.update(HF_HUB_OFFLINE="1", **(env or {}))
    log_path = tmp / "server.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "mlx_speculative.hooks.cli", "serve", "--config", str(cfg),
                                 "--port", "0", *args], stdout=subprocess.DEVNULL, stderr=log, env=environ)

    def listening() -> Optional[re.Match]:
        # The server prints this line once its engine has set `ready` (model loaded, warm-up done) and the
        # socket is bound: the readiness event, as another process can see it.
        found = re.search(r"listening on (http://127\.0\.0\.1:\d+)", log_path.read_text())
        if not found and proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}:\n{log_path.read_text()}")
        return found

    try:
        found = wait_for(listening, 90, lambda: f"server did not start:\n{log_path.read_text()}")
    except AssertionError:
        proc.kill()
        raise
    return ServerProc(proc, found.group(1), log_path)


@pytest.fixture(scope="module")
def servers(llama_pair: Dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dict[str, ServerProc]]:
    root = tmp_path_factory.mktemp("servers")
    target = str(llama_pair["target"])
    started: Dict[str, ServerProc] = {}
    try:
        started["spec"] = start_server(root / "spec", {
            "model": target, "server": {"max_tokens": 64, "max_active": 8},
            "speculative": {"draft_model": str(llama_pair["drafter"]), "block_size": 4}})
        started["plain"] = start_server(root / "plain", {"model": target, "server": {"max_tokens": 64}})
        yield started
    finally:
        for s in started.values():
            s.stop()


def _ids(choice: Dict[str, Any]) -> List[int]:
    return [e["id"] for e in choice["logprobs"]["content"]]


def _chat(server: ServerProc, text: str, **kw: Any) -> Dict[str, Any]:
    r = server.client().chat.completions.create(
        model="default_model", messages=[{"role": "user", "content": text}], max_tokens=N_TOKENS, temperature=0,
        logprobs=True, **kw)
    return r.to_dict()


def _completion(server: ServerProc, text: str, **kw: Any) -> Dict[str, Any]:
    kw.setdefault("max_tokens", N_TOKENS)
    kw.setdefault("temperature", 0)
    r = server.client().completions.create(model="default_model", prompt=text,
                                           extra_body={"logprobs": True, **kw.pop("extra_body", {})}, **kw)
    return r.to_dict()


def _stream_chat(server: ServerProc, text: str, **kw: Any) -> Dict[str, Any]:
    chunks = list(server.client().chat.completions.create(
        model="default_model", messages=[{"role": "user", "content": text}], max_tokens=N_TOKENS, temperature=0,
        stream=True, stream_options={"include_usage": True}, **kw))
    return _collect(chunks, chat=True)


def _stream_completion(server: ServerProc, text: str, **kw: Any) -> Dict[str, Any]:
    kw.setdefault("max_tokens", N_TOKENS)
    kw.setdefault("temperature", 0)
    chunks = list(server.client().completions.create(
        model="default_model", prompt=text, stream=True, stream_options={"include_usage": True}, **kw))
    return _collect(chunks, chat=False)


def _collect(chunks: List[Any], chat: bool) -> Dict[str, Any]:
    dicts = [c.to_dict() for c in chunks]
    text, finish, timings, with_text = "", None, None, 0
    for d in dicts[:-1]:
        choice = d["choices"][0]
        part = (choice["delta"].get("content") or "") if chat else choice["text"]
        text += part
        with_text += bool(part)
        finish = choice["finish_reason"] or finish
        timings = d.get("timings") or timings
    usage = dicts[-1]
    assert usage["choices"] == [] and "usage" in usage, "the last chunk carries the usage"
    assert finish is not None and timings is not None
    return {"text": text, "finish_reason": finish, "usage": usage["usage"], "timings": timings, "chunks": with_text}


# Tests -----------------------------------------------------------------------------------------------

def test_health_models_and_startup_log(servers: Dict[str, ServerProc], llama_pair: Dict[str, Path]) -> None:
    spec = servers["spec"]
    assert spec.get("/health").json() == {"status": "ok"}
    models = spec.client().models.list().data
    assert [m.id for m in models] == [str(llama_pair["target"])]
    info = models[0].to_dict()["speculative"]
    assert info["active"] and info["kind"] == "draft_model" and info["block_size"] == 4
    # One line says what runs and where each setting came from (issue 14: not twice, no "None" for auto).
    assert spec.log.count("speculative decoding on") == 1 and "speculative on:" not in spec.log
    assert "speculative decoding on: kind draft_model (family draft_model), block size 4 (pinned)" in spec.log
    assert "draft_model: yaml" in spec.log and "block_size: yaml" in spec.log and "None" not in spec.log
    assert servers["plain"].client().models.list().data[0].to_dict()["speculative"]["active"] is False


def test_greedy_outputs_identical_with_and_without_speculative(servers: Dict[str, ServerProc], llama_pair: Dict[str, Path]) -> None:
    from conftest import greedy_reference

    from mlx_lm import load

    model, tokenizer = load(str(llama_pair["target"]))
    drafted = accepted = streamed_accepted = 0
    for text in PROMPTS:
        spec_c, plain_c = _completion(servers["spec"], text), _completion(servers["plain"], text)
        ref = greedy_reference(model, list(tokenizer.encode(text)), N_TOKENS)
        eos = set(tokenizer.eos_token_ids)
        ref = ref[: next((i for i, t in enumerate(ref) if t in eos), len(ref))]
        assert _ids(spec_c["choices"][0]) == _ids(plain_c["choices"][0]) == ref[: len(_ids(plain_c["choices"][0]))]
        assert spec_c["choices"][0]["text"] == plain_c["choices"][0]["text"]
        assert spec_c["usage"] == plain_c["usage"]
        assert plain_c["timings"]["draft_n"] == 0
        drafted += spec_c["timings"]["draft_n"]
        accepted += spec_c["timings"]["draft_n_accepted"]

        spec_chat, plain_chat = _chat(servers["spec"], text), _chat(servers["plain"], text)
        assert _ids(spec_chat["choices"][0]) == _ids(plain_chat["choices"][0])
        assert spec_chat["choices"][0]["message"] == plain_chat["choices"][0]["message"]
        drafted += spec_chat["timings"]["draft_n"]
        accepted += spec_chat["timings"]["draft_n_accepted"]

        for fn in (_stream_chat, _stream_completion):
            s, p = fn(servers["spec"], text), fn(servers["plain"], text)
            assert s["text"] == p["text"] and s["finish_reason"] == p["finish_reason"] and s["usage"] == p["usage"]
        streamed = _stream_completion(servers["spec"], text)
        assert streamed["text"] == spec_c["choices"][0]["text"]
        # A round's tokens reach the client together: at most one chunk a decode step.
        assert streamed["chunks"] <= streamed["usage"]["completion_tokens"] - streamed["timings"]["draft_n_accepted"]
        streamed_accepted += streamed["timings"]["draft_n_accepted"]
    # The drafter disagrees sometimes: partial acceptance, so the comparison can fail.
    assert 0 < accepted < drafted and streamed_accepted > 0


def test_chat_template_is_the_tokenizers(servers: Dict[str, ServerProc], llama_pair: Dict[str, Path]) -> None:
    from mlx_lm import load

    _, tokenizer = load(str(llama_pair["target"]))
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the model token"}]
    expected = len(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    r = servers["spec"].client().chat.completions.create(model="default_model", messages=messages, max_tokens=3)
    assert r.usage.prompt_tokens == expected
    # Content parts (mlx-lm's process_message_content) give the same prompt.
    parts = [{"role": "system", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
             {"role": "user", "content": "the model token"}]
    r2 = servers["spec"].client().chat.completions.create(model="default_model", messages=parts, max_tokens=3)
    assert r2.usage.prompt_tokens == expected and r2.choices[0].message.content == r.choices[0].message.content


def test_metrics_move_with_rounds_and_agree_with_timings(servers: Dict[str, ServerProc]) -> None:
    spec = servers["spec"]
    keys = ["spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total"]
    for fn in (_completion, _stream_completion, _chat):
        before = spec.metrics()
        r = fn(spec, PROMPTS[1])
        after = spec.metrics()
        t = r["timings"]
        delta = {k: after.get(k, 0) - before.get(k, 0) for k in keys}
        assert t["draft_rounds"] > 0
        assert delta == {keys[0]: t["draft_rounds"], keys[1]: t["draft_n"], keys[2]: t["draft_n_accepted"]}
        per_pos = sum(v - before.get(k, 0) for k, v in after.items() if k.startswith("spec_decode_num_accepted_tokens_per_pos_total"))
        assert per_pos == t["draft_n_accepted"]
        assert after["mlx_spec_generation_tokens_total"] - before["mlx_spec_generation_tokens_total"] == r["usage"]["completion_tokens"]
        assert after["mlx_spec_prompt_tokens_total"] - before["mlx_spec_prompt_tokens_total"] == r["usage"]["prompt_tokens"]
    m = spec.metrics()
    assert m['mlx_spec_requests_total{endpoint="text",outcome="ok"}'] >= 2
    assert m["mlx_spec_speculative_active"] == 1 and m["mlx_spec_requests_running"] == 0
    assert "spec_decode_num_accepted_tokens_per_pos_total{position=\"0\"}" in m
    assert re.search(r"request cmpl-\w+ text ok: .* tau \d+\.\d\d", spec.log), "one log line per request with tau"


def test_per_request_speculative_off(servers: Dict[str, ServerProc]) -> None:
    spec = servers["spec"]
    on = _completion(spec, PROMPTS[0])
    before = spec.metrics()
    off = _completion(spec, PROMPTS[0], extra_body={"speculative": False})
    off2 = _completion(spec, PROMPTS[0], extra_body={"num_draft_tokens": 0})
    after = spec.metrics()
    assert off["timings"]["draft_n"] == off2["timings"]["draft_n"] == 0 and on["timings"]["draft_n"] > 0
    assert _ids(off["choices"][0]) == _ids(on["choices"][0]) == _ids(off2["choices"][0])
    assert after["spec_decode_num_drafts_total"] == before["spec_decode_num_drafts_total"]
    assert after["mlx_spec_speculative_off_requests_total"] - before["mlx_spec_speculative_off_requests_total"] == 2


def test_stop_words_and_max_tokens(servers: Dict[str, ServerProc], llama_pair: Dict[str, Path]) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(llama_pair["target"] / "tokenizer.json"))
    full = _completion(servers["spec"], PROMPTS[2])
    ids, text = _ids(full["choices"][0]), full["choices"][0]["text"]
    for k in range(3, len(ids) - 2):
        word = tok.decode(ids[k:k + 2])
        prefix = tok.decode(ids[:k])
        if word.strip() and tok.encode(word, add_special_tokens=False).ids == ids[k:k + 2] and text.find(word) == len(prefix):
            break
    else:
        pytest.skip("no stop word that re-encodes to the same tokens")
    for server in (servers["spec"], servers["plain"]):
        r = _completion(server, PROMPTS[2], stop=[word])
        assert r["choices"][0]["finish_reason"] == "stop" and r["choices"][0]["text"] == prefix
        assert r["usage"]["completion_tokens"] == k + 2  # mlx-lm counts the stop word's tokens
        s = _stream_completion(server, PROMPTS[2], stop=word)
        assert s["finish_reason"] == "stop" and s["text"] == prefix
    r = _completion(servers["spec"], PROMPTS[2], max_tokens=5)
    assert r["usage"]["completion_tokens"] == 5 and r["choices"][0]["finish_reason"] == "length"


def test_concurrent_clients_get_what_they_get_alone(servers: Dict[str, ServerProc]) -> None:
    spec = servers["spec"]
    alone = {(p, s): (_stream_completion if s else _completion)(spec, p) for p in PROMPTS for s in (False, True)}
    seeded_alone = _completion(spec, PROMPTS[0], temperature=0.9, seed=7)
    results: Dict[Any, Any] = {}
    errors: List[BaseException] = []

    def worker(i: int) -> None:
        try:
            for j in range(2):
                p, s = PROMPTS[(i + j) % len(PROMPTS)], (i + j) % 2 == 1
                results[(i, j)] = ((p, s), (_stream_completion if s else _completion)(spec, p))
            results[(i, "seeded")] = _completion(spec, PROMPTS[0], temperature=0.9, seed=7)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    for key, value in results.items():
        if key[1] == "seeded":
            assert value["choices"][0]["text"] == seeded_alone["choices"][0]["text"]
            continue
        (p, s), r = value
        ref = alone[(p, s)]
        text = r["text"] if s else r["choices"][0]["text"]
        assert text == (ref["text"] if s else ref["choices"][0]["text"])
        if not s:
            assert _ids(r["choices"][0]) == _ids(ref["choices"][0])
    assert len(results) == 8 * 3


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_stops_generation(servers: Dict[str, ServerProc], stream: bool) -> None:
    spec = servers["spec"]
    cancelled = 'mlx_spec_requests_total{endpoint="text",outcome="cancelled"}'
    before = spec.metrics()
    u = urllib.parse.urlsplit(spec.url)
    conn = httpclient.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps({"prompt": PROMPTS[0], "max_tokens": 3000, "stream": stream}),
                 headers={"Content-Type": "application/json"})
    if stream:
        r = conn.getresponse()
        assert r.status == 200
        got = [r.readline() for _ in range(6)]
        assert any(line.startswith(b"data: ") for line in got)
        r.close()  # the client goes away mid-stream
    else:  # nothing sent yet: the client leaves once the engine runs the request (admitted, generating)
        wait_for(lambda: spec.metrics()["mlx_spec_requests_running"] >= 1, 30, lambda: f"never running: {spec.metrics()}")
    conn.close()

    def stopped() -> Optional[Dict[str, float]]:
        m = spec.metrics()
        return m if m.get(cancelled, 0) > before.get(cancelled, 0) and m["mlx_spec_requests_running"] == 0 else None

    m = wait_for(stopped, 10, lambda: f"the request was not cancelled: {spec.metrics()}")
    # Stopped early: far fewer than 3000 tokens were generated.
    assert m["mlx_spec_generation_tokens_total"] - before["mlx_spec_generation_tokens_total"] < 2000
    assert _completion(spec, PROMPTS[0])["choices"][0]["finish_reason"] in ("length", "stop")


def test_sampling_with_speculative(servers: Dict[str, ServerProc]) -> None:
    spec = servers["spec"]
    for stream in (False, True):
        fn = _stream_completion if stream else _completion
        r = fn(spec, PROMPTS[1], temperature=0.8, top_p=0.9, max_tokens=30)
        usage, t = r["usage"], r["timings"]
        assert usage["completion_tokens"] == 30 or (r["finish_reason"] if stream else r["choices"][0]["finish_reason"]) == "stop"
        assert t["draft_rounds"] > 0
    seeded = [_completion(spec, PROMPTS[1], temperature=0.8, seed=11)["choices"][0]["text"] for _ in range(2)]
    assert seeded[0] == seeded[1]
    # Coupled sampling: the text the server without speculation samples with the same seed.
    assert seeded[0] == _completion(servers["plain"], PROMPTS[1], temperature=0.8, seed=11)["choices"][0]["text"]


def test_env_overrides_change_the_drafter(llama_pair: Dict[str, Path], tmp_path: Path) -> None:
    target = str(llama_pair["target"])
    yaml_spec = {"draft_model": str(llama_pair["drafter"]), "block_size": 4}
    env = {"MLX_VLM_DRAFT_MODEL": str(llama_pair["random_drafter"]), "MLX_VLM_DRAFT_BLOCK_SIZE": "3"}
    a = start_server(tmp_path / "a", {"model": target, "speculative": yaml_spec}, env=env)
    b = start_server(tmp_path / "b", {"model": target}, env={"MLX_VLM_DRAFT_KIND": "ngram"})
    try:
        info = a.client().models.list().data[0].to_dict()["speculative"]
        assert info["draft_model"] == str(llama_pair["random_drafter"]) and info["block_size"] == 3
        assert info["sources"]["draft_model"] == "env" and info["sources"]["block_size"] == "env"
        assert f"draft model {llama_pair['random_drafter']}" in a.log and "block size 3" in a.log
        assert "draft_model: env" in a.log and "block_size: env" in a.log
        r = _completion(a, PROMPTS[1])
        t = r["timings"]
        assert t["draft_rounds"] > 0 and t["draft_n"] <= 2 * t["draft_rounds"]  # block 3: at most 2 drafts a round

        info_b = b.client().models.list().data[0].to_dict()["speculative"]
        assert info_b["active"] and info_b["kind"] == "ngram" and info_b["sources"] == {"kind": "env"}
        rb = _completion(b, PROMPTS[3])
        assert rb["timings"]["draft_kind"] == "ngram" and rb["timings"]["draft_rounds"] > 0
        assert _ids(rb["choices"][0]) == _ids(_completion(a, PROMPTS[3])["choices"][0])
    finally:
        a.stop()
        b.stop()


def test_bad_drafter_warns_and_serves_plain_with_api_key_and_queue(llama_pair: Dict[str, Path], tmp_path: Path) -> None:
    s = start_server(tmp_path / "g", {
        "model": str(llama_pair["target"]), "speculative": {"draft_model": str(tmp_path / "no-such-drafter")},
        "server": {"api_key": "sekret", "max_active": 1, "max_queue": 1}})
    try:
        assert "speculative decoding disabled" in s.log and "no-such-drafter" in s.log
        assert "speculative decoding on" not in s.log and "speculative decoding is off" in s.log
        auth = {"Authorization": "Bearer sekret"}
        # /health needs no key; everything else does.
        assert s.get("/health").status_code == 200
        for r in (s.get("/v1/models"), s.get("/metrics"),
                  s.post("/v1/completions", {"prompt": "x"}), s.post("/v1/completions", {"prompt": "x"},
                                                                    headers={"Authorization": "Bearer wrong"})):
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            s.client("wrong").models.list()
        m = s.metrics(headers=auth)
        assert m["mlx_spec_speculative_startup_fallback"] == 1 and m["mlx_spec_speculative_active"] == 0
        r = s.client("sekret").completions.create(model="default_model", prompt=PROMPTS[0], max_tokens=8)
        assert r.usage.completion_tokens > 0 and r.to_dict()["timings"]["draft_n"] == 0

        # One running, one queued: the third concurrent request gets 503, and later ones succeed.
        statuses: List[int] = []

        def long_request() -> None:
            statuses.append(s.post("/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 400},
                                   headers=auth).status_code)

        threads = [threading.Thread(target=long_request) for _ in range(4)]
        threads[0].start()  # admitted: running
        wait_for(lambda: s.metrics(headers=auth)["mlx_spec_requests_running"] == 1, 30,
                 lambda: f"the first request never ran: {s.metrics(headers=auth)}")
        threads[1].start()  # queued behind it (max_active 1)
        wait_for(lambda: s.metrics(headers=auth)["mlx_spec_requests_waiting"] == 1, 30,
                 lambda: f"the second request never queued: {s.metrics(headers=auth)}")
        for t in threads[2:]:  # the queue is full (max_queue 1): 503
            t.start()
        for t in threads:
            t.join(60)
        assert sorted(statuses)[:2] == [200, 200] and 503 in statuses, statuses
        assert s.post("/v1/completions", {"prompt": "x", "max_tokens": 2}, headers=auth).status_code == 200
    finally:
        s.stop()


BAD_INPUTS = [
    # (endpoint, body or raw bytes, status, param)
    ("/v1/chat/completions", b"{not json", 400, None),
    ("/v1/chat/completions", b"[1, 2]", 400, None),
    ("/v1/chat/completions", {"model": "default_model"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "10"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_k": -2}, 400, "top_k"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "x", "stop": 3}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "seed": -1}, 400, "seed"),
    ("/v1/completions", {"prompt": "x", "stream": True, "stream_options": {"include_usage": "yes"}}, 400,
     "stream_options.include_usage"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"99999": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "model": "someone/else"}, 404, "model"),
    ("/v1/completions", {"prompt": "x", "draft_model": "other/drafter"}, 400, "draft_model"),
    ("/v1/completions", {"prompt": "x", "num_draft_tokens": 9}, 400, "num_draft_tokens"),
    ("/v1/completions", {"prompt": "x", "n": 2}, 400, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]}, 400,
     "functions"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "caf\\udce9"}]}', 400,
     "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}},
     400, "response_format"),
    ("/v1/completions", {"prompt": "word " * 5000}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 4096}, 400, "max_tokens"),
]


@pytest.mark.parametrize("path,body,status,param", BAD_INPUTS, ids=[f"{i}-{b[3]}" for i, b in enumerate(BAD_INPUTS)])
def test_bad_input_gets_4xx_and_server_keeps_serving(servers: Dict[str, ServerProc], path: str, body: Any,
                                                     status: int, param: Optional[str]) -> None:
    spec = servers["spec"]
    r = spec.post(path, body, raw=body if isinstance(body, bytes) else None)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]
    if param is not None:
        assert param.split("[")[0] in error["message"]
    good = spec.client().completions.create(model="default_model", prompt=PROMPTS[0], max_tokens=4)
    assert good.usage.completion_tokens > 0


def test_lone_surrogate_gets_400_and_is_counted(servers: Dict[str, ServerProc]) -> None:
    spec = servers["spec"]
    invalid = 'mlx_spec_requests_total{endpoint="text",outcome="invalid"}'
    before = spec.metrics().get(invalid, 0)
    r = spec.post("/v1/completions", None, raw=b'{"prompt": "caf\\udce9"}')
    assert r.status_code == 400 and r.json() == {"error": {
        "message": "prompt: U+DCE9 at character 3 is a lone surrogate, not text; expected valid Unicode (a JSON "
                   "\\ud800-\\udfff escape only as half of a pair)",
        "type": "invalid_request_error", "param": "prompt", "code": "invalid_unicode"}}
    assert spec.metrics()[invalid] == before + 1
    # A body that is not UTF-8 at all (JSON is UTF-8): refused the same way, counted
    r = spec.post("/v1/completions", None, raw=b'{"prompt": "caf\xe9"}')
    assert r.status_code == 400 and r.json() == {"error": {
        "message": "the request body is not valid UTF-8 (byte 0xe9 at offset 15); expected JSON in UTF-8",
        "type": "invalid_request_error", "param": None, "code": "invalid_unicode"}}
    assert spec.metrics()[invalid] == before + 2
    assert _completion(spec, "caf\u00e9")["usage"]["completion_tokens"] > 0  # a real pair, or any valid text: served


def test_clients_extra_fields_are_accepted_and_ignored(servers: Dict[str, ServerProc]) -> None:
    """As mlx-lm's server: fields it does not read (OpenAI clients send some) change nothing; /metrics lists them."""
    spec = servers["spec"]
    extra = {"reasoning_effort": "low", "prediction": {"type": "content", "content": "x"}, "frobnicate": 1}
    before = spec.metrics()
    for fn in (_completion, _chat):
        plain, extended = fn(spec, PROMPTS[1]), fn(spec, PROMPTS[1], extra_body=extra)
        assert _ids(extended["choices"][0]) == _ids(plain["choices"][0])
    after = spec.metrics()
    for name in extra:
        key = f'mlx_spec_ignored_request_fields_total{{field="{name}"}}'
        assert after[key] - before.get(key, 0) == 2, key


def test_cors_headers_as_mlx_lm(servers: Dict[str, ServerProc]) -> None:
    u = urllib.parse.urlsplit(servers["plain"].url)
    conn = httpclient.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request("OPTIONS", "/v1/chat/completions", headers={"Origin": "http://ui.example"})
    r = conn.getresponse()
    assert r.status == 204 and r.getheader("Access-Control-Allow-Origin") == "*"
    conn.close()


def test_openai_client_raises_on_bad_input(servers: Dict[str, ServerProc]) -> None:
    client = servers["spec"].client()
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.chat.completions.create(model="default_model", messages=[{"role": "user", "content": "x"}], top_p=2)
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    assert client.chat.completions.create(model="default_model", messages=[{"role": "user", "content": "x"}],
                                          max_tokens=3).choices[0].finish_reason in ("length", "stop")


def test_startup_config_errors_and_bad_env_kind(llama_pair: Dict[str, Path], tmp_path: Path) -> None:
    # A bad server: key is a configuration error: exit 2 with one line naming key and allowed keys.
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(yaml.safe_dump({"model": str(llama_pair["target"]), "server": {"prot": 8080}}))
    done = subprocess.run([sys.executable, "-m", "mlx_speculative.hooks.cli", "serve", "--config", str(cfg)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "server.prot: unknown key" in done.stderr and "allowed keys" in done.stderr
    # A bad MLX_VLM_DRAFT_KIND in a deployment: a warning and plain decoding, not a dead server.
    s = start_server(tmp_path / "k", {"model": str(llama_pair["target"])}, env={"MLX_VLM_DRAFT_KIND": "warp"})
    try:
        assert "MLX_VLM_DRAFT_KIND: got 'warp'" in s.log and "plain decoding" in s.log
        r = _completion(s, PROMPTS[0])
        assert r["usage"]["completion_tokens"] > 0 and r["timings"]["draft_n"] == 0
        assert s.metrics()["mlx_spec_speculative_startup_fallback"] == 1
    finally:
        s.stop()
