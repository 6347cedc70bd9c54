"""The prompt cache in `mlx-spec serve` (real server processes, the `openai` client).

Three-turn chats, two conversations interleaved, for each kind (draft_model, ngram, dflash, eagle3)
on an attention-only target: turns 2 and 3 report ``usage.prompt_tokens_details.cached_tokens`` (and
llama.cpp's ``timings.cache_n``) equal to the prefix they share with what earlier requests left,
and every answer equals the same request's on a server with the cache off, token for token. Then
a third chat runs across an eviction (long requests push everything out of a 3 MiB cache). On a
recurrent target (qwen3_5, with DFlash and with its own MTP head) the reuse is the largest snapshot
position <= the shared prefix. /metrics counts hits, misses, reused tokens, bytes and evictions.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest

from mlx_speculative.drafters.dflash import tiny
from mlx_speculative.drafters.eagle3 import tiny as eagle3_tiny
from mlx_speculative.drafters.mtp import tiny as mtp_tiny
from mlx_speculative.testing import tiny_models as tm
from test_server import ServerProc, start_server

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.server
FIXTURES = Path(__file__).parent / "fixtures"
BOUND = 3 << 20
USER = [["the model token draft", "accept commit cache layer", "river stone light night"],
        ["one two three four five", "red green blue one", "page book word line page"],
        ["query key value tree", "speed decode prefill sample", "time space word line"]]
SERVERS = {  # name: (target, speculative section, prompt_cache_bytes)
    "draft_model": ("llama", {"draft_model": "drafter", "block_size": 4}, BOUND),
    "ngram": ("llama", {"kind": "ngram", "block_size": 4}, BOUND),
    "dflash": ("llama", {"draft_model": "dflash", "block_size": 4}, BOUND),
    "eagle3": ("llama", {"draft_model": "eagle3", "block_size": 4}, BOUND),
    "off": ("llama", None, 0),
    "qwen3_5": ("qwen3_5", {"draft_model": "dflash", "block_size": 4}, BOUND),
    "qwen3_5_mtp": ("qwen3_5", {"draft_model": "qwen3_5", "block_size": 4}, BOUND),  # its own mtp.* head
    "qwen3_5_off": ("qwen3_5", None, 0),
}


@pytest.fixture(scope="module")
def files(llama_pair: Dict[str, Path], tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Dict[str, Path]:
    root = tmp_path_factory.mktemp("server_prompt_cache")
    real = json.loads((FIXTURES / "dflash" / "z-lab__Qwen3-4B-DFlash-b16.config.json").read_text())
    config = tiny.shrink_config(real, target_layer_ids=[0, 2], mask_token_id=383, num_target_layers=4)
    # A Qwen3.5 in the Hugging Face layout with its MTP head in its own shards (mlx-lm loads it without).
    qwen = mtp_tiny.write_qwen_target(root / "qwen3_5", mtp_tiny.qwen3_5_config(), seed=61, tokenizer_dir=tokenizer_dir)
    eagle3 = json.loads((FIXTURES / "eagle3" / "SafeAILab__EAGLE__traineagle3.config.json").read_text())
    return {"llama": llama_pair["target"], "drafter": llama_pair["drafter"], "qwen3_5": qwen,
            "dflash": tiny.write_checkpoint(root / "dflash", config, seed=62),
            "eagle3": eagle3_tiny.write_checkpoint(root / "eagle3", eagle3_tiny.shrink_config(eagle3), seed=63)}


@pytest.fixture(scope="module")
def servers(files: Dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dict[str, ServerProc]]:
    root = tmp_path_factory.mktemp("servers")
    started: Dict[str, ServerProc] = {}
    try:
        for name, (target, spec, bound) in SERVERS.items():
            config: Dict[str, Any] = {"model": str(files[target]),
                                      "server": {"max_tokens": 64, "prompt_cache_bytes": bound}}
            if spec is not None:
                config["speculative"] = {k: str(files[v]) if k == "draft_model" else v for k, v in spec.items()}
            started[name] = start_server(root / name, config)
        yield started
    finally:
        for s in started.values():
            s.stop()


@pytest.fixture(scope="module")
def tokenizer(files: Dict[str, Path]) -> Any:
    from mlx_lm import load

    return load(str(files["llama"]))[1]


def chat(server: ServerProc, messages: List[Dict[str, str]], max_tokens: int, stream: bool = False) -> Dict[str, Any]:
    """One chat request: its text, token ids, finish reason, usage and timings."""
    client = server.client()
    kw = dict(model="default_model", messages=messages, max_tokens=max_tokens, temperature=0)
    if stream:
        out: Dict[str, Any] = {"text": "", "ids": []}
        for chunk in client.chat.completions.create(stream=True, logprobs=True, stream_options={"include_usage": True},
                                                    **kw):
            d = chunk.to_dict()
            if d["choices"]:
                c = d["choices"][0]
                out["text"] += c["delta"].get("content") or ""
                out["ids"] += [e["id"] for e in (c.get("logprobs") or {}).get("content") or []]
                out["finish"] = c["finish_reason"] or out.get("finish")
            if d.get("usage"):
                out["usage"], out["timings"] = d["usage"], d["timings"]
        return out
    d = client.chat.completions.create(logprobs=True, **kw).to_dict()
    c = d["choices"][0]
    return {"text": c["message"]["content"], "ids": [e["id"] for e in c["logprobs"]["content"]],
            "finish": c["finish_reason"], "usage": d["usage"], "timings": d["timings"]}


def lcp(a: List[int], b: List[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class Expect:
    """What the server's cache holds, from the client's side: the token sequences it kept."""

    def __init__(self, recurrent: bool, eos: int):
        self.recurrent, self.eos = recurrent, eos
        self.kept: List[List[int]] = []

    def cached(self, prompt: List[int]) -> int:
        top = len(prompt) - 1  # at least one prompt token is fed
        if self.recurrent:  # snapshots: only exactly their own length
            return max([len(k) for k in self.kept if len(k) <= top and prompt[: len(k)] == k], default=0)
        return max([min(lcp(prompt, k), top) for k in self.kept], default=0)

    def keep(self, prompt: List[int], reply: Dict[str, Any], cached: int) -> None:
        own = prompt + reply["ids"] + ([self.eos] if reply["finish"] == "stop" else [])
        if self.recurrent:
            assert reply["finish"] == "length"  # the generation's end is then exactly own[:-1]
            if len(prompt) - 1 > cached:
                self.kept.append(prompt[:-1])
        self.kept.append(own[:-1])


def converse(server: ServerProc, ref: ServerProc, tokenizer: Any, expect: Expect, chats: List[List[Dict[str, str]]],
             texts: List[str], n: int, stream: bool = False) -> List[int]:
    """One more turn of each chat, concurrently: answers equal the cache-off server's; returns the cached counts."""
    prompts, replies = [], [None] * len(chats)
    for messages, text in zip(chats, texts):
        messages.append({"role": "user", "content": text})
        prompts.append(list(tokenizer.apply_chat_template(messages, add_generation_prompt=True)))

    def ask(i: int) -> None:
        replies[i] = chat(server, chats[i], n, stream)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(chats))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    cached = []
    for messages, prompt, reply in zip(chats, prompts, replies):
        assert reply is not None
        plain = chat(ref, messages, n)
        assert reply["ids"] == plain["ids"] and reply["text"] == plain["text"]
        assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 == plain["timings"]["cache_n"]
        usage, timings = reply["usage"], reply["timings"]
        got = usage["prompt_tokens_details"]["cached_tokens"]
        assert usage["prompt_tokens"] == len(prompt) and got == timings["cache_n"]
        assert timings["prompt_n"] == len(prompt) - got
        assert got == expect.cached(prompt), (prompt, expect.kept)
        cached.append(got)
        messages.append({"role": "assistant", "content": reply["text"]})
    for prompt, reply, got in zip(prompts, replies, cached):
        expect.keep(prompt, reply, got)
    return cached


def cache_metrics(server: ServerProc) -> Dict[str, float]:
    return {k[len("mlx_spec_prompt_cache_"):]: v for k, v in server.metrics().items() if k.startswith("mlx_spec_prompt_cache_")}


@pytest.mark.parametrize("kind", ["draft_model", "ngram", "dflash", "eagle3"])
def test_three_turn_chats_reuse_the_shared_prefix(kind: str, servers: Dict[str, ServerProc], tokenizer: Any) -> None:
    server, ref = servers[kind], servers["off"]
    before = cache_metrics(server)
    expect = Expect(recurrent=False, eos=tokenizer.eos_token_id)
    a: List[Dict[str, str]] = []
    b: List[Dict[str, str]] = []
    counts = []
    for turn in range(3):  # A and B interleaved: A1 B1, A2 B2 (streamed), A3 B3 together
        if turn < 2:
            counts += converse(server, ref, tokenizer, expect, [a], [USER[0][turn]], 12, stream=turn == 1)
            counts += converse(server, ref, tokenizer, expect, [b], [USER[1][turn]], 10, stream=turn == 1)
        else:
            counts += converse(server, ref, tokenizer, expect, [a, b], [USER[0][turn], USER[1][turn]], 12)
    # B1 shares the chat template's first tokens with A1; later turns their whole conversation so far.
    assert counts[0] == 0 and all(x > len(tokenizer.apply_chat_template(a[:1], add_generation_prompt=True))
                                  for x in counts[2:])
    middle = cache_metrics(server)
    assert middle["evictions_total"] == before["evictions_total"]  # all of it fits

    # A third chat across an eviction: three long requests (over 1 MiB each) push everything out.
    c: List[Dict[str, str]] = []
    counts += converse(server, ref, tokenizer, expect, [c], [USER[2][0]], 10)
    words = " ".join(tm.corpus(400, seed=7)).split()
    for i in range(3):  # 1100+ tokens: 1.25 MiB of target caches each (KV buffers grow by 256 positions)
        long_prompt = " ".join(words[i * 520 : (i + 1) * 520])
        r = server.client().completions.create(model="default_model", prompt=long_prompt, max_tokens=2, temperature=0)
        assert 1100 < r.usage.prompt_tokens < 1536
    expect.kept = []  # evicted (the long prompts share nothing with the chat)
    after_flood = cache_metrics(server)
    assert after_flood["evictions_total"] > middle["evictions_total"] + 3
    counts += converse(server, ref, tokenizer, expect, [c], [USER[2][1]], 10)
    counts += converse(server, ref, tokenizer, expect, [c], [USER[2][2]], 10)
    assert counts[-2] == 0 and counts[-1] > 0  # evicted, then kept again

    m = cache_metrics(server)
    requests = len(counts) + 3
    assert m["hits_total"] - before["hits_total"] == sum(1 for x in counts if x)
    assert m["hits_total"] + m["misses_total"] - before["hits_total"] - before["misses_total"] == requests
    assert m["reused_tokens_total"] - before["reused_tokens_total"] == sum(counts)
    assert 0 < m["bytes"] <= m["limit_bytes"] == BOUND and m["entries"] >= 1
    assert cache_metrics(ref)["limit_bytes"] == 0 and cache_metrics(ref)["hits_total"] == 0
    assert f"speculative decoding on: kind {kind} (family {kind})" in server.log
    if kind != "ngram":  # rounds ran with the restored drafter state, never falling back
        assert "fell back" not in server.log


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_mtp"])
def test_recurrent_target_reuses_the_largest_snapshot(kind: str, servers: Dict[str, ServerProc],
                                                      tokenizer: Any) -> None:
    """qwen3_5's GatedDeltaNet states cannot be trimmed: each request leaves snapshots at its prompt's
    end (len(prompt) - 1) and its generation's end (prompt + answer but the pending token), and a
    later request reuses the largest of them <= the prefix it shares (``Expect``). The drafter's state
    covers every snapshot position, so that is what turns 2 and 3 report: DFlash's context and the
    MTP head's entries with the hidden states of every position."""
    server, ref = servers[kind], servers["qwen3_5_off"]
    expect = Expect(recurrent=True, eos=tokenizer.eos_token_id)
    a: List[Dict[str, str]] = []
    b: List[Dict[str, str]] = []
    counts = []
    for turn in range(3):
        counts += converse(server, ref, tokenizer, expect, [a], [USER[0][turn]], 8)
        counts += converse(server, ref, tokenizer, expect, [b], [USER[1][turn]], 8)
    # Turn 2 onwards start from the generation's end of the turn before (a snapshot), never beyond.
    assert counts[0] == 0 and all(x > 0 for x in counts[2:])
    regenerate = a[:-1]  # the last turn asked again: its prompt's end is a snapshot
    prompt = list(tokenizer.apply_chat_template(regenerate, add_generation_prompt=True))
    again = chat(server, regenerate, 8)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt) - 1 == expect.cached(prompt)
    drafter = "kind mtp (family qwen3_5_mtp)" if kind == "qwen3_5_mtp" else "kind dflash (family dflash)"
    assert f"speculative decoding on: {drafter}" in server.log and "fell back" not in server.log


def test_prompt_cache_bytes_is_checked_before_loading(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from test_first_hour import error_line, run

    allowed = "allowed: a number of bytes >= 0 (0: off), a size such as '8GB'"
    rc, _, err = run(capsys, "serve", "--model", str(tmp_path / "absent"), "--prompt-cache-bytes", "lots")
    assert rc == 2 and f"--prompt-cache-bytes: got 'lots'; {allowed}" in error_line(err)
    cfg = tmp_path / "host.yaml"
    cfg.write_text(f"model: {tmp_path / 'absent'}\nserver:\n  prompt_cache_bytes: -1\n")
    rc, _, err = run(capsys, "serve", "--config", str(cfg))
    assert rc == 2 and f"server.prompt_cache_bytes: got -1; {allowed}" in error_line(err)
