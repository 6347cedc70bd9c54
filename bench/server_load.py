"""Load test for `mlx-spec serve`: many concurrent streaming clients against one server process.

Makes a tiny random target/drafter pair (real mlx-lm checkpoints, see testing/tiny_models.py), starts
the server on a free loopback port, records every request's output sequentially (one client,
greedy), then runs N streaming clients for D seconds and checks:
  - zero errors,
  - every output equal to its sequential greedy output (text and completion token count),
  - server memory (VmRSS) stable: growth between the end of the first and the last fifth of the run.
The default policy is batched decode steps (server.batching: one target forward per step for all
active requests, speculative rounds with per-row acceptance). With --compare it runs the same load
under the other policies too: interleaved (server.batching: false, --max-active N: one request's
step at a time, round robin) and FIFO (one request at a time, --max-active 1), and prints all.
--kind picks the drafter (draft_model, ngram) or plain decoding (none). From the server's /metrics,
over the load only: rounds and tau (spec_decode_num_*), decode steps and mean rows per step
(mlx_spec_decode_rows_total / mlx_spec_decode_steps_total: rows per target forward).

    python bench/server_load.py --clients 16 --duration 60 --compare
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import yaml

PROMPTS = [
    "the model token draft verify", "red green blue one two three red green blue one two",
    "river stone light night day code", "accept commit accept commit accept commit accept",
    "one two three four five six seven eight nine ten", "query key value tree query key value tree query",
    "page book word line page book word line", "test plan build run step loop test plan build run",
    "speed decode prefill sample greedy window state hidden head", "if then else when and or but",
    "the the the the the the", "green river night code stone",
]


def make_models(root: Path) -> Tuple[Path, Path]:
    from mlx_speculative.testing import tiny_models as tm

    target, drafter = root / "target", root / "drafter"
    if not (drafter / "model.safetensors").exists():
        tok = root / "tokenizer"
        tm.train_tokenizer(tok)
        tm.make_checkpoint(target, tm.llama_config(num_hidden_layers=4), seed=1, tokenizer_dir=tok,
                           logit_scale=3.0, quiet_layers_from=2)
        tm.make_truncated_drafter(target, drafter, num_layers=2)
    return target, drafter


class Server:
    def __init__(self, root: Path, config: Dict[str, Any], args: List[str]):
        root.mkdir(parents=True, exist_ok=True)
        cfg = root / "host.yaml"
        cfg.write_text(yaml.safe_dump(config))
        self.log_path = root / "server.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_VLM_")}
        env["HF_HUB_OFFLINE"] = "1"
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "mlx_speculative.hooks.cli", "serve", "--config", str(cfg),
                                          "--port", "0", *args], stdout=subprocess.DEVNULL, stderr=log, env=env)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            found = re.search(r"listening on (http://127\.0\.0\.1:\d+)", self.log_path.read_text())
            if found:
                self.url = found.group(1)
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"server did not start:\n{self.log_path.read_text()}")

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def metrics(self) -> Dict[str, float]:
        import urllib.request

        text = urllib.request.urlopen(self.url + "/metrics", timeout=10).read().decode()
        return {n: float(v) for n, v in (l.rsplit(" ", 1) for l in text.splitlines() if l and not l.startswith("#"))}

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def requests_list(max_tokens: int) -> List[Dict[str, Any]]:
    out = []
    for i, p in enumerate(PROMPTS):
        n = 16 + (i * 13) % max(max_tokens - 15, 1)
        out.append({"kind": "chat" if i % 2 else "text", "prompt": p, "max_tokens": n})
    return out


def run_one(client: Any, req: Dict[str, Any]) -> Tuple[str, int, float, float]:
    """One streaming request: (text, completion tokens, seconds to first chunk, total seconds)."""
    t0 = time.perf_counter()
    first: Optional[float] = None
    text, tokens = "", -1
    if req["kind"] == "chat":
        stream = client.chat.completions.create(model="default_model", messages=[{"role": "user", "content": req["prompt"]}],
                                                max_tokens=req["max_tokens"], temperature=0, stream=True,
                                                stream_options={"include_usage": True})
    else:
        stream = client.completions.create(model="default_model", prompt=req["prompt"], max_tokens=req["max_tokens"],
                                           temperature=0, stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if first is None:
            first = time.perf_counter()
        if chunk.choices:
            c = chunk.choices[0]
            text += (c.delta.content or "") if req["kind"] == "chat" else c.text
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    return text, tokens, (first or end) - t0, end - t0


def load_run(server: Server, reqs: List[Dict[str, Any]], refs: List[Tuple[str, int]], clients: int,
             duration: float) -> Dict[str, Any]:
    import openai

    lock = threading.Lock()
    stats = {"requests": 0, "errors": 0, "mismatches": 0, "tokens": 0}
    ttft: List[float] = []
    latency: List[float] = []
    error_samples: List[str] = []
    rss: List[Tuple[float, float]] = []
    stop_at = time.monotonic() + duration

    def client_loop(i: int) -> None:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        k = i
        while time.monotonic() < stop_at:
            j = k % len(reqs)
            k += 1
            try:
                text, tokens, t_first, t_total = run_one(client, reqs[j])
            except Exception as e:  # noqa: BLE001
                with lock:
                    stats["errors"] += 1
                    error_samples.append(f"{type(e).__name__}: {e}")
                continue
            with lock:
                stats["requests"] += 1
                stats["tokens"] += max(tokens, 0)
                ttft.append(t_first)
                latency.append(t_total)
                if (text, tokens) != refs[j]:
                    stats["mismatches"] += 1

    before = server.metrics()
    t0 = time.monotonic()
    threads = [threading.Thread(target=client_loop, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        rss.append((time.monotonic() - t0, server.rss_mb()))
        time.sleep(1.0)
    wall = time.monotonic() - t0
    after = server.metrics()
    fifth = max(len(rss) // 5, 1)
    early = statistics.mean(v for _, v in rss[:fifth * 2][fifth:] or rss[:1])
    late = statistics.mean(v for _, v in rss[-fifth:])

    def q(xs: List[float], p: float) -> float:
        return sorted(xs)[min(int(p * len(xs)), len(xs) - 1)] if xs else float("nan")

    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}  # counters over the load only
    drafts, accepted = d.get("spec_decode_num_drafts_total", 0), d.get("spec_decode_num_accepted_tokens_total", 0)
    steps, rows = d.get("mlx_spec_decode_steps_total", 0), d.get("mlx_spec_decode_rows_total", 0)
    return {
        "clients": clients, "duration_s": round(wall, 1), **stats,
        "requests_per_s": round(stats["requests"] / wall, 2), "tokens_per_s": round(stats["tokens"] / wall, 1),
        "ttft_p50_ms": round(1000 * q(ttft, 0.5), 1), "ttft_p95_ms": round(1000 * q(ttft, 0.95), 1),
        "latency_p50_ms": round(1000 * q(latency, 0.5), 1), "latency_p95_ms": round(1000 * q(latency, 0.95), 1),
        "rss_mb_second_fifth": round(early, 1), "rss_mb_last_fifth": round(late, 1),
        "rss_mb_max": round(max(v for _, v in rss), 1), "rss_growth_pct": round(100 * (late - early) / early, 2),
        "rounds": int(drafts), "tau": round(1 + accepted / drafts, 3) if drafts else None,
        "decode_steps": int(steps), "mean_rows_per_decode_step": round(rows / steps, 2) if steps else None,
        "error_samples": error_samples[:3],
    }


def bench(policy: str, max_active: int, args: argparse.Namespace, target: Path, drafter: Path, root: Path) -> Dict[str, Any]:
    import openai

    config: Dict[str, Any] = {"model": str(target), "server": {"max_tokens": args.max_tokens,
                                                               "batching": policy == "batched"}}
    if args.prompt_cache_bytes is not None:
        config["server"]["prompt_cache_bytes"] = args.prompt_cache_bytes
    if args.kind == "draft_model":
        config["speculative"] = {"draft_model": str(drafter), "block_size": 4}
    elif args.kind == "ngram":
        config["speculative"] = {"kind": "ngram", "block_size": 4}
    server = Server(root / policy, config, ["--max-active", str(max_active), "--max-queue", str(4 * args.clients)])
    try:
        reqs = requests_list(args.max_tokens)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        refs = [run_one(client, r)[:2] for r in reqs]  # sequential greedy outputs
        result = load_run(server, reqs, refs, args.clients, args.duration)
        after = server.metrics()
        result.update(prompt_cache_bytes=after.get("mlx_spec_prompt_cache_bytes", 0),
                      prompt_cache_entries=after.get("mlx_spec_prompt_cache_entries", 0))
        result.update(policy=policy, max_active=max_active, kind=args.kind)
        return result
    finally:
        server.stop()


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of load per policy")
    ap.add_argument("--max-tokens", type=int, default=64, help="longest request (requests use 16..this)")
    ap.add_argument("--compare", action="store_true",
                    help="also run the interleaved policy (server.batching: false) and FIFO (--max-active 1)")
    ap.add_argument("--kind", choices=["draft_model", "ngram", "none"], default="draft_model",
                    help="the drafter (none: plain decoding)")
    ap.add_argument("--prompt-cache-bytes", default=None, help="server.prompt_cache_bytes (default: the server's)")
    ap.add_argument("--models", type=Path, default=None, help="where to make/keep the tiny models")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        target, drafter = make_models(args.models or root / "models")
        results = [bench("batched", args.clients, args, target, drafter, root)]
        if args.compare:
            results.append(bench("interleaved", args.clients, args, target, drafter, root))
            results.append(bench("fifo", 1, args, target, drafter, root))
    for r in results:
        print(json.dumps(r))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    ok = all(r["errors"] == 0 and r["mismatches"] == 0 and r["requests"] > 0 for r in results)
    print("PASS" if ok else "FAIL", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
