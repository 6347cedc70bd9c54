"""Every setting is checked with the same rule (hooks/validate.py) on the command line, in the YAML
(with file and line) and in requests, flags and YAML before any model loads (issue 14)."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any, Dict, List

import pytest

from mlx_speculative.hooks import openai_compat as oc
from mlx_speculative.hooks.openai_fields import APIError
from mlx_speculative.hooks import validate
from mlx_speculative.hooks.server_settings import ServerSettings, request_defaults, server_settings
from mlx_speculative.hooks.state import HostConfig
from test_first_hour import error_line, run

pytestmark = pytest.mark.unit


CLI_CASES = [
    (["--temp", "-1"], "--temp: got -1; allowed: a number >= 0 (0: greedy)"),
    (["--temp", "hot"], "--temp: got 'hot'; allowed: a number >= 0 (0: greedy)"),
    (["--top-p", "2"], "--top-p: got 2; allowed: a number in (0, 1]"),
    (["--top-p", "0"], "--top-p: got 0; allowed: a number in (0, 1]"),
    (["--top-k", "-1"], "--top-k: got -1; allowed: an integer >= 0 (0: off)"),
    (["--top-k", "1.5"], "--top-k: got '1.5'; allowed: an integer >= 0"),
    (["--min-p", "1.5"], "--min-p: got 1.5; allowed: a number in [0, 1]"),
    (["--max-tokens", "-5"], "--max-tokens: got -5; allowed: an integer >= 1"),
    (["--max-tokens", "0"], "--max-tokens: got 0; allowed: an integer >= 1"),
    (["--seed", "-1"], "--seed: got -1; allowed: an integer from 0 to 2**64 - 1"),
    (["--seed", "nan"], "--seed: got 'nan'"),
    (["--repetition-penalty", "-1"], "--repetition-penalty: got -1; allowed: a number >= 0"),
    (["--repetition-context-size", "0"], "--repetition-context-size: got 0; allowed: an integer >= 1"),
    (["--logit-bias", '{"x": 1}'], "--logit-bias: got '{\"x\": 1}'; allowed: an object mapping token ids to numbers"),
    (["--logit-bias", "[1, 2]"], "--logit-bias: got '[1, 2]'; allowed: an object mapping"),
    (["--draft-block-size", "1"], "--draft-block-size: got 1; allowed: 'auto' or an integer from 2 to 128"),
    (["--num-draft-tokens", "128"], "--num-draft-tokens: got 128; allowed: an integer from 0 to 127 (the block size - 1"),
    (["--max-kv-size", "0"], "--max-kv-size: got 0; allowed: an integer >= 1"),
    (["--prefill-step-size", "0"], "--prefill-step-size: got 0; allowed: an integer >= 1"),
    (["--verbose", "loud"], "--verbose: got 'loud'; allowed: true or false"),
]


@pytest.mark.parametrize("args, expected", CLI_CASES, ids=[" ".join(c[0]) for c in CLI_CASES])
def test_generate_flags_checked_before_loading(args: List[str], expected: str, tmp_path: Path,
                                               capsys: pytest.CaptureFixture) -> None:
    # The model does not exist: a check after loading would report that instead.
    rc, _, err = run(capsys, "generate", "--model", str(tmp_path / "absent"), *args)
    assert rc == 2 and expected in error_line(err)


SERVE_CASES = [
    (["--port", "70000"], "--port: got 70000; allowed: an integer from 0 to 65535 (0: a free port)"),
    (["--port", "http"], "--port: got 'http'; allowed: an integer from 0 to 65535"),
    (["--max-active", "0"], "--max-active: got 0; allowed: an integer >= 1"),
    (["--max-queue", "-1"], "--max-queue: got -1; allowed: an integer >= 0"),
    (["--context-length", "0"], "--context-length: got 0; allowed: an integer >= 1"),
    (["--max-tokens", "0"], "--max-tokens: got 0; allowed: an integer >= 1"),
    (["--temp", "-1"], "--temp: got -1; allowed: a number >= 0"),
    (["--top-p", "0"], "--top-p: got 0; allowed: a number in (0, 1]"),
    (["--top-k", "x"], "--top-k: got 'x'; allowed: an integer >= 0"),
    (["--min-p", "2"], "--min-p: got 2; allowed: a number in [0, 1]"),
    (["--prompt-cache-size", "-1"], "--prompt-cache-size: got -1; allowed: an integer >= 0"),
    (["--log-level", "LOUD"], "--log-level: got 'LOUD'; allowed: DEBUG, INFO, WARNING, ERROR, CRITICAL"),
    (["--allowed-origins", "ui.example"], "--allowed-origins: got 'ui.example'; allowed: '*' or comma-separated"),
    (["--chat-template-args", "{x}"], "--chat-template-args: got '{x}'; allowed: a JSON object"),
]


@pytest.mark.parametrize("args, expected", SERVE_CASES, ids=[" ".join(c[0]) for c in SERVE_CASES])
def test_serve_flags_checked_before_loading(args: List[str], expected: str, tmp_path: Path,
                                            capsys: pytest.CaptureFixture) -> None:
    rc, _, err = run(capsys, "serve", "--model", str(tmp_path / "absent"), *args)
    assert rc == 2 and expected in error_line(err)


YAML_CASES = [
    ("generation", "temp", "hot", "got 'hot'; allowed: a number >= 0 (0: greedy)"),
    ("generation", "temp", -1, "got -1; allowed: a number >= 0 (0: greedy)"),
    ("generation", "top_p", 2, "got 2; allowed: a number in (0, 1]"),
    ("generation", "top_k", -1, "got -1; allowed: an integer >= 0"),
    ("generation", "min_p", 2, "got 2; allowed: a number in [0, 1]"),
    ("generation", "max_tokens", -5, "got -5; allowed: an integer >= 1"),
    ("generation", "seed", -1, "got -1; allowed: an integer from 0 to 2**64 - 1"),
    ("generation", "repetition_penalty", -1, "got -1; allowed: a number >= 0"),
    ("generation", "repetition_context_size", 0, "got 0; allowed: an integer >= 1"),
    ("generation", "logit_bias", "{x: 1}", "allowed: an object mapping token ids to numbers"),
    ("server", "port", 70000, "got 70000; allowed: an integer from 0 to 65535"),
    ("server", "max_active", 0, "got 0; allowed: an integer >= 1"),
    ("server", "max_queue", -1, "got -1; allowed: an integer >= 0"),
    ("server", "context_length", 0, "got 0; allowed: an integer >= 1"),
    ("speculative", "block_size", 1, "got 1; allowed: 'auto' or an integer from 2 to 128"),
    ("speculative", "ngram_n", 0, "got 0; allowed: an integer from 1 to 32"),
]


@pytest.mark.parametrize("section, key, value, expected", YAML_CASES, ids=[f"{c[0]}.{c[1]}={c[2]}" for c in YAML_CASES])
def test_yaml_values_checked_with_file_and_line(section: str, key: str, value: Any, expected: str, tmp_path: Path,
                                                capsys: pytest.CaptureFixture) -> None:
    cfg = tmp_path / "host.yaml"
    cfg.write_text(f"model: {tmp_path / 'absent'}\n{section}:\n  # the value is on line 4\n  {key}: {value}\n")
    rc, _, err = run(capsys, "serve" if section == "server" else "generate", "--config", str(cfg))
    line = error_line(err)
    assert rc == 2 and line.startswith(f"mlx-spec: error: {cfg}:4: {section}.{key}: got ") and expected in line


def test_yaml_unknown_generation_key_and_broken_yaml(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cfg = tmp_path / "host.yaml"
    cfg.write_text("generation:\n  tmep: 0.5\n")
    rc, _, err = run(capsys, "generate", "--config", str(cfg))
    assert rc == 2 and "generation.tmep: unknown key (value 0.5); allowed keys: max_tokens, temp" in error_line(err)
    cfg.write_text("model: demo\ngeneration:\n  temp: 0.5\n   top_p: 1\n")  # line 4 is indented wrong
    rc, _, err = run(capsys, "generate", "--config", str(cfg))
    assert rc == 2 and f"{cfg}:4:" in error_line(err) and "not valid YAML" in error_line(err)


def test_yaml_unknown_and_duplicate_keys_carry_file_and_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cfg = tmp_path / "host.yaml"
    for text, expected in (
        ("model: demo\nmodel: other\n", "2: model: duplicate key (first at line 1); allowed: each key once"),
        ("server:\n  port: 1\n  port: 2\n", "3: server.port: duplicate key (first at line 2)"),
        ("model: demo\nserver:\n  prot: 1\n", "3: server.prot: unknown key (value 1); allowed keys: host, port"),
        ("model: demo\n\nmodle: x\n", "3: modle: unknown top-level key (value 'x'); allowed: model, server"),
    ):
        cfg.write_text(text)
        rc, _, err = run(capsys, "generate", "--config", str(cfg))
        assert rc == 2 and error_line(err).startswith(f"mlx-spec: error: {cfg}:{expected}"), (text, err)


def test_yaml_that_is_not_utf8_is_refused_with_its_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cfg = tmp_path / "host.yaml"
    cfg.write_bytes(b"model: demo\n# caf\xe9 (latin-1)\n")
    for command in ("generate", "serve"):
        rc, _, err = run(capsys, command, "--config", str(cfg))
        assert rc == 2 and error_line(err) == (f"mlx-spec: error: {cfg}:2:6: not valid UTF-8 (byte 0xe9); expected a "
                                               "UTF-8 text file (re-save it as UTF-8)"), err


def test_chat_template_is_jinja_text_or_a_utf8_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A value without Jinja is a file name: one that does not read is refused, never served as the template."""
    latin1 = tmp_path / "latin1.jinja"
    latin1.write_bytes(b"{% for m in messages %}caf\xe9 {{ m.content }}{% endfor %}")
    absent = tmp_path / "absent.jinja"
    for value, expected in ((str(absent), f"(no Jinja '{{' in it, and {absent} cannot be read: No such file"),
                            (str(latin1), f"a file holding it in UTF-8 ({latin1} has byte 0xe9 at offset 26)")):
        rc, _, err = run(capsys, "serve", "--model", str(tmp_path / "absent"), "--chat-template", value)
        assert rc == 2 and error_line(err).startswith(f"mlx-spec: error: --chat-template: got {value!r}; allowed: a "
                                                      "chat template: Jinja text, or a file holding it")
        assert expected in error_line(err), err
    good = tmp_path / "good.jinja"
    good.write_text("{{ messages[0]['content'] }}")
    assert server_settings(HostConfig(overrides={"server": {"chat_template": str(good)}})).chat_template == \
        good.read_text()


def test_utf8_text_and_lone_surrogates() -> None:
    assert validate.utf8_text("café", "--prompt") == ("café", None)
    assert validate.utf8_text("caf\udce9", "--prompt") == (
        "caf\ufffd", "--prompt: not valid UTF-8 (byte 0xe9 at offset 3); such bytes were replaced by U+FFFD")
    assert validate.utf8_text(b"ok \xff", "stdin")[0] == "ok \ufffd"
    assert validate.lone_surrogate({"messages": [{"content": "x"}, {"content": "a\ud800"}]}) == (
        "messages[1].content", 1, "\ud800")
    assert validate.lone_surrogate({"prompt": "caf\u00e9 \U0001f600"}) is None


REQUEST_CASES = [
    ({"temperature": -1}, "temperature", "temp"),
    ({"top_p": 2}, "top_p", "top_p"),
    ({"top_k": -1}, "top_k", "top_k"),
    ({"min_p": 1.5}, "min_p", "min_p"),
    ({"max_tokens": 0}, "max_tokens", "max_tokens"),
    ({"seed": -1}, "seed", "seed"),
    ({"repetition_penalty": -0.5}, "repetition_penalty", "repetition_penalty"),
    ({"repetition_context_size": 0}, "repetition_context_size", "repetition_context_size"),
]


@pytest.mark.parametrize("body, param, rule", REQUEST_CASES, ids=[c[1] for c in REQUEST_CASES])
def test_requests_use_the_same_rules(body: Dict[str, Any], param: str, rule: str) -> None:
    limits = oc.ServingLimits(model_id="m", vocab_size=384)
    with pytest.raises(APIError) as e:
        oc.parse_request("text", dict(body, prompt="x"), tokenizer=None, limits=limits)
    assert (e.value.status, e.value.param) == (400, param)
    assert e.value.message.startswith(f"{param}: got ") and e.value.message.endswith(
        f"; allowed: {validate.RULES[rule].allowed}")


def test_request_logit_bias_and_yaml_defaults_reach_requests() -> None:
    limits = oc.ServingLimits(model_id="m", vocab_size=384)
    for bad, allowed in (({"x": 1}, validate.LOGIT_BIAS_ALLOWED), ({"400": 1}, "token ids from 0 to 383")):
        with pytest.raises(APIError, match="logit_bias: got") as e:
            oc.parse_request("text", {"prompt": "x", "logit_bias": bad}, tokenizer=None, limits=limits)
        assert allowed in e.value.message
    config = HostConfig(sections={"generation": {"temp": 0.5, "seed": 3, "repetition_penalty": 1.2,
                                                  "repetition_context_size": 8, "logit_bias": {"5": 1}}})
    limits = oc.ServingLimits(model_id="m", vocab_size=384, **request_defaults(config, ServerSettings()))

    class Tok:
        def encode(self, text: str) -> List[int]:
            return [1, 2]

    req = oc.parse_request("text", {"prompt": "x"}, tokenizer=Tok(), limits=limits)
    assert (req.sampling.temperature, req.sampling.seed) == (0.5, 3)
    assert (req.logits_args["repetition_penalty"], req.logits_args["repetition_context_size"]) == (1.2, 8)
    assert req.logits_args["logit_bias"] == {5: 1.0}


def test_server_settings_name_the_layer() -> None:
    with pytest.raises(validate.SettingError, match=r"^--port: got 'x'; allowed: an integer from 0 to 65535"):
        server_settings(HostConfig(overrides={"server": {"port": "x"}}), environ={})
    with pytest.raises(validate.SettingError, match=r"^server\.max_queue: got -1"):
        server_settings(HostConfig(sections={"server": {"max_queue": -1}}), environ={})
    s = server_settings(HostConfig(sections={"server": {"port": "8081"}}, overrides={"server": {"max_queue": "3"}}),
                        environ={})
    assert (s.port, s.max_queue, s.sources) == (8081, 3, {"port": "yaml", "max_queue": "cli"})


def test_busy_port_refused_before_loading(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        rc, _, err = run(capsys, "serve", "--model", str(tmp_path / "absent"), "--port", str(port))
    assert rc == 2
    assert error_line(err) == (f"mlx-spec: error: server.port: 127.0.0.1:{port} is already in use; allowed: a free "
                               "port (--port), or 0 to pick one")


