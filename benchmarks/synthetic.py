"""Synthetic targets and drafters built in memory (random weights, no 16 GB checkpoint on disk).

Random targets have near-tied logits, so greedy continuations flip on rounding noise (bf16 on a
GPU). ``build`` gives the target large logit margins: the output head row of token pi(t) is the
direction of t's embedding (pi a fixed random permutation), embeddings are scaled up to dominate
the residual stream and the layers' output projections are scaled down, so the final hidden state
stays close to the current token's embedding and its logit for pi(t) is ~sqrt(hidden) above the rest. Every layer still runs at full cost.
The continuation is then mostly a walk along pi: fine for measuring machinery, not text quality.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..hooks.api import Backend, draft_backend

SPECS: Dict[str, Dict[str, Any]] = {
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=128256, rope_theta=500000.0, dtype="bfloat16"),
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=64, vocab_size=128256, rope_theta=500000.0, dtype="bfloat16"),
    # float32: the CPU's BLAS-bound shape (MLX calls cblas_sgemm for float32 matmuls only; hooks/blas.py)
    "llama-150m": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=8, num_attention_heads=16,
                       num_key_value_heads=4, head_dim=64, vocab_size=32000, rope_theta=10000.0, dtype="float32"),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=384, rope_theta=10000.0, dtype="float32"),
}
QUIET = 0.1  # scale of o_proj / down_proj: keeps the residual stream near the token embedding


def config_for(spec: str, **over: Any) -> Dict[str, Any]:
    if spec not in SPECS:
        raise ValueError(f"--synthetic-target: got {spec!r}; allowed: {', '.join(SPECS)}")
    base = dict(SPECS[spec])
    config = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
        "torch_dtype": base.pop("dtype"),
    }
    config.update(base)
    config.update(over)
    return config


def build(config: Dict[str, Any], seed: int = 0, margins: bool = True) -> nn.Module:
    """An mlx-lm model for ``config`` with random weights in its dtype (large logit margins)."""
    from mlx_lm.utils import _get_classes

    mx.random.seed(seed)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    dtype = getattr(mx, config.get("torch_dtype", "float32"))
    if margins:
        vocab = config["vocab_size"]
        perm = mx.random.permutation(vocab)
        inv = mx.argsort(perm)
        embed = model.model.embed_tokens.weight  # rows of norm ~1
        unit = embed / mx.sqrt((embed * embed).sum(-1, keepdims=True))
        # Embeddings of norm 10 sqrt(hidden) dominate the residual stream (the quieted layers add
        # ~sqrt(2 layers) * O(1)); the head row pi(t) is t's direction: logit ~sqrt(hidden) for pi(t).
        updates = [("lm_head.weight", unit[inv]),
                   ("model.embed_tokens.weight", unit * (10.0 * config["hidden_size"] ** 0.5))]
        for name, w in tree_flatten(model.parameters()):
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                updates.append((name, w * QUIET))
        model.load_weights(updates, strict=False)
    model.set_dtype(dtype)
    # Evaluate layer by layer: the fp32 random init of one layer at a time stays small.
    for _, p in tree_flatten(model.parameters()):
        mx.eval(p)
    model.eval()
    return model


def dflash_drafter(target: nn.Module, config: Dict[str, Any], block_size: int = 16, layers: int = 5, seed: int = 1,
                   backend: Optional[Backend] = None) -> Tuple[Any, str]:
    """A DFlash-shape drafter (``layers`` layers, the target's width, target_layer_ids spread over
    the target) with random weights, borrowing the target's embedding and head; its caches and compiled calls
    are ``backend``'s (None: the host's default), as drafters.dflash.load makes them."""
    from ..drafters.dflash import DFlashDrafter
    from ..drafters.target_parts import target_embedding_and_head
    from ..drafters.dflash.model import Model, ModelArgs

    mx.random.seed(seed)
    args = ModelArgs.from_dict({
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": config["hidden_size"], "num_hidden_layers": layers,
        "intermediate_size": config["intermediate_size"], "num_attention_heads": config["num_attention_heads"],
        "num_key_value_heads": config["num_key_value_heads"], "head_dim": config.get("head_dim"),
        "vocab_size": config["vocab_size"], "rms_norm_eps": config["rms_norm_eps"],
        "rope_theta": config["rope_theta"], "block_size": block_size,
        "num_target_layers": config["num_hidden_layers"], "mask_token_id": config["vocab_size"] - 1,
        "max_position_embeddings": config.get("max_position_embeddings"),
    })
    model = Model(args)
    model.set_dtype(getattr(mx, config.get("torch_dtype", "float32")))
    for _, p in tree_flatten(model.parameters()):
        mx.eval(p)
    model.eval()
    embed, head = target_embedding_and_head(target)
    drafter = DFlashDrafter(model, embed, head, draft_backend(backend))
    return drafter, f"dflash ({layers} layers, width {config['hidden_size']}, target_layer_ids {list(args.target_layer_ids)})"


def eagle3_drafter(target: nn.Module, config: Dict[str, Any], draft_vocab: int = 32000, seed: int = 3,
                   backend: Optional[Backend] = None) -> Tuple[Any, str]:
    """An EAGLE-3-shape drafter (one layer at the target's width, fc over the default three layers,
    a ``draft_vocab`` head mapped through a random d2t) with random weights, borrowing the target's
    embedding."""
    from ..drafters.target_parts import target_embedding_and_head
    from ..drafters.eagle3 import Eagle3Drafter
    from ..drafters.eagle3.model import Model, ModelArgs
    from ..drafters.eagle3.tiny import default_draft_ids

    mx.random.seed(seed)
    vocab = config["vocab_size"]
    draft_vocab = min(draft_vocab, vocab)
    args = ModelArgs.from_dict({
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": config["hidden_size"],
        "num_hidden_layers": 1, "intermediate_size": config["intermediate_size"],
        "num_attention_heads": config["num_attention_heads"], "num_key_value_heads": config["num_key_value_heads"],
        "head_dim": config.get("head_dim"), "vocab_size": vocab, "draft_vocab_size": draft_vocab,
        "rms_norm_eps": config["rms_norm_eps"], "rope_theta": config["rope_theta"],
        "max_position_embeddings": config.get("max_position_embeddings"),
    })
    model = Model(args)
    model.set_dtype(getattr(mx, config.get("torch_dtype", "float32")))
    for _, p in tree_flatten(model.parameters()):
        mx.eval(p)
    model.eval()
    embed, _ = target_embedding_and_head(target)
    targets = mx.array(default_draft_ids(vocab, draft_vocab, seed), dtype=mx.uint32)
    capture = args.capture_layers(config["num_hidden_layers"])
    drafter = Eagle3Drafter(model, embed, targets, capture, draft_backend(backend))
    return drafter, (f"eagle3 (1 layer, width {config['hidden_size']}, draft vocabulary {draft_vocab}, target "
                     f"layers {capture} (hidden_states {args.layer_ids(config['num_hidden_layers'])}), chain drafting)")
