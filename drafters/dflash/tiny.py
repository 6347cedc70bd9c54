"""Tiny DFlash checkpoints with random weights, written in the real formats (tests, demos).

``shrink_config`` keeps a real config.json's layout and field names and replaces its sizes;
``write_checkpoint`` saves random weights under that format's tensor names.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Dict, List, Optional

import mlx.core as mx
from mlx.utils import tree_flatten

from .config import config_layout, set_dflash_fields
from .model import Model, ModelArgs

TINY = {
    "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "num_hidden_layers": 2, "vocab_size": 384,
}


def shrink_config(
    real: Dict[str, Any], *, target_layer_ids: List[int], mask_token_id: int, num_target_layers: int,
    sliding_window: Optional[int] = 8, **over: Any,
) -> Dict[str, Any]:
    """``real`` with tiny sizes, in the same places and under the same names."""
    config = copy.deepcopy(real)
    layout = config_layout(config)
    geometry = config["transformer_layer_config"] if layout == "speculators" else config
    sizes = dict(TINY, **{k: v for k, v in over.items() if k in TINY})
    for k, v in sizes.items():
        if k in geometry or k in ("hidden_size", "num_hidden_layers"):
            geometry[k] = v
    n = sizes["num_hidden_layers"]
    if "layer_types" in geometry:
        types = geometry["layer_types"]
        # Keep the pattern's ends (e.g. sliding ... full) at the new depth.
        geometry["layer_types"] = (types[: n - 1] + types[-1:]) if n > 1 else types[-1:]
    if "max_window_layers" in geometry:
        geometry["max_window_layers"] = n
    if geometry.get("sliding_window") is not None and sliding_window is not None:
        geometry["sliding_window"] = sliding_window
    set_dflash_fields(config, target_layer_ids=target_layer_ids, mask_token_id=mask_token_id,
                      num_target_layers=num_target_layers, block_size=over.pop("block_size", None))
    if layout == "speculators":
        config["draft_vocab_size"] = sizes["vocab_size"]
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if config.get(k) is not None:
            config[k] = min(int(config[k]), sizes["vocab_size"] - 1) if k != "pad_token_id" else None
    config["dtype"] = "float32"
    for k, v in over.items():
        if k not in TINY:
            config[k] = v
    return config


def tensor_names(layout: str, config: Dict[str, Any]) -> Dict[str, str]:
    """mlx parameter name prefix -> the format's tensor name prefix."""
    archs = config.get("architectures") or []
    if "MuseGlimmerAssistantModel" in archs:
        return {"fc.": "encoder.fc.", "hidden_norm.": "encoder.output_norm_enc."}
    return {}


def write_checkpoint(
    out_dir: Path, config: Dict[str, Any], seed: int = 0, prefix: str = "", scale: float = 1.0,
) -> Path:
    """Random weights for ``config`` saved under its format's tensor names (``prefix``: e.g. "model.")."""
    mx.random.seed(seed)
    args = ModelArgs.from_dict(config)
    model = Model(args)
    renames = tensor_names(args.layout, config)
    weights = {}
    for name, w in tree_flatten(model.parameters()):
        if not name.endswith("norm.weight"):
            w = w * scale
        for old, new in renames.items():
            if name.startswith(old):
                name = new + name[len(old):]
        weights[prefix + name] = w
    if args.layout == "speculators":
        # speculators exports carry the (frozen, verifier-initialised) head and vocabulary maps.
        v = config["draft_vocab_size"]
        weights["lm_head.weight"] = mx.random.normal((v, args.hidden_size)) * 0.02
        weights["d2t"] = mx.zeros((v,), dtype=mx.int64)
        weights["t2d"] = mx.ones((args.vocab_size,), dtype=mx.bool_)
    out_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


def train(
    drafter_dir: Path, target_dir: Path, steps: int = 300, sequences: int = 48, length: int = 72,
    block: Optional[int] = None, lr: float = 3e-3, seed: int = 0, batch: int = 64, anchors: int = 4,
) -> Dict[str, float]:
    """Train a tiny drafter in place, with the training core (``mlx-spec train-drafter``'s), on its
    target's greedy continuations of 8-token prompts made from ``corpus(sequences, seed=seed + 1)``
    as ``(encode(text) * 8)[:8]`` (tests and benchmarks prompt with the same). Gives a drafter that
    really accepts (partially) on the tiny random targets. Returns the first and last losses.
    """
    import shutil
    import tempfile

    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from ...testing.tiny_models import corpus
    from ..training import TrainOptions
    from ..training import train as train_core

    tokenizer = load_tokenizer(Path(target_dir))
    prompts = [(tokenizer.encode(t, add_special_tokens=False) * 8)[:8] for t in corpus(sequences, seed=seed + 1)]
    with tempfile.TemporaryDirectory() as tmp:
        options = TrainOptions(
            target=str(target_dir), kind="dflash", out=str(Path(tmp) / "run"), init=str(drafter_dir), steps=steps,
            batch_size=min(batch, sequences), seq_len=length, prompt_tokens=8, sequences=sequences,
            heldout_sequences=0, lr=lr, warmup=0, weight_decay=0.0, block_size=block, anchors=anchors,
            eval_every=0, checkpoint_every=0, log_every=steps, seed=seed,
        )
        result = train_core(options, log=lambda line: None, prompts=prompts)
        for name in ("config.json", "model.safetensors"):
            shutil.copy(Path(tmp) / "run" / name, Path(drafter_dir) / name)
    losses = result["losses"]
    return {"first_loss": losses[0], "last_loss": sum(losses[-10:]) / len(losses[-10:])}
