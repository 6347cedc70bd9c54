"""The registry models (bench/real_models.py fetch) measured on the CPU, float32, greedy.

    python bench/real_pair.py parity --cache /work/cache/real --json bench/results/real/cpu-parity.json
    python bench/real_pair.py pair --target DIR/qwen2.5-coder-1.5b-instruct-f32 \\
        --draft-model DIR/qwen2.5-coder-0.5b-instruct-f32 --prompts bench/prompts/real_pair.json \\
        --max-tokens 128 --blocks 8 --plain-prompts 2 --json bench/results/real/cpu-pair-b8.json

``parity``: each model loads directly from its GGUF file (``--model x.gguf``: converted once into the
cache) and from its ``mlx-spec convert --dtype f32`` folder, and writes the same first tokens both ways;
the converted 0.5B's greedy output from this project's host (plain decoding, as ``mlx-spec generate
--no-speculative``) equals mlx-lm's own ``generate_step`` on the same folder (--parity-prompts x
--parity-tokens).

``pair``: the draft_model kind, the 0.5B drafting for the 1.5B, pinned block sizes (adaptive off), each
prompt once per block: tau per prompt and its median. Every speculative output is checked against the
target's own greedy choice at each position (one teacher-forced forward over prompt + output: argmax
and its margin over the runner-up); the first --plain-prompts prompts are also decoded one token at a
time (plain decoding, the costly reference: ~2 s per token for the 1.5B in float32 here) and compared
token for token; --prompt-ids runs a subset (a block-size sweep). Prompts with "chat": true go through the model's chat template. EOS ends a request.
The JSON is rewritten after every prompt.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import mlx.core as mx

from mlx_speculative.hooks.cli import encode_prompt
from mlx_speculative.hooks.host import GenerationParams, Host
from mlx_speculative.hooks.manager import make_plugin_manager
from mlx_speculative.hooks.state import HostConfig

PARITY_PROMPTS = [
    "def fibonacci(n):\n", "Write a haiku about the sea.", "import os\n\n\ndef list_python_files(root):\n",
    "What is the capital of France?", "class Point:\n    def __init__(self, x, y):\n",
    "Explain recursion to a child.", "for i in range(10):\n", "Give three tips for writing clean code.",
]


def _environment(command: List[str]) -> Dict[str, Any]:
    return {"command": " ".join(["python", "bench/real_pair.py", *command]), "device": "cpu", "dtype": "float32",
            "machine": platform.machine(), "cpus": os.cpu_count(), "mlx": mx.__version__,
            "ld_preload": os.environ.get("LD_PRELOAD"),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def _host(speculative: Optional[Dict[str, Any]]) -> Host:
    sections = {"speculative": speculative} if speculative else {}
    return Host(HostConfig(sections=sections), pm=make_plugin_manager(load_entry_points=speculative is not None))


def _greedy_mlx_lm(model: Any, ids: List[int], n: int, eos: set) -> List[int]:
    from mlx_lm.generate import generate_step

    out = []
    for token, _ in generate_step(mx.array(ids), model, max_tokens=n):
        if int(token) in eos:  # the host ends there too, without emitting it
            break
        out.append(int(token))
    return out


def parity(args: argparse.Namespace, argv: List[str]) -> int:
    from mlx_speculative.hooks import loading

    cache = Path(args.cache)
    models = json.loads((cache / "models.json").read_text())
    report: Dict[str, Any] = {"environment": _environment(["parity", *argv]), "loads": {}, "parity": None}
    plain = _host(None)
    for name, where in models.items():
        row: Dict[str, Any] = {}
        for how, spec in (("gguf", where["gguf"]), ("converted_f32", where["f32"])):
            start = time.perf_counter()
            target = plain.load(spec)
            ids = encode_prompt(target.tokenizer, PARITY_PROMPTS[0], chat=False)
            result = plain.generate(target, ids, GenerationParams(max_tokens=args.load_tokens))
            row[how] = {"path": str(loading.resolve_path(spec)), "seconds": round(time.perf_counter() - start, 1),
                        "tokens": result.tokens, "text": result.text}
            del target
        row["same_tokens"] = row["gguf"]["tokens"] == row["converted_f32"]["tokens"]
        report["loads"][name] = row
        print(f"[parity] {name}: loads directly and converted; same first {args.load_tokens} tokens: "
              f"{row['same_tokens']}; {row['converted_f32']['text']!r}", flush=True)
    folder = models[args.parity_model]["f32"]
    target = plain.load(folder)
    eos = set(target.tokenizer.eos_token_ids)
    rows = []
    for text in PARITY_PROMPTS[: args.parity_prompts]:
        ids = encode_prompt(target.tokenizer, text, chat=True)
        mine = plain.generate(target, ids, GenerationParams(max_tokens=args.parity_tokens)).tokens
        theirs = _greedy_mlx_lm(target.model, ids, args.parity_tokens, eos)
        rows.append({"prompt": text, "identical": mine == theirs, "tokens": len(mine), "text": target.tokenizer.decode(mine)})
        print(f"[parity] {args.parity_model} f32: identical {mine == theirs} ({len(mine)} tokens)", flush=True)
    report["parity"] = {"model": folder, "prompts": rows, "identical_share": sum(r["identical"] for r in rows) / len(rows),
                        "what": "this project's host, plain greedy decoding, against mlx_lm.generate.generate_step "
                                "on the same converted float32 folder; chat template; EOS ends a request"}
    _write(args.json, report)
    return 0


def _teacher_forced(model: Any, ids: List[int], out: List[int]) -> Dict[str, Any]:
    """The target's greedy choice at each position of prompt + out, from one forward; margin = top1 - top2."""
    logits = model(mx.array([ids + out[:-1]]))[0, len(ids) - 1:].astype(mx.float32)  # [len(out), V]
    top2 = mx.topk(logits, 2, axis=-1)
    choice = mx.argmax(logits, axis=-1)
    margin = mx.abs(top2[:, 1] - top2[:, 0])
    mx.eval(choice, margin)
    diff = [i for i, (a, b) in enumerate(zip(choice.tolist(), out)) if a != b]
    return {"argmax_equal": not diff, "first_mismatch": diff[0] if diff else None,
            "mismatch_margins": [round(float(margin[i]), 5) for i in diff[:5]],
            "min_margin": round(float(margin.min()), 5)}


def pair(args: argparse.Namespace, argv: List[str]) -> int:
    items = list(enumerate(json.loads(Path(args.prompts).read_text())["prompts"]))[: args.max_prompts]
    if args.prompt_ids:
        keep = {int(i) for i in args.prompt_ids.split(",")}
        items = [(i, item) for i, item in items if i in keep]
    blocks = [int(b) for b in args.blocks.split(",")]
    hosts = {b: _host({"draft_model": args.draft_model, "block_size": b, "adaptive": False}) for b in blocks}
    target = hosts[blocks[0]].load(args.target)
    plain = _host(None)
    report: Dict[str, Any] = {"environment": _environment(["pair", *argv]), "target": args.target,
                              "draft_model": args.draft_model, "kind": "draft_model", "blocks": blocks,
                              "max_tokens": args.max_tokens, "prompts_file": args.prompts, "rows": []}
    for n, (i, item) in enumerate(items):
        ids = encode_prompt(target.tokenizer, item["prompt"], chat=item["chat"])
        row: Dict[str, Any] = {"i": i, "kind": item["kind"], "prompt_tokens": len(ids), "by_block": {}}
        reference = None
        if n < args.plain_prompts:
            result = plain.generate(target, ids, GenerationParams(max_tokens=args.max_tokens))
            reference = result.tokens
            row["plain"] = {"tokens": len(reference), "tok_s": round(result.generation_tps, 3)}
        for b in blocks:
            result = hosts[b].generate(target, ids, GenerationParams(max_tokens=args.max_tokens))
            stats = result.report["speculative"]
            entry = {"tokens": len(result.tokens), "rounds": stats.rounds, "accepted": stats.accepted_tokens,
                     "drafted": stats.draft_tokens, "tau": round(stats.mean_acceptance_length, 3),
                     "tok_s": round(result.generation_tps, 3), "plain_steps": stats.plain_steps}
            entry.update(_teacher_forced(target.model, ids, result.tokens))
            if reference is not None:
                entry["identical_to_plain"] = result.tokens == reference
            if b == blocks[0]:
                row["text"] = result.text
            row["by_block"][str(b)] = entry
            print(f"[pair] prompt {i} ({item['kind']}) b{b}: tau {entry['tau']:.2f}, {entry['tokens']} tokens, "
                  f"argmax equal {entry['argmax_equal']}" + (f", identical to plain {entry['identical_to_plain']}"
                                                            if reference is not None else ""), flush=True)
        report["rows"].append(row)
        report["summary"] = _summary(report["rows"], blocks)
        _write(args.json, report)
    print(json.dumps(report["summary"], indent=1))
    return 0


def _summary(rows: List[Dict[str, Any]], blocks: List[int]) -> Dict[str, Any]:
    out = {}
    for b in blocks:
        entries = [r["by_block"][str(b)] for r in rows if str(b) in r["by_block"]]
        checked = [e["identical_to_plain"] for e in entries if "identical_to_plain" in e]
        out[f"b{b}"] = {"prompts": len(entries), "tau_per_prompt": [e["tau"] for e in entries],
                        "median_tau": round(statistics.median(e["tau"] for e in entries), 3),
                        "argmax_equal_share": sum(e["argmax_equal"] for e in entries) / len(entries),
                        "identical_to_plain": f"{sum(checked)}/{len(checked)}" if checked else None}
    return out


def _write(path: Optional[str], report: Dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(report, indent=1, ensure_ascii=False))


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("parity", help="direct and converted loads; host vs mlx-lm greedy on the converted 0.5B")
    p.add_argument("--cache", required=True, help="the folder bench/real_models.py fetch filled (its models.json)")
    p.add_argument("--load-tokens", type=int, default=16)
    p.add_argument("--parity-model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--parity-prompts", type=int, default=8)
    p.add_argument("--parity-tokens", type=int, default=64)
    p.add_argument("--json")
    p = sub.add_parser("pair", help="draft_model pair: tau per prompt, outputs against the target's greedy choice")
    p.add_argument("--target", required=True)
    p.add_argument("--draft-model", required=True)
    p.add_argument("--prompts", required=True, help='JSON {"prompts": [{"prompt", "chat", "kind"}, ...]}')
    p.add_argument("--max-prompts", type=int, default=None)
    p.add_argument("--prompt-ids", help="only these prompts (their indices in the file), comma-separated")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--blocks", default="4,6,8", help="pinned block sizes, comma-separated")
    p.add_argument("--plain-prompts", type=int, default=0, help="prompts also decoded plainly (the reference)")
    p.add_argument("--json")
    args = parser.parse_args(argv)
    mx.set_default_device(mx.cpu)
    return parity(args, argv[1:]) if args.command == "parity" else pair(args, argv[1:])


if __name__ == "__main__":
    sys.exit(main())
