"""How predictable the demo target's own greedy choices are: its top-1 probability along its greedy path.

A drafter is judged on matching the target's argmax; where the target itself puts little mass on its
choice (near-ties), matching it takes replicating its computation. This prints, over the held-out prompts'
greedy continuations (plain decoding, float32, CPU), the mean top-1 probability and the share of steps whose
top two tokens lie within 0.1 of each other, overall and by position (the target trained on windows of
``seq_len`` tokens; positions past it are extrapolation):

    python bench/demo_confidence.py --demo-dir demo --prompts 32 --max-tokens 128 \
        --json bench/results/demo/cpu-target-confidence.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List, Optional

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).parent))
import demo_acceptance as da  # noqa: E402

from mlx_speculative.hooks.cli import encode_prompt  # noqa: E402
from mlx_speculative.hooks.host import Host  # noqa: E402
from mlx_speculative.hooks.manager import make_plugin_manager  # noqa: E402
from mlx_speculative.hooks.state import HostConfig  # noqa: E402


BUCKET = 64  # positions per row of "by_position"


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--demo-dir", default="demo")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--json")
    a = p.parse_args(argv)
    mx.set_default_device(mx.cpu)
    demo = Path(a.demo_dir)
    items = json.loads((demo / "prompts.json").read_text())["prompts"][: a.prompts]
    target = da.load_target(demo, "float32")
    prompts = [encode_prompt(target.tokenizer, it["prompt"], chat=False) for it in items]
    host = Host(HostConfig(), pm=make_plugin_manager(load_entry_points=False))
    top1 = near = steps = 0.0
    buckets: Dict[int, List[float]] = {}  # position // BUCKET -> [top-1 sum, near-ties, steps]
    for prompt, (tokens, _) in zip(prompts, da.decode(host, target, prompts, a.max_tokens, len(prompts))):
        logits = target.model(mx.array([prompt + tokens]))[0, len(prompt) - 1:-1].astype(mx.float32)  # [T, V]
        probs = mx.sort(mx.softmax(logits, axis=-1), axis=-1)
        first = probs[:, -1].tolist()
        close = (probs[:, -1] - probs[:, -2] < 0.1).tolist()
        for i, (p1, c) in enumerate(zip(first, close)):  # the token at position len(prompt) + i
            b = buckets.setdefault((len(prompt) + i) // BUCKET, [0.0, 0.0, 0.0])
            b[0], b[1], b[2] = b[0] + p1, b[1] + c, b[2] + 1
        top1 += sum(first)
        near += sum(close)
        steps += len(first)
    manifest = demo / "manifest.json"
    window = json.loads(manifest.read_text())["target"]["options"]["seq_len"] if manifest.exists() else None
    report = {"command": "python bench/demo_confidence.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "prompts": len(prompts), "greedy_steps": int(steps), "mean_top1_probability": round(top1 / steps, 4),
              "share_top2_within_0.1": round(near / steps, 4),
              "by_position": [{"positions": f"{k * BUCKET}-{(k + 1) * BUCKET - 1}", "steps": int(b[2]),
                               "mean_top1_probability": round(b[0] / b[2], 4),
                               "share_top2_within_0.1": round(b[1] / b[2], 4)} for k, b in sorted(buckets.items())],
              "target_training_window": window,
              "device": "cpu", "dtype": "float32"}
    print(json.dumps(report, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
