"""Speculative rounds over a target sharded on 2 ranks (ring backend, loopback) against the whole target, on the CPU.

    python bench/distributed.py [--tokens 96] [--prompts 3] [--block 4] [--json bench/results/distributed/cpu-2rank.json]

A tiny-but-not-trivial random llama (8 layers, hidden 512, made once under $MLX_SPEC_CACHE) and a 2-layer drafter cut
from it. The whole target runs in this process; then mlx.launch starts 2 ranks of this script (``--rank-out``), each
holding half of every layer (mlx-lm's shard()). Each side decodes the same prompts plainly and speculatively
(draft_model, pinned block; on the ranks with the drafter replicated and on rank 0 alone); greedy, so every run must
give the same tokens. Reported: generation tok/s and the ratios sharded / whole and speculative / plain, and what
the ranks exchange, from the shapes of the sharded layers: mlx-lm's shard() all-sums [B, L, hidden] twice per layer
(after o_proj and down_proj), so a plain step moves 2 x layers tensors of one position, a round the same number of
tensors of W = block positions, plus the engine's own messages (rank 0's round cost; rank 0's proposals with
``drafter: rank0``). Both ranks share this machine's cores: on one machine sharding only adds work; the numbers
say what a round saves in collectives per token, which is what pays across machines.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional

import mlx.core as mx

from mlx_speculative.hooks import distributed
from mlx_speculative.hooks.host import GenerationParams, Host
from mlx_speculative.hooks.manager import make_plugin_manager
from mlx_speculative.hooks.state import HostConfig
from mlx_speculative.testing import tiny_models as tm

PROMPTS = ["the model token draft verify accept", "red green blue one two three red green blue",
           "river stone light night day code river stone", "query key value tree query key value"]
CONFIG = dict(num_hidden_layers=8, hidden_size=512, intermediate_size=1408, num_attention_heads=8,
              num_key_value_heads=4, head_dim=64)


def pair() -> Dict[str, Path]:
    root = Path(os.environ.get("MLX_SPEC_CACHE") or Path.home() / ".cache" / "mlx-speculative") / "distributed-bench"
    target, drafter = root / "target", root / "drafter"
    if not (drafter / "model.safetensors").exists():
        tm.make_checkpoint(target, tm.llama_config(**CONFIG), seed=11, logit_scale=4.0, quiet_layers_from=2)
        tm.make_truncated_drafter(target, drafter, num_layers=2)
    return {"target": target, "drafter": drafter}


def measure(cluster: Optional[distributed.Cluster], models: Dict[str, Path], args: argparse.Namespace) -> Dict[str, Any]:
    """Plain and speculative generation on this side (whole target: cluster None), tok/s over every prompt."""
    runs: Dict[str, Any] = {}
    modes = [("plain", None, "replicated"), ("speculative", "replicated", "replicated")]
    if cluster is not None:
        modes.append(("speculative, drafter on rank 0", "rank0", "rank0"))
    for name, spec, where in modes:
        here = distributed.Cluster(cluster.group, distributed.DistributedSettings(drafter=where)) if cluster else None
        sections = {"speculative": {"draft_model": str(models["drafter"]), "block_size": args.block}} if spec else {}
        host = Host(HostConfig(sections=sections), pm=make_plugin_manager(load_entry_points=bool(spec)), cluster=here)
        target = host.load(str(models["target"]))
        params = GenerationParams(max_tokens=args.tokens, stop_token_ids=[])
        tokens, seconds, rounds, accepted = [], 0.0, 0, 0
        prompts = [list(target.tokenizer.encode(p, add_special_tokens=False)) for p in PROMPTS[: args.prompts]]
        host.generate(target, prompts[0], GenerationParams(max_tokens=8, stop_token_ids=[]))  # warm-up
        for prompt in prompts:
            result = host.generate(target, prompt, params)
            tokens.append(result.tokens)
            seconds += result.generation_seconds
            stats = result.report.get("speculative")
            if stats is not None:
                rounds, accepted = rounds + stats.rounds, accepted + stats.accepted_tokens
        n = sum(len(t) for t in tokens)
        runs[name] = {"tok_s": round(n / seconds, 2), "tokens": n, "rounds": rounds,
                      "tau": round((rounds + accepted) / rounds, 3) if rounds else None,
                      "outputs": tokens}
    return runs


def exchanged(args: argparse.Namespace, tau: float) -> Dict[str, Any]:
    """Bytes and collectives of one plain step and one round (batch of 1), from the sharded layers' shapes
    (hooks/distributed.py, as ``mlx-spec bench --distributed`` reports them)."""
    return distributed.exchanged(*distributed.dense_all_sums(CONFIG, itemsize=4), args.block, tau)  # float32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--block", type=int, default=4)
    parser.add_argument("--json", help="write the results as JSON")
    parser.add_argument("--rank-out", help=argparse.SUPPRESS)  # a rank under mlx.launch: its results go here
    args = parser.parse_args(argv)
    mx.set_default_device(mx.cpu)
    models = pair()
    if args.rank_out:
        cluster = distributed.init(distributed.DistributedSettings())
        runs = measure(cluster, models, args)
        if cluster.primary:
            Path(args.rank_out).write_text(json.dumps(runs))
        return 0
    whole = measure(None, models, args)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ranks.json"
        launcher = Path(sys.executable).with_name("mlx.launch")
        cmd = [str(launcher), "--backend", "ring", "--hosts", "127.0.0.1,127.0.0.1", "--starting-port", str(free_port()),
               "--", sys.executable, str(Path(__file__).resolve()), "--tokens", str(args.tokens), "--prompts",
               str(args.prompts), "--block", str(args.block), "--rank-out", str(out)]
        subprocess.run(cmd, check=True, timeout=900)
        sharded = json.loads(out.read_text())
    reference = whole["plain"]["outputs"]
    for side in (whole, sharded):
        for run in side.values():
            assert run.pop("outputs") == reference, "every greedy run gives the whole target's tokens"
    tau = sharded["speculative"]["tau"]
    report = {
        "command": "python bench/distributed.py " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "mlx": mx.__version__},
        "target": {"model_type": "llama", **CONFIG, "dtype": "float32", "random_weights": True},
        "drafter": "the target's first 2 layers (draft_model)", "block_size": args.block, "ranks": 2, "backend": "ring",
        "prompts": args.prompts, "max_tokens": args.tokens,
        "whole": whole, "sharded": sharded,
        "ratios": {
            "sharded_over_whole_plain": round(sharded["plain"]["tok_s"] / whole["plain"]["tok_s"], 3),
            "sharded_over_whole_speculative": round(sharded["speculative"]["tok_s"] / whole["speculative"]["tok_s"], 3),
            "speculative_over_plain_whole": round(whole["speculative"]["tok_s"] / whole["plain"]["tok_s"], 3),
            "speculative_over_plain_sharded": round(sharded["speculative"]["tok_s"] / sharded["plain"]["tok_s"], 3),
            "rank0_drafter_over_replicated": round(sharded["speculative, drafter on rank 0"]["tok_s"]
                                                   / sharded["speculative"]["tok_s"], 3),
        },
        "exchanged": exchanged(args, tau),
        "outputs_identical": True,
        "note": "one run; both ranks share this machine's cores (no network): the ratios, not the tok/s, carry over",
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
