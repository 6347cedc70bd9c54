"""Acceptance rate of speculative sampling (``acceptance: rejection``), mlx-lm's token match (``exact``) and the
coupled sampling seeded requests get.

Not a test. On the tests' tiny pair (4-layer llama target, hidden 64, vocab 384, random weights
with logit scale 3; drafter = its first 2 layers) and, for the dflash kind, a tiny z-lab-format
DFlash drafter trained for a few hundred steps on the target's greedy continuations of the very
prompts measured here (a tiny drafter generalises little; this measures the rules, not DFlash),
it runs 16 generations of 64 tokens per setting at each temperature (top-p 0.9) with a pinned block
size: unseeded for ``rejection`` and ``exact`` (mlx's global state seeded per prompt; the drafter's own
stream from fresh entropy), with request seeds for ``coupled`` (the drafts drawn with the noise the target
draws each position with, docs/lossless.md). It reports, summed over all prompts: rounds, draft tokens,
accepted, acceptance rate (accepted / draft tokens) and mean acceptance length tau (tokens per round,
bonus included). Temperature 0 is the greedy walk under every setting, shown for reference.

    python bench/acceptance_rate.py                                   # draft_model and dflash
    python bench/acceptance_rate.py --kinds draft_model --temperatures 0.7 1.0 --json out.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import mlx.core as mx

from mlx_speculative.testing import tiny_models as tm
from mlx_speculative.hooks.host import GenerationParams, Host
from mlx_speculative.hooks.manager import make_plugin_manager
from mlx_speculative.hooks.state import HostConfig, SamplingParams

PROMPTS = 16
DFLASH_BLOCK = 8
DFLASH_FORMAT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "dflash" / "z-lab__Qwen3-4B-DFlash-b16.config.json"


def make_pair(root: Path, dflash_steps: int) -> Dict[str, Path]:
    """The tests' llama pair (conftest's llama_pair: same config, seeds and scales) plus a DFlash drafter."""
    tok = root / "tokenizer"
    tm.train_tokenizer(tok)
    target = tm.make_checkpoint(root / "target", tm.llama_config(num_hidden_layers=4), seed=1, tokenizer_dir=tok,
                                logit_scale=3.0, quiet_layers_from=2)
    out = {"target": target, "draft_model": tm.make_truncated_drafter(target, root / "drafter", num_layers=2)}
    if dflash_steps >= 0:
        from mlx_speculative.drafters.dflash import tiny

        real = json.loads(DFLASH_FORMAT.read_text())
        config = tiny.shrink_config(real, target_layer_ids=[0, 2], mask_token_id=383, num_target_layers=4,
                                    block_size=DFLASH_BLOCK)
        out["dflash"] = tiny.write_checkpoint(root / "dflash", config, seed=34)
        if dflash_steps:
            # On the target's greedy continuations of the benchmark's own prompts (see ``bench_prompts``).
            losses = tiny.train(out["dflash"], target, steps=dflash_steps, sequences=PROMPTS, batch=PROMPTS,
                                length=8 + 64, seed=0)
            print(f"dflash drafter trained {dflash_steps} steps: loss {losses['first_loss']:.2f} -> {losses['last_loss']:.2f}")
    return out


def bench_prompts(tokenizer: Any) -> List[List[int]]:
    """8-token prompts: the texts and the form ``dflash.tiny.train`` (seed 0) trains on."""
    return [(tokenizer.encode(text, add_special_tokens=False) * 8)[:8] for text in tm.corpus(PROMPTS, seed=1)]


SETTINGS = ("rejection", "exact", "coupled")


def measure(pair: Dict[str, Path], kind: str, block: int, setting: str, temperature: float, top_p: float,
            prompts: List[List[int]], max_tokens: int) -> Dict[str, Any]:
    acceptance = "exact" if setting == "exact" else "rejection"
    speculative = {"draft_model": str(pair[kind]), "kind": kind, "block_size": block, "acceptance": acceptance}
    host = Host(HostConfig(sections={"speculative": speculative}), pm=make_plugin_manager())
    target = host.load(str(pair["target"]))
    totals = {"rounds": 0, "draft_tokens": 0, "accepted_tokens": 0, "tokens": 0}
    start = time.perf_counter()
    for seed, prompt in enumerate(prompts):
        mx.random.seed(seed)
        sampling = SamplingParams(temperature=temperature, top_p=top_p, seed=seed if setting == "coupled" else None)
        result = host.generate(target, prompt, GenerationParams(max_tokens=max_tokens, sampling=sampling, stop_token_ids=[]))
        stats = result.report["speculative"]
        assert stats.fallback is None, stats.fallback
        totals["rounds"] += stats.rounds
        totals["draft_tokens"] += stats.draft_tokens
        totals["accepted_tokens"] += stats.accepted_tokens
        totals["tokens"] += len(result.tokens)
    return {
        "kind": kind, "block_size": block, "acceptance": setting, "temperature": temperature, "top_p": top_p,
        **totals,
        "acceptance_rate": totals["accepted_tokens"] / max(totals["draft_tokens"], 1),
        "tau": 1 + totals["accepted_tokens"] / max(totals["rounds"], 1),
        "seconds": time.perf_counter() - start,
    }


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kinds", nargs="+", default=["draft_model", "dflash"], choices=["draft_model", "dflash"])
    p.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 0.7, 1.0])
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--block-draft-model", type=int, default=4, help="pinned block size for draft_model")
    p.add_argument("--block-dflash", type=int, default=DFLASH_BLOCK, help="pinned block size for dflash")
    p.add_argument("--dflash-steps", type=int, default=300, help="training steps for the tiny DFlash drafter (0: random)")
    p.add_argument("--workdir", type=Path, default=None, help="where to write the tiny checkpoints (default: a temp dir)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    mx.set_default_device(mx.cpu)
    root = args.workdir or Path(tempfile.mkdtemp(prefix="acceptance-"))
    pair = make_pair(root, args.dflash_steps if "dflash" in args.kinds else -1)
    tokenizer = Host(HostConfig(), pm=make_plugin_manager(load_entry_points=False)).load(str(pair["target"])).tokenizer
    texts = bench_prompts(tokenizer)

    rows = []
    print(f"{'kind':12} {'B':>3} {'temp':>5} {'acceptance':10} {'rounds':>7} {'drafted':>8} {'accepted':>9} {'rate':>6} {'tau':>6}")
    for kind in args.kinds:
        block = args.block_draft_model if kind == "draft_model" else args.block_dflash
        for temperature in args.temperatures:
            for setting in SETTINGS:
                r = measure(pair, kind, block, setting, temperature, args.top_p, texts, args.max_tokens)
                rows.append(r)
                print(f"{kind:12} {block:>3} {temperature:>5} {setting:10} {r['rounds']:>7} {r['draft_tokens']:>8} "
                      f"{r['accepted_tokens']:>9} {r['acceptance_rate']:>6.3f} {r['tau']:>6.2f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({
            "machine": platform.platform(), "mlx": mx.__version__, "prompts": PROMPTS,
            "max_tokens": args.max_tokens, "top_p": args.top_p, "results": rows,
            "command": " ".join(["python", "bench/acceptance_rate.py", *(sys.argv[1:] if argv is None else argv)]),
        }, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
