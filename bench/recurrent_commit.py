"""What keeping part of a verify forward costs on a recurrent target (qwen3_5 shape), per round.

Not a test. Builds a qwen3_5 model with random weights (``--shape 4b``: Qwen3.5-4B-like dimensions,
bf16; ``--shape tiny``: the tests' config, fp32), prefills a prompt, then runs rounds of block size
B: one verify forward over B positions inside a cache transaction, then ``commit(n)`` with
n = 1 (zero drafts accepted), B // 2 (partial) and B (full). Reports the median verify and commit
times per case, whether the commit took the recorded recurrence or a replay of the model, and the
commit's share of the round.

Runs on the code of this checkout and on older ones (the transaction module moved from
plugin/commit.py to hooks/transaction.py, and the recording from a process-wide patch to
hooks/recurrent.scope_model), so the same command measures both:

    python bench/recurrent_commit.py --shape 4b --block 16 --rounds 20 --json out.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from typing import Any, Callable, Dict, List

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from mlx_speculative.testing import tiny_models as tm

try:  # this checkout
    from mlx_speculative.hooks.recurrent import scope_model
    from mlx_speculative.hooks.transaction import CacheTransaction

    MECHANISM = "scoped recording (hooks/recurrent.py)"
except ImportError:  # older checkouts: the process-wide innovation tape
    from mlx_speculative.plugin.commit import CacheTransaction  # type: ignore[no-redef]

    def scope_model(model: Any) -> int:  # type: ignore[misc]
        return 0

    MECHANISM = "process-wide innovation tape (plugin/recurrent_tape.py)"

SHAPES: Dict[str, Callable[[], Dict[str, Any]]] = {
    "tiny": lambda: tm.qwen3_5_config(),
    # Qwen3.5-4B-like: 32 layers (one full-attention layer in 4), width 2560, GatedDeltaNet 16 key /
    # 32 value heads of 128; the vocabulary is cut to 32k (it only sizes the head, not the commit).
    "4b": lambda: tm.qwen3_5_config(
        hidden_size=2560, intermediate_size=9216, num_hidden_layers=32, num_attention_heads=16,
        num_key_value_heads=4, head_dim=256, full_attention_interval=4, linear_num_value_heads=32,
        linear_num_key_heads=16, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        vocab_size=32000, max_position_embeddings=32768, torch_dtype="bfloat16"),
}


def _arrays(cache: List[Any]) -> List[mx.array]:
    return [x for _, x in tree_flatten([c.state for c in cache]) if isinstance(x, mx.array)]


def measure(shape: str, block: int, rounds: int, prompt_len: int) -> Dict[str, Any]:
    config = SHAPES[shape]()
    mx.random.seed(0)
    model = tm.build_model(config)
    if config.get("torch_dtype") == "bfloat16":
        model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    scoped = scope_model(model)
    vocab = config["vocab_size"]
    cases = {"zero": 1, "partial": block // 2, "full": block}
    out: Dict[str, Any] = {}
    for name, n in cases.items():
        cache = make_prompt_cache(model)
        tokens = mx.random.randint(3, vocab, (prompt_len + (rounds + 2) * block,)).tolist()
        for i in range(0, prompt_len, 512):
            model(mx.array([tokens[i : min(i + 512, prompt_len)]]), cache=cache)
        mx.eval(_arrays(cache))
        pos = prompt_len
        verify, commit, replayed, taped = [], [], 0, 0
        for r in range(rounds + 2):  # two warm-up rounds
            fed = tokens[pos : pos + block]
            t0 = time.perf_counter()
            txn = CacheTransaction(cache, replay=lambda m, fed=fed: model(mx.array([fed[:m]]), cache=cache)).begin()
            logits = model(mx.array([fed]), cache=cache)  # [1, B, V]
            mx.eval(logits, _arrays(cache))
            t1 = time.perf_counter()
            txn.commit(n)
            mx.eval(_arrays(cache))
            t2 = time.perf_counter()
            if r >= 2:
                verify.append(t1 - t0)
                commit.append(t2 - t1)
                replayed += bool(txn.replayed)
                taped += bool(txn.taped)
            pos += n
        v, c = statistics.median(verify), statistics.median(commit)
        out[name] = {"kept": n, "verify_ms": round(1e3 * v, 3), "commit_ms": round(1e3 * c, 3),
                     "commit_share_of_round": round(c / (v + c), 4), "rounds_replayed": replayed,
                     "rounds_from_recording": taped, "rounds": rounds}
    return {"shape": shape, "config": config, "scoped_layers": scoped, "results": out}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="tiny", choices=list(SHAPES))
    p.add_argument("--block", type=int, default=16, help="block size B (positions per verify)")
    p.add_argument("--rounds", type=int, default=10, help="timed rounds per case")
    p.add_argument("--prompt", type=int, default=1024, help="prompt length")
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--json", help="write the results as JSON")
    args = p.parse_args()
    if args.cpu:
        mx.set_default_device(mx.cpu)
    report = measure(args.shape, args.block, args.rounds, args.prompt)
    report.update(mechanism=MECHANISM, device=str(mx.default_device()), mlx=mx.__version__,
                  platform=platform.platform(), block=args.block, prompt=args.prompt)
    print(f"{MECHANISM}; {args.shape} qwen3_5 shape, block {args.block}, prompt {args.prompt}, {mx.default_device()}")
    print(f"{'case':8} {'kept':>4} {'verify ms':>9} {'commit ms':>9} {'share':>6} {'recorded':>8} {'replayed':>8}")
    for name, r in report["results"].items():
        print(f"{name:8} {r['kept']:>4} {r['verify_ms']:9.3f} {r['commit_ms']:9.3f} {100 * r['commit_share_of_round']:5.1f}% "
              f"{r['rounds_from_recording']:>8} {r['rounds_replayed']:>8}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
