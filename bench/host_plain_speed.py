"""Plain decoding speed, side by side in one process: mlx-lm's generate_step, the host's pipelined
one-token steps (no plugin takes steps), and its unpipelined steps (a plugin that never goes idle).

    python bench/host_plain_speed.py [--model PATH] [--tokens 300] [--repeats 5] [--json out.json]

Defaults to the embedded demo target. Reports median tok/s; ratios are what matter on a CPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import mlx.core as mx
from mlx_lm.generate import generate_step

from mlx_speculative.hooks.batch import DecodeBatch
from mlx_speculative.hooks.host import GenerationParams, Host
from mlx_speculative.hooks.manager import make_plugin_manager
from mlx_speculative.hooks.specs import hookimpl
from mlx_speculative.hooks.state import HostConfig, StepOutput
from mlx_speculative.testing.tiny_models import ensure_random_pair


class NeverIdle:
    """Declines every row for one plain step at a time: the host asks again before each step, so
    nothing is queued ahead (returning None would allow a pipelined run)."""

    @hookimpl
    def host_decode_step(self, batch: DecodeBatch) -> Optional[List[StepOutput]]:
        return [StepOutput([], plain_steps=1) for _ in batch.rows]


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="write the results as JSON")
    args = parser.parse_args(argv)
    model = args.model or str(ensure_random_pair()[0])
    pipelined = Host(HostConfig(), pm=make_plugin_manager(False))
    unpipelined = Host(HostConfig(), pm=make_plugin_manager(False, [NeverIdle()]))
    target = pipelined.load(model)
    prompt = list(target.tokenizer.encode("the model token draft verify accept"))
    params = GenerationParams(max_tokens=args.tokens, stop_token_ids=[])

    def timed(run: Callable[[], Any]) -> float:
        start = time.perf_counter()
        run()
        return time.perf_counter() - start

    methods: Dict[str, Callable[[], Any]] = {
        "mlx_lm.generate_step": lambda: list(generate_step(mx.array(prompt), target.model, max_tokens=args.tokens)),
        "host plain, pipelined": lambda: pipelined.generate(target, prompt, params),
        "host plain, unpipelined": lambda: unpipelined.generate(target, prompt, params),
    }
    times: Dict[str, List[float]] = {name: [] for name in methods}
    for run in methods.values():
        run()  # warm-up: the same lengths as the timed runs (the warm regime)
    for _ in range(args.repeats):
        for name, run in methods.items():
            times[name].append(timed(run))
    base = statistics.median(times["mlx_lm.generate_step"])
    results: Dict[str, Dict[str, float]] = {}
    for name, values in times.items():
        median = statistics.median(values)
        results[name] = {"tok_s": round(args.tokens / median, 1), "vs_generate_step": round(base / median, 3)}
        print(f"{name:<26} {args.tokens / median:8.1f} tok/s  {base / median:5.2f}x generate_step")
    if args.json:
        report = {"model": model, "tokens": args.tokens, "repeats": args.repeats, "device": str(mx.default_device()),
                  "mlx": mx.__version__, "platform": platform.platform(), "results": results}
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
