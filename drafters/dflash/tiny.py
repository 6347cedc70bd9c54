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

from .model import Model, ModelArgs, config_layout

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
    if layout == "dflash_config":
        config["dflash_config"]["target_layer_ids"] = list(target_layer_ids)
        config["dflash_config"]["mask_token_id"] = mask_token_id
        config["num_target_layers"] = num_target_layers
    elif layout == "speculators":
        config["aux_hidden_state_layer_ids"] = list(target_layer_ids)
        config["mask_token_id"] = mask_token_id
        config["draft_vocab_size"] = sizes["vocab_size"]
    else:
        config["target_layer_ids"] = list(target_layer_ids)
        config["mask_token_id"] = mask_token_id
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
    block: Optional[int] = None, lr: float = 3e-3, seed: int = 0, batch: int = 64,
) -> Dict[str, float]:
    """Train a tiny drafter on its target's own greedy continuations, in place.

    DFlash's objective: for an anchor position p, the block [token_p, mask x (B-1)] with the
    target's hidden states of positions < p as context predicts tokens p+1 .. p+B-1. Gives a
    drafter that really accepts (partially) on the tiny random targets. Returns the first and last
    losses.
    """
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx.utils import tree_flatten as flatten
    from mlx_lm import load as mlx_load

    from ...hooks import taps
    from ...hooks.tiny_models import corpus
    from . import target_embedding_and_head

    config = json.loads((drafter_dir / "config.json").read_text())
    args = ModelArgs.from_dict(config)
    model = Model(args)
    names = {v: k for k, v in tensor_names(args.layout, config).items()}
    raw = mx.load(str(drafter_dir / "model.safetensors"))
    model.load_weights(list(model.sanitize(raw).items()))
    target, tokenizer = mlx_load(str(target_dir))
    embed, head = target_embedding_and_head(target)
    layers = args.capture_layers
    taps.install_taps(target, layers)
    block = block or args.block_size

    # Data: prompts from the tokenizer's corpus, continued greedily by the target.
    rng = mx.random.key(seed)
    texts = corpus(sequences, seed=seed + 1)
    from mlx_lm.models.cache import make_prompt_cache

    prompts = [(tokenizer.encode(t, add_special_tokens=False) * 8)[:8] for t in texts]
    tokens = mx.array(prompts, dtype=mx.uint32)  # [N, 8]
    cache = make_prompt_cache(target)
    logits = target(tokens, cache=cache)
    for _ in range(length - tokens.shape[1]):
        nxt = mx.argmax(logits[:, -1], axis=-1)[:, None].astype(mx.uint32)  # [N, 1]
        tokens = mx.concatenate([tokens, nxt], axis=1)
        logits = target(nxt, cache=cache)
    # tokens: [N, length]
    with taps.record(layers) as rec:
        target(tokens)
    hidden = mx.concatenate([rec[i][0] for i in layers], axis=-1)  # [N, length, taps*H]
    mx.eval(tokens, hidden)

    def loss_fn(m: Model, rows: mx.array, p: int) -> mx.array:
        toks = tokens[rows]  # [n, length]
        ids = mx.concatenate([toks[:, p: p + 1], mx.full((toks.shape[0], block - 1), args.mask_token_id, mx.uint32)], axis=1)
        cache = m.make_cache()
        m.append_context(hidden[rows, :p], cache)
        h = m(embed(ids), cache)  # [n, B, H]
        logits = head(h[:, 1:]).astype(mx.float32)  # [n, B-1, V]
        return nn.losses.cross_entropy(logits, toks[:, p + 1: p + block]).mean()

    opt = optim.Adam(learning_rate=lr)
    step = nn.value_and_grad(model, loss_fn)
    losses = []
    for i in range(steps):
        rng, k1, k2 = mx.random.split(rng, 3)
        p = int(mx.random.randint(4, length - block, key=k1).item())
        rows = mx.random.randint(0, tokens.shape[0], (batch,), key=k2)
        loss, grads = step(model, rows, p)
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state, loss)
        losses.append(loss.item())
    weights = {}
    for name, w in flatten(model.parameters()):
        for new, old in names.items():
            if name.startswith(new):
                name = old + name[len(new):]
        weights[name] = w
    prefix = "model." if any(k.startswith("model.") for k in raw) else ""
    mx.save_safetensors(str(drafter_dir / "model.safetensors"), {prefix + k: v for k, v in weights.items()},
                        metadata={"format": "pt"})
    return {"first_loss": losses[0], "last_loss": sum(losses[-10:]) / 10}
