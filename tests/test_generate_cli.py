"""`mlx-spec generate` as mlx-lm users run it: the stats (prompt and generation apart, peak memory, the
plain-step share and why), the context rule, non-UTF-8 input, Ctrl-C, and mlx-lm's flags."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict

import pytest

from conftest import greedy_reference
from test_first_hour import error_line, run

pytestmark = pytest.mark.integration

PROMPT = "red green blue one two three red green blue one two"


def generate(capsys: pytest.CaptureFixture, *args: str, chat: bool = False) -> Dict[str, Any]:
    rc, out, err = run(capsys, "generate", "--json", *([] if chat else ["--ignore-chat-template"]), *args)
    assert rc == 0, err
    result = json.loads(out)
    result["stderr"] = err
    return result


def test_stats_on_a_run_with_an_adaptive_pause(llama_pair: Dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    """A random drafter: rounds accept nothing, the controller pauses; the line and the JSON say so, and the
    tokens add up (rounds' + plain steps')."""
    args = ["--model", str(llama_pair["target"]), "--draft-model", str(llama_pair["random_drafter"]), "--prompt",
            PROMPT, "--max-tokens", "40"]
    out = generate(capsys, *args)
    spec = out["speculative"]
    assert out["prompt_tokens"] > 0 and out["prompt_tps"] > 0 and out["generation_tps"] > 0 and out["peak_memory"] > 0
    plain = spec["plain_tokens"]
    assert plain["paused"] > 0 and plain["fallback"] == 0, spec
    assert spec["pause_reason"].startswith("acceptance below break-even")
    ended_on_eos = int(out["finish_reason"] == "stop")  # the stop token is generated, not output
    assert spec["round_tokens"] + sum(plain.values()) == out["generation_tokens"] + ended_on_eos
    assert spec["round_tokens"] == spec["rounds"] + spec["accepted_tokens"]
    rc, _, err = run(capsys, "generate", "--ignore-chat-template", *args)
    line = err.strip().splitlines()[-1]
    assert rc == 0 and line.startswith(f"[mlx-spec] prompt {out['prompt_tokens']} tokens, ")
    assert " tok/s; generation " in line and (f" GB; speculative draft_model: {spec['rounds']} rounds, tau "
                                              f"{spec['mean_acceptance_length']:.2f}, acceptance ") in line
    assert (f"; {sum(plain.values())} of {out['generation_tokens'] + ended_on_eos} tokens from plain steps: adaptive "
            f"decoding paused speculation for {plain['paused']} (acceptance below break-even") in line


def test_context_rule_and_non_utf8_input(llama_pair: Dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    target = str(llama_pair["target"])
    rc, _, err = run(capsys, "generate", "--model", target, "--ignore-chat-template", "--prompt", "word " * 5000)
    assert rc == 2 and re.search(r"--prompt: the prompt has \d+ tokens; this model's context length is 4096 tokens "
                                 r"\(prompt plus completion\)$", error_line(err))
    expected = generate(capsys, "--model", target, "--prompt", "caf\ufffd = 1", "--max-tokens", "4", "--no-speculative")
    assert expected["stderr"].count("warning") == 0
    # As a shell hands them over: argument bytes and stdin bytes that are not UTF-8 (0xe9: latin-1's é)
    command = [sys.executable, "-m", "mlx_speculative.hooks.cli", "generate", "--model", target, "--max-tokens", "4",
               "--no-speculative", "--json", "--ignore-chat-template", "--prompt"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_VLM_")}
    for prompt, stdin, field in ((b"caf\xe9 = 1", b"", "--prompt"), (b"-", b"caf\xe9 = 1", "--prompt - (stdin)")):
        done = subprocess.run([*command, prompt], input=stdin, capture_output=True, env=env, timeout=300)
        err = done.stderr.decode()
        assert done.returncode == 0 and "Traceback" not in err, err
        warnings = [line for line in err.splitlines() if "warning" in line]
        assert warnings == [f"[mlx-spec] warning: {field}: not valid UTF-8 (byte 0xe9 at offset 3); such bytes were "
                            "replaced by U+FFFD"]
        out = json.loads(done.stdout)
        assert (out["tokens"], out["prompt_tokens"]) == (expected["tokens"], expected["prompt_tokens"])


def test_ctrl_c_prints_the_partial_object_and_max_tokens_is_cut_to_the_context() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "mlx_speculative.hooks.cli", "generate", "--max-tokens", "100000",
                             "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        said = ""
        while "generating at most" not in said:  # said right before generating
            line = proc.stderr.readline()
            assert line, said
            said += line
        # Kept: Ctrl-C must land mid-generation, and `generate --json` shows no progress to wait on; this gives
        # the decode loop time to produce tokens (0 < generation_tokens below checks that it did).
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "Traceback" not in err, err
    cut = [line for line in (said + err).splitlines() if "exceed the context length" in line]
    assert len(cut) == 1 and cut[0].endswith("--max-tokens: 41 prompt tokens + 100000 completion tokens exceed the "
                                             "context length of 4096 tokens; generating at most 4055")
    result = json.loads(out)
    assert result["finish_reason"] == "interrupted" and 0 < result["generation_tokens"] < 4055
    assert len(result["tokens"]) == result["generation_tokens"] and result["text"]
    assert result["speculative"]["kind"] == "dflash"


def test_mlx_lm_generate_flags(llama_pair: Dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    from mlx_lm import load

    target = str(llama_pair["target"])
    base = ["--model", target, "--draft-model", str(llama_pair["drafter"]), "--prompt", PROMPT, "--max-tokens", "16"]
    reference = generate(capsys, *base)
    model, tokenizer = load(target)
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    assert reference["tokens"] == greedy_reference(model, ids, 16)[: len(reference["tokens"])]
    # --num-draft-tokens N is mlx-lm's count: a block of N + 1; 0 turns speculation off
    spec = generate(capsys, *base, "--num-draft-tokens", "2")["speculative"]
    assert set(spec["block_sizes"]) == {3}
    off = generate(capsys, *base, "--num-draft-tokens", "0")
    assert off["speculative"] is None and off["speculative_off"] == "--num-draft-tokens 0"
    rc, _, err = run(capsys, "generate", *base, "--ignore-chat-template", "--num-draft-tokens", "0")
    assert rc == 0 and err.strip().splitlines()[-1].endswith("; speculative off (--num-draft-tokens 0): every token "
                                                              "from a plain step")
    rc, _, err = run(capsys, "generate", *base, "--num-draft-tokens", "3", "--draft-block-size", "5")
    assert rc == 2 and "--num-draft-tokens: got 3; allowed: 4 (--draft-block-size 5" in error_line(err)
    # --prefill-step-size: the prompt fed in chunks of 2, the same tokens
    assert generate(capsys, *base, "--prefill-step-size", "2")["tokens"] == reference["tokens"]
    # --extra-eos-token: the 4th token (by id, and by its text) ends generation there
    stop = reference["tokens"][3]
    for given in (str(stop), tokenizer.convert_ids_to_tokens(stop)):
        ended = generate(capsys, *base, "--extra-eos-token", given)
        assert ended["finish_reason"] == "stop" and ended["tokens"] == reference["tokens"][: reference["tokens"].index(stop)]
    rc, _, err = run(capsys, "generate", *base, "--extra-eos-token", "no-such-token")
    assert rc == 2 and "--extra-eos-token: got 'no-such-token'; allowed: a token of this tokenizer" in error_line(err)
    # --verbose false: the text alone, no stats line (mlx-lm's meaning)
    rc, out, err = run(capsys, "generate", *base, "--ignore-chat-template", "--verbose", "false")
    assert rc == 0 and out.strip() and "[mlx-spec] prompt" not in err


def test_system_prompt_and_max_kv_size(llama_pair: Dict[str, Path], qwen3_pair: Dict[str, Path],
                                       capsys: pytest.CaptureFixture) -> None:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    target = str(llama_pair["target"])
    _, tokenizer = load(target)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the model"}]
    chat = generate(capsys, "--model", target, "--prompt", "the model", "--system-prompt", "be brief",
                    "--max-tokens", "2", "--no-speculative", chat=True)
    assert chat["prompt_tokens"] == len(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    rc, _, err = run(capsys, "generate", "--model", target, "--system-prompt", "be brief", "--ignore-chat-template")
    assert rc == 2 and "--system-prompt: got 'be brief'; allowed: only with the chat template" in error_line(err)
    # --max-kv-size: mlx-lm's rotating cache (a model without its own make_cache); rounds cannot verify exactly
    # past its window, so the request goes on plainly (said), with mlx-lm's tokens
    q = str(qwen3_pair["target"])
    model, qtok = load(q)
    ids = qtok.encode(PROMPT, add_special_tokens=False)
    ref = [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=24, max_kv_size=16)]
    args = ["--model", q, "--prompt", PROMPT, "--max-tokens", "24", "--max-kv-size", "16"]
    out = generate(capsys, *args, "--draft-model", str(qwen3_pair["drafter"]))
    assert out["tokens"] == ref[: len(out["tokens"])] == generate(capsys, *args, "--no-speculative")["tokens"]
    spec = out["speculative"]
    assert "RotatingKVCache(max_size=16, keep=4)" in spec["fallback"] and spec["plain_tokens"]["fallback"] > 0
    rc, _, err = run(capsys, "generate", *args, "--draft-model", str(qwen3_pair["drafter"]), "--ignore-chat-template")
    assert rc == 0 and f"{spec['plain_tokens']['fallback']} after the drafter failed (drafter failed while" in err
