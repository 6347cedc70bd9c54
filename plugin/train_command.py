"""``mlx-spec train-drafter``: distil a drafter from a target on text, in MLX (drafters/training)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from typing import Any, List

from ..drafters.training.spec import TrainOptions


def _ints(text: str) -> List[int]:
    try:
        return [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"got {text!r}; expected layer ids separated by commas (e.g. 1,9,17)") from None


def _kinds() -> str:
    try:
        from ..drafters.training import trainable_kinds

        return "|".join(sorted(trainable_kinds())) or "none"
    except Exception:  # noqa: BLE001 - the help text must not break the CLI
        return "see `mlx-spec drafters`"


def add_command(subparsers: Any) -> None:
    kinds = _kinds()
    p = subparsers.add_parser(
        "train-drafter", help=f"train a drafter ({kinds.replace('|', ', ')}) for a target on text, in MLX",
        description="Distil a drafter from a target: prompts cut from the text are continued by the target "
                    "(its own greedy or sampled tokens are the labels; its hidden states the features), the "
                    "family's objective is trained with AdamW (warmup + cosine), and checkpoints are written "
                    "in the family's real format (config.json, model.safetensors) to --out.",
    )
    g = p.add_argument_group("what to train")
    g.add_argument("--target", required=True, help="target: path or HF repo id (offline: from the cache)")
    g.add_argument("--kind", required=True, help=f"drafter kind: {kinds}")
    g.add_argument("--data", nargs="+", required=True, metavar="PATH", help="text files, or directories of them (see --glob)")
    g.add_argument("--out", required=True, help="output directory: the checkpoint, and training/ (state, sequences, log.jsonl)")
    g.add_argument("--heldout", nargs="+", default=[], metavar="PATH",
                   help="held-out text for the tau estimate (default: a tenth of --data's prompts, at most --heldout-sequences)")
    g.add_argument("--glob", default="*", help="file pattern inside directories given to --data/--heldout (default: all files)")
    g.add_argument("--init", help="start from this drafter checkpoint (its config.json layout and size are kept)")
    d = p.add_argument_group("data")
    d.add_argument("--seq-len", type=int, default=256, help="tokens per sequence: prompt + the target's continuation (default 256)")
    d.add_argument("--prompt-tokens", type=int, default=64, help="tokens of text per prompt (default 64)")
    d.add_argument("--sequences", type=int, help="training sequences (default: steps x batch size, at most the prompts the text gives)")
    d.add_argument("--heldout-sequences", type=int, default=16, help="held-out sequences (default 16)")
    d.add_argument("--temperature", type=float, default=0.0, help="continue the training prompts sampled at this temperature (default 0: greedy); held-out ones are always greedy")
    d.add_argument("--gen-batch", type=int, default=64, help="prompts continued together (default 64)")
    o = p.add_argument_group("optimisation")
    o.add_argument("--steps", type=int, default=1000, help="optimiser steps (default 1000)")
    o.add_argument("--batch-size", type=int, default=8, help="sequences per step (default 8)")
    o.add_argument("--lr", type=float, default=6e-4, help="peak learning rate of AdamW (default 6e-4); cosine decay to 10%% of it")
    o.add_argument("--warmup", type=int, help="linear warmup steps (default: 5%% of --steps)")
    o.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay (default 0.01)")
    o.add_argument("--grad-clip", type=float, default=1.0, help="clip the gradient's global norm to this (default 1; 0: off)")
    o.add_argument("--seed", type=int, default=0, help="seed of the data order, anchors, sampling and a new drafter's weights")
    m = p.add_argument_group("the drafter")
    m.add_argument("--block-size", type=int, help="block size B (dflash: trained and written, default 16; eagle3: chain depth B-1 unrolled in training, default 8; draft_model: the tau estimate's, default 4)")
    m.add_argument("--num-layers", type=int, help="decoder layers of a new drafter (default 2; eagle3: 1)")
    m.add_argument("--hidden-size", type=int, help="draft_model: width of a new drafter (default the target's, starting from its first layers)")
    m.add_argument("--target-layers", type=_ints, metavar="I,J,...", help="dflash, eagle3: target layers read (output of layer i; default z-lab's spread, eagle3: outputs of 1, N/2-1, N-4)")
    m.add_argument("--draft-vocab-size", type=int, help="eagle3: the draft vocabulary, the target's most frequent tokens in the training continuations (default 32000, at most the target's)")
    m.add_argument("--mask-token-id", type=int, help="dflash: the mask token (default the first embedding row past the tokenizer's tokens, else the last id)")
    m.add_argument("--anchors", type=int, help="dflash: blocks per sequence per step (default 32)")
    m.add_argument("--loss-decay-gamma", type=float, help="dflash: weight block position k by exp(-(k-1)/gamma) (the paper: 7 at B=16, 5 at 10, 4 at 8; default off)")
    m.add_argument("--kl-weight", type=float, help="draft_model: share of KL(target || drafter) in the loss (default 0: cross-entropy only)")
    m.add_argument("--dtype", help="dtype of the written checkpoint: float32, bfloat16, float16 (default the target's)")
    r = p.add_argument_group("progress, evaluation, checkpoints")
    r.add_argument("--log-every", type=int, default=10, help="progress line every N steps (loss, lr, steps/s, tokens/s)")
    r.add_argument("--eval-every", type=int, default=100,
                   help="held-out tau every N steps and at the end (0: at the end only), offline and greedy: a round "
                        "at anchor p accepts the prefix of the drafter's block that matches the target's greedy tokens "
                        "p+1..; tau = 1 + accepted / rounds over the rounds greedy decoding of the held-out prompts makes "
                        "at this block size (also reported: the mean over every anchor position after the prompt)")
    r.add_argument("--checkpoint-every", type=int, default=100, help="write the checkpoint and resumable state every N steps (and at the end)")
    r.add_argument("--resume", action="store_true", help="continue the run in --out (same options; exact: same weights as an uninterrupted run)")
    r.add_argument("--max-time", type=float, help="stop after this many seconds with a checkpoint (continue with --resume)")
    r.add_argument("--cpu", action="store_true", help="train on the CPU")
    p.set_defaults(func=cmd_train_drafter)


def cmd_train_drafter(args: argparse.Namespace) -> int:
    import mlx.core as mx

    from ..drafters.training import train

    options = TrainOptions(**{f.name: getattr(args, f.name) for f in fields(TrainOptions) if hasattr(args, f.name)})
    if args.cpu:
        mx.set_default_device(mx.cpu)
    result = train(options, log=lambda line: print(line, flush=True))
    if result["complete"]:
        ev = result["eval"]
        line = f"[mlx-spec] {options.kind} drafter in {result['out']}"
        if ev is not None:
            line += f": held-out tau {ev['tau']:.2f} at block {ev['block_size']} (offline, greedy)"
        print(line, file=sys.stderr)
    return 0
