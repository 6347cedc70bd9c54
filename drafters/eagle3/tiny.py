"""Tiny EAGLE-3 checkpoints with random weights, written in the real layouts (tests, demos).

``shrink_config`` keeps a real config.json's layout and field names and replaces its sizes;
``write_checkpoint`` saves random weights under that layout's tensor names, with a ``d2t``/``t2d``
for a reduced draft vocabulary; ``train`` trains one in place with the training core.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from .model import Model, ModelArgs, checkpoint_name, config_layout

TINY = {
    "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "num_hidden_layers": 1, "vocab_size": 384,
}


def set_layer_ids(config: Dict[str, Any], ids: Optional[Sequence[int]]) -> Dict[str, Any]:
    """Write the layer ids where ``config``'s layout keeps them, in place (None: leave them out)."""
    layout = config_layout(config)
    if layout == "speculators":
        config["eagle_aux_hidden_state_layer_ids"] = list(ids) if ids is not None else None
    elif ids is not None:
        config.setdefault("eagle_config", {})["eagle_aux_hidden_state_layer_ids"] = list(ids)
    elif layout == "specforge":
        config["eagle_config"].pop("eagle_aux_hidden_state_layer_ids", None)
    return config


def shrink_config(real: Dict[str, Any], *, layer_ids: Optional[Sequence[int]] = None, draft_vocab_size: int = 256,
                  sliding_window: Optional[int] = 8, **over: Any) -> Dict[str, Any]:
    """``real`` with tiny sizes, in the same places and under the same names. ``layer_ids``: written
    where the layout keeps them (an ``eagle`` config with ids becomes SpecForge's ``eagle_config``)."""
    config = copy.deepcopy(real)
    speculators = config_layout(config) == "speculators"
    geometry = config["transformer_layer_config"] if speculators else config
    sizes = dict(TINY, **{k: v for k, v in over.items() if k in TINY})
    for k, v in sizes.items():
        if k in geometry or k in ("hidden_size", "num_hidden_layers", "vocab_size"):
            geometry[k] = v
    n = sizes["num_hidden_layers"]
    if "layer_types" in geometry:
        geometry["layer_types"] = (geometry["layer_types"] * n)[:n]
    if geometry.get("sliding_window") is not None and sliding_window is not None:
        geometry["sliding_window"] = sliding_window
    config["draft_vocab_size"] = draft_vocab_size
    set_layer_ids(config, layer_ids)
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if config.get(k) is not None:
            config[k] = min(int(config[k]), sizes["vocab_size"] - 1)
    config["torch_dtype" if "torch_dtype" in config else "dtype"] = "float32"
    for k, v in over.items():
        if k not in TINY:
            config[k] = v
    return config


def vocab_maps(draft_ids: Sequence[int], vocab_size: int) -> Dict[str, mx.array]:
    """EAGLE's ``d2t`` (int64 offsets: target id = draft id + d2t[draft id]) and ``t2d`` (bool, kept target ids)."""
    ids = np.sort(np.asarray(draft_ids, dtype=np.int64))
    t2d = np.zeros(vocab_size, dtype=np.bool_)
    t2d[ids] = True
    return {"d2t": mx.array(ids - np.arange(len(ids))), "t2d": mx.array(t2d)}


def default_draft_ids(vocab_size: int, draft_vocab_size: int, seed: int) -> List[int]:
    """A fixed random subset of the target's ids (sorted): offsets of every size, none trivial at the end."""
    if draft_vocab_size >= vocab_size:
        return list(range(vocab_size))
    rng = np.random.default_rng(seed)
    return sorted(rng.choice(vocab_size, draft_vocab_size, replace=False).tolist())


def write_checkpoint(
    out_dir: Path, config: Dict[str, Any], seed: int = 0, own_embedding: bool = False,
    draft_ids: Optional[Sequence[int]] = None, scale: float = 1.0,
) -> Path:
    """Random weights for ``config`` saved under its layout's tensor names, plus d2t/t2d."""
    mx.random.seed(seed)
    args = ModelArgs.from_dict(config)
    model = Model(args, own_embedding=own_embedding)
    weights: Dict[str, mx.array] = {}
    for name, w in tree_flatten(model.parameters()):
        weights[checkpoint_name(name, args.layout)] = w if "norm" in name else w * scale
    ids = draft_ids if draft_ids is not None else default_draft_ids(args.vocab_size, args.draft_vocab_size, seed)
    if len(ids) != args.draft_vocab_size:
        raise ValueError(f"draft_ids: {len(ids)} ids for draft_vocab_size {args.draft_vocab_size}")
    weights.update(vocab_maps(ids, args.vocab_size))
    out_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


def train(
    drafter_dir: Optional[Path], target_dir: Path, out_dir: Path, *, steps: int = 200, sequences: int = 32,
    length: int = 72, block: int = 8, lr: float = 3e-3, seed: int = 0, draft_vocab_size: Optional[int] = None,
    target_layers: Optional[List[int]] = None,
) -> Dict[str, float]:
    """Train a tiny drafter with the training core (``mlx-spec train-drafter --kind eagle3``'s) on
    its target's greedy continuations of 8-token prompts made from ``corpus(sequences, seed=seed + 1)``
    as ``(encode(text) * 8)[:8]``; from ``drafter_dir`` (``--init``) or new. Writes the checkpoint
    to ``out_dir``; returns the first and last losses."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from ...testing.tiny_models import corpus
    from ..training import TrainOptions
    from ..training import train as train_core

    tokenizer = load_tokenizer(Path(target_dir))
    prompts = [(tokenizer.encode(t, add_special_tokens=False) * 8)[:8] for t in corpus(sequences, seed=seed + 1)]
    options = TrainOptions(
        target=str(target_dir), kind="eagle3", out=str(out_dir), init=None if drafter_dir is None else str(drafter_dir),
        steps=steps, batch_size=min(16, sequences), seq_len=length, prompt_tokens=8, sequences=sequences,
        heldout_sequences=0, lr=lr, warmup=steps // 10, weight_decay=0.0, block_size=block, eval_every=0,
        checkpoint_every=0, log_every=steps, seed=seed, draft_vocab_size=draft_vocab_size, target_layers=target_layers,
    )
    result = train_core(options, log=lambda line: None, prompts=prompts)
    losses = result["losses"]
    return {"first_loss": losses[0], "last_loss": sum(losses[-10:]) / len(losses[-10:])}
