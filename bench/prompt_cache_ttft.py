"""Time to first token of a chat's second turn: `mlx-spec serve` with the prompt cache on and off,
and mlx-lm's own server (``mlx_lm.server``, its LRU prompt cache on), on the same target.

Not a test. The target is a synthetic mlx-lm llama (benchmarks/synthetic.py: random weights,
large logit margins) saved to disk with a word-level tokenizer of its vocabulary ("w<i>" words,
role markers, a multi-turn chat template), so that every server loads the same files and a turn's
answer re-tokenizes to the same ids. Each conversation: turn 1 is a fresh ``--context``-token user
message (answered with ``--answer`` tokens), turn 2 appends that answer and a short new message.
Every server is a real process on a free loopback port; the client streams (urllib, no openai
client needed) and takes the time to the first content chunk. Reported per server: median TTFT
of turn 1 and turn 2, the cached tokens it reported for turn 2, and whether its answers equal the
cache-off server's (greedy).

    # the H200 run (issue 18): a 1B-shape target, an 8k-token conversation
    python bench/prompt_cache_ttft.py --synthetic-target llama-1b --context 8192 --answer 64 --repeats 5 \
        --json bench/results/h200-prompt-cache-ttft.json
    # a CPU check that it works (tiny target)
    python bench/prompt_cache_ttft.py --synthetic-target tiny --context 1024 --answer 16 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

ROLES = ("<system>", "<user>", "<assistant>")
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} </s> {% endfor %}"
            "{% if add_generation_prompt %}<assistant> {% endif %}")


def save_target(spec: str, root: Path) -> Path:
    """The synthetic target as an mlx-lm checkpoint (config.json, model.safetensors, tokenizer)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from mlx_speculative.benchmarks import synthetic

    out = root / f"synthetic-{spec}"
    if (out / "model.safetensors").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    config = synthetic.config_for(spec)
    model = synthetic.build(config)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=1))
    vocab = config["vocab_size"]
    names = {0: "<s>", 1: "</s>", 2: "[UNK]", 3: ROLES[0], 4: ROLES[1], 5: ROLES[2]}
    tok = Tokenizer(models.WordLevel(vocab={names.get(i, f"w{i}"): i for i in range(vocab)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "[UNK]",
        "add_bos_token": False, "chat_template": TEMPLATE}))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A server process: ``mlx-spec serve`` (``cache_bytes``: its server.prompt_cache_bytes) or mlx_lm.server."""

    def __init__(self, kind: str, model: Path, root: Path, cache_bytes: Optional[int] = None, draft_kind: str = "none"):
        self.log_path = root / f"{kind}.log"
        port = free_port()
        if kind == "mlx-lm":
            cmd = [sys.executable, "-m", "mlx_lm.server", "--model", str(model), "--port", str(port)]
        else:
            cfg = root / f"{kind}.yaml"
            spec = {"enabled": False} if draft_kind == "none" else {"kind": draft_kind}
            cfg.write_text(json.dumps({"model": str(model), "speculative": spec,
                                       "server": {"prompt_cache_bytes": cache_bytes if cache_bytes is not None else "auto"}}))
            cmd = [sys.executable, "-m", "mlx_speculative.hooks.cli", "serve", "--config", str(cfg),
                   "--port", str(port)]
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{kind} exited with {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}")
            try:
                urllib.request.urlopen(self.url + "/v1/models", timeout=5).read()
                return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{kind} did not start:\n{self.log_path.read_text()[-3000:]}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def stream_chat(url: str, messages: List[Dict[str, str]], max_tokens: int) -> Dict[str, Any]:
    """One streamed chat request: time to the first content chunk, the text, the usage."""
    body = json.dumps({"model": "default_model", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    request = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    first: Optional[float] = None
    text, usage = "", {}
    with urllib.request.urlopen(request, timeout=1800) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content") or ""
                if piece and first is None:
                    first = time.perf_counter() - start
                text += piece
            usage = chunk.get("usage") or usage
    return {"ttft": first if first is not None else time.perf_counter() - start, "text": text, "usage": usage}


def conversation(rng: random.Random, vocab: int, context: int) -> Tuple[str, str]:
    """Turn 1's long user message and turn 2's short one (words w6..w<vocab-1>)."""
    words = lambda n: " ".join(f"w{rng.randrange(6, vocab)}" for _ in range(n))  # noqa: E731
    return words(context), words(32)


def run_server(proc: Proc, chats: List[Tuple[str, str]], answer: int) -> List[Dict[str, Any]]:
    stream_chat(proc.url, [{"role": "user", "content": "w7 w8 w9"}], 4)  # warm-up
    out = []
    for first, second in chats:
        messages = [{"role": "user", "content": first}]
        t1 = stream_chat(proc.url, messages, answer)
        messages += [{"role": "assistant", "content": t1["text"].strip()}, {"role": "user", "content": second}]
        t2 = stream_chat(proc.url, messages, answer)
        cached = ((t2["usage"] or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
        out.append({"ttft_turn1_s": t1["ttft"], "ttft_turn2_s": t2["ttft"], "prompt_tokens_turn2":
                    (t2["usage"] or {}).get("prompt_tokens"), "cached_tokens_turn2": cached,
                    "texts": [t1["text"], t2["text"]]})
    return out


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--synthetic-target", default="llama-1b", help="benchmarks/synthetic.py SPECS name")
    ap.add_argument("--context", type=int, default=8192, help="words (= tokens) of turn 1's user message")
    ap.add_argument("--answer", type=int, default=64, help="max_tokens of each turn")
    ap.add_argument("--repeats", type=int, default=3, help="conversations per server (each turn 1 is new)")
    ap.add_argument("--draft-kind", default="none", help="mlx-spec serve's speculative kind (none: plain)")
    ap.add_argument("--servers", default="cache-on,cache-off,mlx-lm")
    ap.add_argument("--root", default=None, help="where the target is saved (default: a temporary folder)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)

    root = Path(args.root) if args.root else Path(tempfile.mkdtemp(prefix="prompt-cache-ttft-"))
    model = save_target(args.synthetic_target, root)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    chats = [conversation(rng, vocab, args.context) for _ in range(args.repeats)]
    results: Dict[str, Any] = {}
    for name in args.servers.split(","):
        kind = "mlx-lm" if name == "mlx-lm" else "mlx-spec"
        proc = Proc(name if kind == "mlx-spec" else kind, model, root,
                    cache_bytes=0 if name == "cache-off" else None, draft_kind=args.draft_kind)
        try:
            runs = run_server(proc, chats, args.answer)
        finally:
            proc.stop()
        results[name] = {"runs": runs, "median_ttft_turn1_s": statistics.median(r["ttft_turn1_s"] for r in runs),
                         "median_ttft_turn2_s": statistics.median(r["ttft_turn2_s"] for r in runs)}
        print(f"{name:10s} TTFT turn 1 {results[name]['median_ttft_turn1_s'] * 1000:9.1f} ms   turn 2 "
              f"{results[name]['median_ttft_turn2_s'] * 1000:9.1f} ms   cached (turn 2) "
              f"{[r['cached_tokens_turn2'] for r in runs]} of {[r['prompt_tokens_turn2'] for r in runs]}", flush=True)
    ref = results.get("cache-off")
    for name, res in results.items():
        if ref is not None:
            res["same_text_as_cache_off"] = [r["texts"] == o["texts"] for r, o in zip(res["runs"], ref["runs"])]
    meta = {"target": args.synthetic_target, "context": args.context, "answer": args.answer, "repeats": args.repeats,
            "draft_kind": args.draft_kind, "platform": platform.platform(), "python": sys.version.split()[0]}
    try:
        import mlx.core as mx
        import mlx_lm

        meta.update(mlx=mx.__version__, mlx_lm=mlx_lm.__version__, device=str(mx.default_device()))
    except ImportError:
        pass
    if args.json:
        for res in results.values():
            for r in res["runs"]:
                r.pop("texts")
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
