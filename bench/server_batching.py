"""Does the server batch on this machine? Concurrent clients against a real HTTP server on a
synthetic target, plain decoding and DFlash rounds (oracle acceptance), mean rows per decode step.

Not a test. The target is built in memory (``--synthetic-target``, plugin/bench/synthetic.py: random
weights with large logit margins) with a word-level tokenizer of its vocabulary made here, and served
in this process by the real server (hooks/server.py: HTTP threads, the engine's generation thread,
the scheduler); ``--clients`` threads send completions for
``--duration`` seconds. Each output is compared with the same request answered alone first.
For ``dflash`` a DFlash-shape drafter runs for real and its proposals are replaced by each request's
reference continuation with errors injected (mean acceptance length ``--tau``), as ``mlx-spec bench``'s
oracle does. Reported per mode, from the server's /metrics: decode steps, rows over those steps,
their ratio (mean rows per target forward), rounds and tau; and the clients' tokens per second.

    python bench/server_batching.py --synthetic-target llama-8b --clients 8 --duration 40 --json out.json
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx

from mlx_speculative.hooks.host import GenerationParams, Host
from mlx_speculative.hooks.manager import make_plugin_manager
from mlx_speculative.hooks.server import Server, build_server
from mlx_speculative.hooks.server_settings import server_settings
from mlx_speculative.hooks.state import HostConfig, LoadedTarget
from mlx_speculative.plugin import cache_policy, hookimpls
from mlx_speculative.plugin.bench import oracle as orc
from mlx_speculative.plugin.bench import synthetic
from mlx_speculative.plugin.settings import SpeculativeSettings


def word_tokenizer(vocab: int, root: Path) -> Any:
    """A word-level tokenizer for ids 0..vocab-1 ("w<i>"), loaded the way mlx-lm loads any tokenizer."""
    from mlx_lm.utils import load_tokenizer
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = {("</s>" if i == 1 else "[UNK]" if i == 2 else f"w{i}"): i for i in range(vocab)}  # EOS 1, UNK 2
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    root.mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>", "unk_token": "[UNK]",
        "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}"}))
    return load_tokenizer(root)


def prompts(n: int, vocab: int, length: int) -> List[str]:
    rng = __import__("random").Random(0)
    return [" ".join(f"w{rng.randrange(3, vocab)}" for _ in range(length + 7 * i)) for i in range(n)]


def serve(target: LoadedTarget, settings_over: Dict[str, Any]) -> Server:
    settings = server_settings(HostConfig(overrides={"server": {"port": 0, **settings_over}}))
    plugins = [hookimpls] if hookimpls.NAME in target.attachments else []
    server = build_server(HostConfig(), target.name, settings, pm=make_plugin_manager(False, plugins), target=target)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def metrics(server: Server) -> Dict[str, float]:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{server.server_address[1]}/metrics", timeout=30).read().decode()
    return {n: float(v) for n, v in (l.rsplit(" ", 1) for l in text.splitlines() if l and not l.startswith("#"))}


def one(url: str, prompt: str, max_tokens: int) -> Tuple[str, int]:
    """One completion (urllib: the GPU machine has no openai client): (text, completion tokens)."""
    import urllib.request

    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(url + "/completions", body, {"Content-Type": "application/json"})
    out = json.loads(urllib.request.urlopen(req, timeout=600).read())
    return out["choices"][0]["text"], out["usage"]["completion_tokens"]


def load(server: Server, reqs: List[str], refs: List[Tuple[str, int]], clients: int, duration: float,
         max_tokens: int) -> Dict[str, Any]:
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    lock = threading.Lock()
    stats = {"requests": 0, "errors": 0, "mismatches": 0, "tokens": 0}
    stop_at = time.monotonic() + duration

    def loop(i: int) -> None:
        k = i
        while time.monotonic() < stop_at:
            j = k % len(reqs)
            k += 1
            try:
                got = one(url, reqs[j], max_tokens)
            except Exception:  # noqa: BLE001
                with lock:
                    stats["errors"] += 1
                continue
            with lock:
                stats["requests"] += 1
                stats["tokens"] += max(got[1], 0)
                stats["mismatches"] += int(got != refs[j])

    before = metrics(server)
    t0 = time.monotonic()
    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    after = metrics(server)
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    steps, rows = d.get("mlx_spec_decode_steps_total", 0), d.get("mlx_spec_decode_rows_total", 0)
    drafts = d.get("spec_decode_num_drafts_total", 0)
    return {**stats, "clients": clients, "seconds": round(wall, 1), "tokens_per_s": round(stats["tokens"] / wall, 1),
            "decode_steps": int(steps), "rows_over_steps": int(rows),
            "mean_rows_per_step": round(rows / steps, 3) if steps else None, "rounds": int(drafts),
            "tau": round(1 + d.get("spec_decode_num_accepted_tokens_total", 0) / drafts, 3) if drafts else None}


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--synthetic-target", default="tiny", choices=list(synthetic.SPECS))
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of load per mode")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-words", type=int, default=128, help="length of the shortest prompt")
    ap.add_argument("--tau", type=float, default=6.5, help="oracle mean acceptance length for dflash")
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--modes", default="plain,dflash")
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.cpu:
        mx.set_default_device(mx.cpu)
    config = synthetic.config_for(args.synthetic_target)
    model = synthetic.build(config)
    vocab = config["vocab_size"]
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = word_tokenizer(vocab, Path(tmp) / "tokenizer")
    reqs = prompts(args.clients, vocab, args.prompt_words)
    policy = cache_policy.policy_for()
    results: Dict[str, Any] = {}
    for mode in args.modes.split(","):
        target = LoadedTarget(model=model, tokenizer=tokenizer, path=Path("synthetic"), model_config=config,
                              name=args.synthetic_target)
        if mode == "dflash":
            drafter, _ = synthetic.dflash_drafter(model, config, args.block, 5, 2, policy)
            ora = orc.Oracle(orc.alpha_for_tau(args.tau, args.block), vocab)
            plain = Host(HostConfig(), pm=make_plugin_manager(False))
            for p in reqs:  # each request's reference continuation, for the oracle
                ids = tokenizer.encode(p, add_special_tokens=False)
                ora.register(ids, plain.generate(target, ids, GenerationParams(max_tokens=args.max_tokens)).tokens)
            settings = SpeculativeSettings(enabled=True, kind="dflash", block_size=args.block, adaptive=False)
            target.attachments[hookimpls.NAME] = hookimpls.Attachment(
                settings=settings, drafter=orc.WrappedDrafter(drafter, ora), block_size=args.block, policy=policy)
            if getattr(policy, "shape_stable", False):  # the padded caches' shapes (the routed policy has none)
                policy.prewarm(model, args.block)
        server = serve(target, {"max_active": args.clients, "max_queue": 4 * args.clients})
        try:
            url = f"http://127.0.0.1:{server.server_address[1]}/v1"
            refs = [one(url, p, args.max_tokens) for p in reqs]  # each request alone
            results[mode] = load(server, reqs, refs, args.clients, args.duration, args.max_tokens)
        finally:
            server.shutdown()
            server.engine.stop()
            server.server_close()
        print(f"{mode}: {json.dumps(results[mode])}", flush=True)
    report = {"command": "python bench/server_batching.py " + " ".join(argv if argv is not None else __import__("sys").argv[1:]),
              "target": args.synthetic_target, "device": str(mx.default_device()), "mlx": mx.__version__,
              "platform": platform.platform(), "cache_policy": policy.name if policy else "mlx-lm", "results": results}
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    ok = all(r["errors"] == 0 and r["requests"] > 0 for r in results.values())
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
