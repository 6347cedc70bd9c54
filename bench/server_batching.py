"""Served speed: concurrent clients against a real HTTP server, plain batching against speculative rounds.

Not a test. The target is built in memory (``--synthetic-target``, benchmarks/synthetic.py: random weights
with large logit margins; ``--quantize-target 4``: its weights in 4 bits) with a byte-level word tokenizer of
its vocabulary made here (``word_tokenizer``), and served in this process by the real server (hooks/server.py:
HTTP threads, the engine's generation thread, the scheduler, the plugins as a deployment registers them). For each mode and
each client count of ``--clients``, that many threads send completions for ``--duration`` seconds; every
output is compared with the same request answered alone first (0 mismatches expected in every mode).

Modes: ``plain`` (the host's plain decoding, the plugins registered as installed, speculation off: on CUDA the
plugin's backend, rows at their own lengths, padded keys, the kernels), ``plain-compiled`` (the same with its
one-token steps through the compiled forward too: an A/B), ``mlx-lm`` (no plugin: mlx-lm's caches,
attention and matmuls), ``dflash`` (a
DFlash-shape drafter runs for real, its proposals replaced by each request's reference continuation with
errors injected at mean acceptance length ``--tau``, as ``mlx-spec bench``'s oracle does; adaptive blocks of
at most ``--block``), ``dflash-tau1`` (the same drafts never accepted) and ``dflash-uncompiled-batches`` (dflash,
a batch's forwards not compiled: each new shape of a batch traces and compiles anew). Reported per mode and client
count, from the server's /metrics and the responses: tok/s, decode steps and mean rows per step (one target
forward each), ms per decode step, rounds and tau, the round's steps (ms per round, from the requests'
``timings``), and the plugin's compiled-call and attention-kernel counts.

    python bench/server_batching.py --synthetic-target llama-8b --clients 1,2,4,8 --duration 30 \\
        --max-tokens 256 --prompt-words 256 --json bench/results/served/h100-llama8b.json

A real model (``--model PATH``: a checkpoint folder or a .gguf file, loaded by the server as ``mlx-spec serve``
loads it; bench/served_real.py) with real prompts (``--prompts-file``, default bench/prompts/real_heldout.json:
raw prompts as /v1/completions, chat prompts as /v1/chat/completions) and real drafters: modes ``plain``
(speculation off) and one per ``--drafter PATH[@B]`` (a DFlash/EAGLE-3 checkpoint or a draft LM, its kind read
from the checkpoint or given by ``--draft-kind``; the mode is named by its kind), plus ``ngram`` with ``--kind
ngram``. Each mode's server gets a ``speculative:`` section as a deployment's config would, and the plugin
attaches the drafter itself. ``--quantize-target 4`` serves a 4-bit copy of the target.

    python bench/server_batching.py --model ~/.cache/mlx-speculative/real/qwen2.5-coder-1.5b-instruct-f32 \\
        --drafter ~/.cache/mlx-speculative/real/qwen2.5-coder-0.5b-instruct-f32@4 --kind ngram \\
        --prompts-file bench/prompts/real_heldout.json --clients 1,4,8 --duration 20 --max-tokens 128 \\
        --json bench/results/served/real-qwen1.5b.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import re
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn

from mlx_speculative.hooks.host import GenerationParams, Host
from mlx_speculative.hooks.manager import make_plugin_manager
from mlx_speculative.hooks.server import Server, build_server
from mlx_speculative.hooks.server_settings import server_settings
from mlx_speculative.hooks.state import HostConfig, LoadedTarget
from mlx_speculative.plugin import cuda, hookimpls
from mlx_speculative.benchmarks import oracle as orc
from mlx_speculative.benchmarks import synthetic
from mlx_speculative.plugin.settings import SpeculativeSettings

sys.path.insert(0, str(Path(__file__).resolve().parent))  # served_real.py beside this file, however it is run
import served_real  # noqa: E402
from stack_sampler import StackSampler  # noqa: E402

SAMPLE_STACKS = False  # --sample-stacks: the generation thread's stack sampled during each load
MODES = ("plain", "plain-compiled", "mlx-lm", "dflash", "dflash-tau1", "dflash-uncompiled-batches")


def word(i: int) -> str:
    """Word i of the synthetic vocabulary: "w" and i in base 26 as letters (one pre-token: letters only)."""
    s = ""
    while True:
        s, i = chr(97 + i % 26) + s, i // 26
        if not i:
            return "w" + s


def word_tokenizer(vocab: int, root: Path) -> Any:
    """A byte-level word tokenizer for ids 0..vocab-1 (" w<letters>"), loaded the way mlx-lm loads any tokenizer.

    Byte-level as Llama 3's and Qwen's BPE tokenizers are, so that mlx-lm streams its text with its BPE
    detokenizer as it does theirs. A plain word-level decoder gets mlx-lm's naive detokenizer, which decodes the
    whole line again at every token; with no line ever ending here that is quadratic, a cost on the generation
    thread no real deployment of these models pays (bench/detokenizer_cost.py)."""
    from mlx_lm.utils import load_tokenizer
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = {("</s>" if i == 1 else "[UNK]" if i == 2 else "\u0120" + word(i)): i for i in range(vocab)}  # EOS 1, UNK 2
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.decoder = decoders.ByteLevel()
    root.mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>", "unk_token": "[UNK]",
        "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}"}))
    return load_tokenizer(root)


def prompts(n: int, vocab: int, length: int) -> List[str]:
    rng = random.Random(0)
    return [" ".join(word(rng.randrange(3, vocab)) for _ in range(length + 7 * i)) for i in range(n)]


def serve(target: LoadedTarget, plugins: List[Any], settings_over: Dict[str, Any]) -> Server:
    settings = server_settings(HostConfig(overrides={"server": {"port": 0, **settings_over}}))
    server = build_server(HostConfig(), target.name, settings, pm=make_plugin_manager(False, plugins), target=target)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def metrics(server: Server) -> Dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.server_address[1]}/metrics", timeout=30).read().decode()
    return {n: float(v) for n, v in (l.rsplit(" ", 1) for l in text.splitlines() if l and not l.startswith("#"))}


def one(url: str, prompt: Union[str, served_real.real.TextPrompt], max_tokens: int
        ) -> Tuple[Tuple[str, int], Dict[str, Any]]:
    """One completion (urllib: the GPU machine has no openai client): ((text, completion tokens), timings). A chat
    prompt (``TextPrompt`` with ``chat``) goes to /chat/completions as one user message."""
    chat = not isinstance(prompt, str) and prompt.chat
    text = prompt if isinstance(prompt, str) else prompt.text
    fields = {"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text}
    body = json.dumps({**fields, "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(url + ("/chat/completions" if chat else "/completions"), body,
                                 {"Content-Type": "application/json"})
    out = json.loads(urllib.request.urlopen(req, timeout=600).read())
    choice = out["choices"][0]
    return (choice["message"]["content"] if chat else choice["text"], out["usage"]["completion_tokens"]), \
        out.get("timings") or {}


def load(server: Server, reqs: List[Any], refs: List[Tuple[str, int]], clients: int, duration: float,
         max_tokens: int, pool: Optional[int] = None, stride: int = 1) -> Dict[str, Any]:
    """``clients`` threads for ``duration`` s; client i sends requests i, i + stride, ... modulo ``pool``
    (default: the first ``clients`` requests, one after the other)."""
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    lock = threading.Lock()
    stats: Dict[str, Any] = {"requests": 0, "errors": 0, "mismatches": 0, "tokens": 0}
    request_ms = {"prompt": 0.0, "predicted": 0.0}  # per request: first token (prefill), and the rest
    steps: Dict[str, float] = {}
    rounds = [0]
    paused: Dict[str, Any] = {"plain_steps": 0, "reasons": {}, "examples": {}}
    stop_at = time.monotonic() + duration

    def loop(i: int) -> None:
        k = i
        while time.monotonic() < stop_at:
            j = k % (pool or clients)  # client i sends prompts i, i + 1, ... of the first ``clients`` (synthetic)
            k += stride
            try:
                got, timing = one(url, reqs[j], max_tokens)
            except Exception:  # noqa: BLE001
                with lock:
                    stats["errors"] += 1
                continue
            with lock:
                stats["requests"] += 1
                stats["tokens"] += max(got[1], 0)
                stats["mismatches"] += int(got != refs[j])
                rounds[0] += int(timing.get("draft_rounds") or 0)
                for part in request_ms:
                    request_ms[part] += float(timing.get(f"{part}_ms") or 0.0)
                paused["plain_steps"] += int(timing.get("draft_plain_steps") or 0)
                full = timing.get("draft_pause_reason") or ""
                why = re.sub(r"\d+(\.\d+)?", "#", full.split(" (")[0])[:90]  # the rule, without its numbers
                if why:
                    paused["reasons"][why] = paused["reasons"].get(why, 0) + 1
                    paused["examples"].setdefault(why, full)  # the first one, numbers included
                for name, ms in (timing.get("round_steps_ms") or {}).items():
                    steps[name] = steps.get(name, 0.0) + ms

    before = metrics(server)
    traces0 = _traces(server)
    sampler = StackSampler("mlx-spec-generation").start() if SAMPLE_STACKS else None
    window = [time.time(), 0.0]  # epoch seconds: lines up with a device monitor's log
    t0 = time.monotonic()
    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    window[1] = time.time()
    stacks = sampler.stop() if sampler is not None else None
    d = {k: v - before.get(k, 0.0) for k, v in metrics(server).items()}
    n_steps, rows = d.get("mlx_spec_decode_steps_total", 0), d.get("mlx_spec_decode_rows_total", 0)
    drafts = d.get("spec_decode_num_drafts_total", 0)
    return {**stats, "clients": clients, "seconds": round(wall, 1), "tokens_per_s": round(stats["tokens"] / wall, 1),
            "decode_steps": int(n_steps), "mean_rows_per_step": round(rows / n_steps, 3) if n_steps else None,
            "ms_per_decode_step": round(1e3 * wall / n_steps, 2) if n_steps else None, "rounds": int(drafts),
            "tau": round(1 + d.get("spec_decode_num_accepted_tokens_total", 0) / drafts, 3) if drafts else None,
            # a batched round's steps are recorded by each of its rows: per row-round
            "ms_per_row_round": {k: round(v / rounds[0], 3) for k, v in sorted(steps.items())} if rounds[0] else None,
            # where the generation thread's time went, as shares of the load's wall clock
            "thread_share": {k: round(d.get(f"mlx_spec_{k}_seconds_total", 0.0) / wall, 3) for k in ("prefill", "decode")},
            "mean_request_ms": {k: round(v / stats["requests"], 1) for k, v in request_ms.items()} if stats["requests"] else None,
            "paused_plain_steps": paused["plain_steps"], "pause_reasons": paused["reasons"],
            "pause_examples": paused["examples"], "window": [round(w, 2) for w in window],
            # shapes traced during the load (each one a compile on MLX-CUDA: seconds the warm-up was to take)
            "traces_during_load": _traces(server) - traces0,
            **({"stacks": stacks} if stacks else {})}


def target_for(mode: str, model: nn.Module, config: Dict[str, Any], tokenizer: Any, name: str, block: int, tau: float,
               reqs: List[str], max_tokens: int) -> Tuple[LoadedTarget, List[Any]]:
    """The target as the server gets it for ``mode``, and the host plugins a deployment registers."""
    target = LoadedTarget(model=model, tokenizer=tokenizer, path=Path("synthetic"), model_config=config, name=name)
    if mode == "mlx-lm":
        return target, []
    if mode in ("plain", "plain-compiled"):  # as the plugin attaches itself with speculation off
        policy = hookimpls.plain_backend()
        if mode == "plain-compiled" and policy is not None and policy.forward is not None:
            # The A/B of one-token steps compiled too: plain steps are host-bound on an H100 (the GPU busy 51-60% of
            # plain serving), and a compiled forward builds nothing in Python; one row measured slower compiled on an
            # H200 at 4k-16k keys, batches never measured.
            policy.forward.widths = policy.forward.widths | {1}
        target.attachments[hookimpls.NAME] = hookimpls.Attachment(settings=SpeculativeSettings(enabled=False),
                                                                  policy=policy)
        return target, [hookimpls]
    policy = cuda.backend_for()
    if mode == "dflash-uncompiled-batches" and policy is not None and policy.forward is not None:
        policy.forward.batches = False
    drafter, _ = synthetic.dflash_drafter(model, config, block, 5, 2, policy)
    ora = orc.Oracle(orc.alpha_for_tau(1.0 if mode == "dflash-tau1" else tau, block), config["vocab_size"])
    plain = Host(HostConfig(), pm=make_plugin_manager(False))
    for p in reqs:  # each request's reference continuation, for the oracle
        ids = tokenizer.encode(p, add_special_tokens=False)
        ora.register(ids, plain.generate(target, ids, GenerationParams(max_tokens=max_tokens)).tokens)
    settings = SpeculativeSettings(enabled=True, kind="dflash", block_size=None, adaptive=True)
    if policy is not None:
        policy.block_size = block
    target.attachments[hookimpls.NAME] = hookimpls.Attachment(
        settings=settings, drafter=orc.WrappedDrafter(drafter, ora), block_size=block, policy=policy)
    return target, [hookimpls]


def _traces(server: Server) -> int:
    forward = server.engine.target.cache_policy.forward if server.engine.target is not None else None
    return len(getattr(forward, "trace_ms", ()))


def plugin_counts(target: LoadedTarget) -> Dict[str, Any]:
    policy = target.cache_policy
    out: Dict[str, Any] = {"cache_policy": policy.name}
    for name, part in {"forward": policy.forward, "attention": policy.attention, "projections": policy.projections}.items():
        if part is not None and hasattr(part, "report"):
            out[name] = part.report()
    att = target.attachments.get("speculative")
    if att is not None and hasattr(att, "costs"):
        out["costs_ms"] = att.costs.report()  # the adaptive controllers' prices (plugin/costs.py)
    return out


def ratios_of(results: Dict[str, Any]) -> Dict[str, Dict[str, float]]:
    """Each mode's tok/s over plain's by client count, and plain's over plain at one client."""
    ratios: Dict[str, Dict[str, float]] = {}
    if "plain" in results:
        base = results["plain"]["by_clients"]
        for mode in results:
            ratios[mode] = {n: round(r["tokens_per_s"] / base[n]["tokens_per_s"], 3)
                            for n, r in results[mode]["by_clients"].items() if base[n]["tokens_per_s"]}
        one_client = base.get("1", {}).get("tokens_per_s")
        if one_client:
            ratios["plain_over_plain_x1"] = {n: round(r["tokens_per_s"] / one_client, 3) for n, r in base.items()}
    return ratios


def write_report(args: argparse.Namespace, argv: Optional[List[str]], results: Dict[str, Any],
                 real_fields: Optional[Dict[str, Any]] = None) -> None:
    """The JSON (``--json``) of the modes so far, with their ratios (``real_fields``: a --model run's own keys)."""
    fields = real_fields if real_fields is not None else {
        "target": args.synthetic_target, "quantized_bits": args.quantize_target, "max_tokens": args.max_tokens,
        "prompt_words": args.prompt_words, "tau": args.tau, "block": args.block}
    report = {"command": "python bench/server_batching.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              **fields, "device": str(mx.default_device()), "mlx": mx.__version__, "platform": platform.platform(),
              "results": results, "tokens_per_s_over_plain": ratios_of(results)}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--synthetic-target", default=None, choices=list(synthetic.SPECS),
                    help="the synthetic target (default tiny; instead of --model)")
    ap.add_argument("--quantize-target", type=int, default=None, choices=[4, 8], metavar="BITS")
    ap.add_argument("--clients", default="1,2,4,8", help="client counts, one load each per mode")
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of load per mode and client count")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--prompt-words", type=int, default=None, help="length of the shortest prompt (default 256)")
    ap.add_argument("--tau", type=float, default=None, help="oracle mean acceptance length for dflash (default 6)")
    ap.add_argument("--block", type=int, default=None, help="the oracle drafter's block (default 16)")
    ap.add_argument("--modes", default=None, help=f"synthetic: any of {', '.join(MODES)} (default plain,dflash,"
                    "dflash-tau1); --model: any of plain and the drafters' modes (default: all)")
    ap.add_argument("--warmup-tokens", type=int, default=None,
                    help="the server's warmup_tokens (keys its warm-up reaches; default: the server's, 2048)")
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--sample-stacks", action="store_true",
                    help="sample the generation thread's Python stack every 2 ms during each load (bench/stack_sampler.py)")
    ap.add_argument("--json", type=Path)
    served_real.add_arguments(ap)
    args = ap.parse_args(argv)
    served_real.check(args, ap.error)
    global SAMPLE_STACKS
    SAMPLE_STACKS = args.sample_stacks
    try:
        clients = [int(c) for c in args.clients.split(",")]
    except ValueError:
        clients = []
    if not clients or min(clients) < 1:
        ap.error(f"--clients: got {args.clients!r}; allowed: positive integers joined by commas")
    if args.cpu:
        mx.set_default_device(mx.cpu)
    if args.model is not None:
        return main_real(ap, args, argv, clients)
    args.synthetic_target = args.synthetic_target or "tiny"
    args.prompt_words = 256 if args.prompt_words is None else args.prompt_words
    args.tau = 6.0 if args.tau is None else args.tau
    args.block = 16 if args.block is None else args.block
    args.modes = args.modes or "plain,dflash,dflash-tau1"
    modes = args.modes.split(",")
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"--modes: got {args.modes!r}; allowed: {', '.join(MODES)}")
    config = synthetic.config_for(args.synthetic_target)
    model = synthetic.build(config)
    if args.quantize_target:
        nn.quantize(model, group_size=64, bits=args.quantize_target)
        mx.eval(model.parameters())  # here: lazy weights evaluated on the generation thread meet no stream there
    vocab = config["vocab_size"]
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = word_tokenizer(vocab, Path(tmp) / "tokenizer")
    reqs = prompts(max(clients), vocab, args.prompt_words)
    results: Dict[str, Any] = {}
    for mode in modes:
        target, plugins = target_for(mode, model, config, tokenizer, args.synthetic_target, args.block, args.tau, reqs,
                                     args.max_tokens)
        t0 = time.perf_counter()
        over: Dict[str, Any] = {"max_active": max(clients), "max_queue": 4 * max(clients)}
        if args.warmup_tokens is not None:
            over["warmup_tokens"] = args.warmup_tokens
        server = serve(target, plugins, over)
        try:
            url = f"http://127.0.0.1:{server.server_address[1]}/v1"
            refs = [one(url, p, args.max_tokens)[0] for p in reqs]  # each request alone
            results[mode] = {"load_and_refs_s": round(time.perf_counter() - t0, 1), "by_clients": {}}
            for n in clients:
                row = load(server, reqs, refs, n, args.duration, args.max_tokens)
                results[mode]["by_clients"][str(n)] = row
                print(f"{mode} x{n}: {json.dumps(row)}", file=sys.stderr, flush=True)
            results[mode]["plugin"] = plugin_counts(server.engine.target or target)
            write_report(args, argv, results)  # after each mode: a run cut short keeps the modes it finished
        finally:
            served_real.stop(server)
    return finish(results)


def finish(results: Dict[str, Any]) -> int:
    print(json.dumps(ratios_of(results), indent=1))
    ok = all(r["errors"] == 0 and r["requests"] > 0 for m in results.values() for r in m["by_clients"].values())
    return 0 if ok else 1


def main_real(ap: argparse.ArgumentParser, args: argparse.Namespace, argv: Optional[List[str]],
              clients: List[int]) -> int:
    """``--model``: a real checkpoint served with its real drafters (bench/served_real.py)."""
    try:
        modes = served_real.select(served_real.modes_for(args), args.modes, ap.error)
        prompts = served_real.requests(args)  # a bad file fails here, before any model loads
        fields = served_real.report_fields(args, modes, prompts)
    except (ValueError, OSError) as e:  # a bad --drafter, --draft-kind, --model or --prompts-file
        ap.error(str(e))
    results = served_real.run(args, prompts, clients, modes, load, one, plugin_counts,
                              lambda res: write_report(args, argv, res, fields))
    return finish(results)


if __name__ == "__main__":
    raise SystemExit(main())
