"""Checks of a training run's options that need nothing loaded (one-line errors), and the run's
state directory (what ``--resume`` continues)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, Optional, Type

from .. import registry
from .spec import NOT_RUN_DEFINING, FamilyTrainer, TrainOptions, option_name

STATE_DIR = "training"  # under --out: the resumable state, the sequences, the log


def trainable_kinds() -> Dict[str, Any]:
    """kind -> the family that can train a drafter of that kind (``DrafterFamily.trainer`` set)."""
    out: Dict[str, Any] = {}
    for family in registry.families().values():
        if getattr(family, "trainer", None) is not None and family.kind not in out:
            out[family.kind] = family
    return out


def trainer_class(kind: str) -> Type[FamilyTrainer]:
    kinds = trainable_kinds()
    if kind not in kinds:
        raise ValueError(f"--kind: {kind!r} cannot be trained here; trainable kinds: {', '.join(sorted(kinds)) or 'none'}")
    cls = kinds[kind].trainer()
    if not (isinstance(cls, type) and issubclass(cls, FamilyTrainer)):
        raise ValueError(f"--kind {kind}: family {kinds[kind].name!r} gave {cls!r} as its trainer; expected a FamilyTrainer subclass")
    return cls


def _at_least(o: TrainOptions, name: str, low: float) -> None:
    value = getattr(o, name)
    if value is not None and (not math.isfinite(value) or value < low):
        raise ValueError(f"{option_name(name)}: got {value}; allowed: {low:g} or more")


def check_options(o: TrainOptions, prompts: bool = False) -> Type[FamilyTrainer]:
    """Everything about ``o`` that depends on the arguments only; returns the family's trainer class.
    ``prompts``: token prompts are given instead of text (no --data needed)."""
    cls = trainer_class(o.kind)
    if not o.data and not prompts:
        raise ValueError("--data: no text given; expected one or more text files or directories")
    for name, low in (("steps", 1), ("batch_size", 1), ("seq_len", 2), ("prompt_tokens", 1), ("sequences", 1),
                      ("heldout_sequences", 0), ("temperature", 0), ("warmup", 0), ("weight_decay", 0),
                      ("grad_clip", 0), ("num_layers", 1), ("eval_every", 0), ("checkpoint_every", 0),
                      ("log_every", 1), ("gen_batch", 1), ("max_time", 0), ("seed", 0)):
        _at_least(o, name, low)
    if not (math.isfinite(o.lr) and o.lr > 0):
        raise ValueError(f"--lr: got {o.lr}; allowed: a learning rate above 0")
    if o.warmup is not None and o.warmup >= o.steps:
        raise ValueError(f"--warmup: got {o.warmup} steps; allowed: fewer than --steps ({o.steps})")
    if o.block_size is not None and not 2 <= o.block_size <= 128:
        raise ValueError(f"--block-size: got {o.block_size}; allowed: 2 to 128")
    if o.dtype is not None and o.dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"--dtype: got {o.dtype!r}; allowed: float32, bfloat16, float16")
    cls.check_options(o)
    block = o.block_size or cls.default_block_size
    least = max(o.prompt_tokens - 1, 1) + block  # one block after the prompt's last token
    if o.seq_len < least:
        raise ValueError(f"--seq-len: got {o.seq_len}; allowed: at least {least} (--prompt-tokens {o.prompt_tokens} "
                         f"- 1 + block size {block}: one block after the prompt)")
    if o.init is not None and (o.num_layers is not None or o.hidden_size is not None):
        raise ValueError("--init: the drafter's size comes from its config.json; leave out --num-layers and --hidden-size")
    return cls


def run_options(o: TrainOptions) -> Dict[str, Any]:
    """The options that decide the data and the weights (compared when resuming)."""
    return {k: v for k, v in asdict(o).items() if k not in NOT_RUN_DEFINING}


def read_state(out: Path) -> Optional[Dict[str, Any]]:
    f = out / STATE_DIR / "state.json"
    return json.loads(f.read_text()) if f.is_file() else None


def check_out(o: TrainOptions, resolved: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The state to resume from (None: a fresh run); refuses an --out that holds something else."""
    out = Path(o.out).expanduser()
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out: {o.out!r} is a file; expected a new or empty directory")
    state = read_state(out) if out.is_dir() else None
    if state is None:
        if out.is_dir() and any(out.iterdir()) and not (out / STATE_DIR).is_dir():
            raise ValueError(f"--out: {o.out!r} is not empty and holds no training run; expected a new or empty directory")
        return None
    if not o.resume:
        raise ValueError(f"--out: {o.out!r} holds a training run at step {state['step']} of {state['options']['steps']}; "
                         "pass --resume to continue it, or choose another --out")
    before = state["options"]
    changed = [k for k in resolved if before.get(k) != resolved[k]]
    if changed:
        k = changed[0]
        raise ValueError(f"--resume: {option_name(k)} was {before.get(k)!r} in the run in {o.out!r}, now {resolved[k]!r}; "
                         f"a resumed run needs the same options ({len(changed)} differ: "
                         f"{', '.join(option_name(c) for c in changed)}), or another --out")
    return state
