"""Training DFlash drafters (``mlx-spec train-drafter --kind dflash``): z-lab's objective.

For an anchor p (a round's pending token), the block [token_p, mask x (B-1)], with the target's
features of the positions before p as context, predicts the target's tokens p+1 .. p+B-1
(cross-entropy; optionally weighted exp(-(k-1)/gamma) at block position k, the DFlash paper's
Eq. 4). Many anchors per sequence run in one forward (``Model.blocks``). The features are
``features.target_features`` of the target's tapped layers: the code the decoding session reads.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ..base import DraftTarget
from ..compat import config_value
from ..training.spec import Batch, FamilyTrainer, TrainOptions, TrainTarget
from . import features
from .config import build_target_layer_ids, set_dflash_fields
from .model import Model, ModelArgs
from .tiny import tensor_names

DEFAULT_BLOCK_SIZE = 16
DEFAULT_LAYERS = 2
DEFAULT_ANCHORS = 32


def default_layer_ids(num_target_layers: int, taps: int) -> List[int]:
    """z-lab's spread over layers 1 .. N-3; evenly over all layers where that repeats a layer (small targets)."""
    ids = build_target_layer_ids(num_target_layers, taps)
    if len(set(ids)) == len(ids) and all(0 <= i < num_target_layers for i in ids):
        return ids
    return sorted({int(round(x)) for x in np.linspace(0, num_target_layers - 1, min(taps, num_target_layers))})


def default_mask_token_id(target: TrainTarget, vocab_size: int) -> int:
    """The first embedding row past the tokenizer's tokens (z-lab's choice: 151669 on Qwen3), else the last id."""
    tok = getattr(target.tokenizer, "_tokenizer", target.tokenizer)
    try:
        used = len(tok)
    except TypeError:
        used = int(getattr(tok, "vocab_size", vocab_size))
    return used if used < vocab_size else vocab_size - 1


def new_config(target: TrainTarget, num_layers: int, block_size: int, mask_token_id: int, layer_ids: List[int]) -> Dict[str, Any]:
    """A config.json in the layout of z-lab's Qwen3 b16 drafters, sized from the target's config
    (without ``auto_map`` and ``transformers_version``: no remote code and no transformers here)."""
    c = target.config
    value = lambda key, default=None: default if config_value(c, key) is None else config_value(c, key)  # noqa: E731
    hidden, heads = int(value("hidden_size")), int(value("num_attention_heads"))
    rope = value("rope_parameters", {}) or {}
    return {
        "architectures": ["DFlashDraftModel"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "block_size": block_size,
        "bos_token_id": value("bos_token_id"),
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": list(layer_ids)},
        "dtype": "float32",
        "eos_token_id": value("eos_token_id"),
        "head_dim": int(value("head_dim", hidden // heads)),
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": int(value("intermediate_size", 3 * hidden)),
        "layer_types": ["full_attention"] * num_layers,
        "max_position_embeddings": int(value("max_position_embeddings", 32768)),
        "max_window_layers": num_layers,
        "model_type": "qwen3",
        "num_attention_heads": heads,
        "num_hidden_layers": num_layers,
        "num_key_value_heads": int(value("num_key_value_heads", heads)),
        "num_target_layers": target.num_layers,
        "rms_norm_eps": float(value("rms_norm_eps", 1e-6)),
        "rope_scaling": value("rope_scaling"),
        "rope_theta": float(value("rope_theta", rope.get("rope_theta", 10000.0))),
        "sliding_window": None,
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": int(value("vocab_size")),
    }


class DFlashTrainer(FamilyTrainer):
    kind = "dflash"
    default_block_size = DEFAULT_BLOCK_SIZE
    family_options = ("target_layers", "mask_token_id", "anchors", "loss_decay_gamma")

    def __init__(self, options: TrainOptions):
        super().__init__(options)
        self.config: Dict[str, Any] = {}
        self.args: Optional[ModelArgs] = None
        self.extras: Dict[str, mx.array] = {}  # tensors of --init carried over untrained (e.g. speculators' d2t)
        self.prefix = ""

    @classmethod
    def check_options(cls, o: TrainOptions) -> None:
        super().check_options(o)
        if o.anchors is not None and o.anchors < 1:
            raise ValueError(f"--anchors: got {o.anchors}; allowed: 1 or more anchors per sequence")
        if o.loss_decay_gamma is not None and not o.loss_decay_gamma > 0:
            raise ValueError(f"--loss-decay-gamma: got {o.loss_decay_gamma}; allowed: above 0 (the paper: 7 at block 16, 5 at 10, 4 at 8)")
        if o.mask_token_id is not None and o.mask_token_id < 0:
            raise ValueError(f"--mask-token-id: got {o.mask_token_id}; allowed: a token id (0 or more)")
        if o.target_layers is not None:
            if not o.target_layers or min(o.target_layers) < 0 or len(set(o.target_layers)) != len(o.target_layers):
                raise ValueError(f"--target-layers: got {o.target_layers}; allowed: distinct decoder layer ids (0 or more)")
            if o.init is not None:
                raise ValueError("--target-layers: the layers come from --init's config.json; leave it out with --init")

    @property
    def block_size(self) -> int:
        if self.options.block_size:
            return int(self.options.block_size)
        return int(self.args.block_size) if self.args is not None else DEFAULT_BLOCK_SIZE

    def build(self, target: TrainTarget) -> nn.Module:
        from ..checkpoint import read_tensors
        from . import check, detect, target_embedding_and_head

        o = self.options
        vocab = int(config_value(target.config, "vocab_size"))
        if o.init is not None:
            path, config = self.init_checkpoint(detect, "is not a DFlash drafter (no dflash_config, DFlashDraftModel "
                                                        "or target_layer_ids)")
            raw = read_tensors(path)
            self.prefix = "model." if any(k.startswith("model.") for k in raw) else ""
        else:
            layers = o.target_layers or default_layer_ids(target.num_layers, o.num_layers or DEFAULT_LAYERS)
            mask = o.mask_token_id if o.mask_token_id is not None else default_mask_token_id(target, vocab)
            config = new_config(target, o.num_layers or DEFAULT_LAYERS, self.block_size, mask, layers)
            raw = None
        set_dflash_fields(config, block_size=o.block_size, mask_token_id=o.mask_token_id, num_target_layers=target.num_layers)
        # The family's own check, as `mlx-spec check` will run it on the written checkpoint.
        verdict = check(None, config, DraftTarget(config=target.config, path=target.path, num_layers=target.num_layers))
        if not verdict.ok:
            raise ValueError("the DFlash drafter would not fit the target: " + "; ".join(verdict.reasons))
        self.config, self.args = config, ModelArgs.from_dict(config)
        model = Model(self.args)
        if raw is not None:
            weights = model.sanitize(raw)
            model.load_weights(list(weights.items()), strict=True)
            names = self._names()
            self.extras = {k: v for k, v in raw.items() if self._strip(k, names) not in weights}
        model.set_dtype(mx.float32)
        self.embed, self.head = target_embedding_and_head(target.model)
        self.final_norm = features.final_norm_tap(target.model, self.args.capture_layers)
        gamma = o.loss_decay_gamma
        k = mx.arange(1, self.block_size, dtype=mx.float32)
        self.weights = mx.exp(-(k - 1) / gamma) if gamma else mx.ones_like(k)  # [B-1]
        return model

    def _names(self) -> Dict[str, str]:
        return tensor_names(self.args.layout, self.config)

    def _strip(self, name: str, names: Dict[str, str]) -> str:
        name = name[len(self.prefix):] if self.prefix and name.startswith(self.prefix) else name
        for ours, theirs in names.items():
            if name.startswith(theirs):
                return ours + name[len(theirs):]
        return name

    def capture_layers(self) -> List[int]:
        return list(self.args.capture_layers)

    def features(self, target: TrainTarget, captures: Dict[int, mx.array]) -> Optional[mx.array]:
        return features.target_features(captures, self.capture_layers(), self.final_norm).astype(mx.float32)

    def sample_anchors(self, rng: np.random.Generator, length: int, first: int, rows: int) -> Optional[np.ndarray]:
        valid = np.arange(first, length - self.block_size + 1)
        n = min(self.options.anchors or DEFAULT_ANCHORS, len(valid))
        return np.stack([np.sort(rng.choice(valid, n, replace=False)) for _ in range(rows)])  # [rows, n]

    def _forward(self, model: Model, batch: Batch) -> mx.array:
        """[b, n, B-1, V] logits of the block positions after each anchor."""
        anchors = mx.array(batch.anchors, dtype=mx.int32)  # [b, n]
        b, n = anchors.shape
        first = mx.take_along_axis(batch.tokens, anchors, axis=1)  # [b, n]
        masks = mx.full((b, n, self.block_size - 1), self.args.mask_token_id, dtype=batch.tokens.dtype)
        ids = mx.concatenate([first[..., None], masks], axis=-1)  # [b, n, B]
        context = batch.features[:, : int(batch.anchors.max())]  # [b, S, taps*H]: only positions before an anchor are read
        h = model.blocks(self.embed(ids).astype(mx.float32), context, anchors)  # [b, n, B, H]
        return self.head(h[:, :, 1:]).astype(mx.float32)

    def loss(self, model: nn.Module, batch: Batch) -> mx.array:
        logits = self._forward(model, batch)
        b, n, k, _ = logits.shape
        positions = (mx.array(batch.anchors, dtype=mx.int32)[..., None] + mx.arange(1, k + 1)).reshape(b, -1)
        labels = mx.take_along_axis(batch.tokens, positions, axis=1).reshape(b, n, k)  # the target's tokens p+1 ..
        ce = nn.losses.cross_entropy(logits, labels)  # [b, n, B-1]
        return (ce * self.weights).sum() / (self.weights.sum() * b * n)

    def draft(self, model: nn.Module, batch: Batch) -> mx.array:
        return mx.argmax(self._forward(model, batch), axis=-1)

    def save(self, model: nn.Module, out_dir: Path, target: TrainTarget, dtype: mx.Dtype) -> List[str]:
        config = copy.deepcopy(self.config)
        config["dtype"] = str(dtype).split(".")[-1]
        if "torch_dtype" in config:
            config["torch_dtype"] = config["dtype"]
        set_dflash_fields(config, block_size=self.block_size)
        names = self._names()
        weights = dict(self.extras)
        for name, w in tree_flatten(model.parameters()):
            for ours, theirs in names.items():
                if name.startswith(ours):
                    name = theirs + name[len(ours):]
            weights[self.prefix + name] = w.astype(dtype)
        mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "pt"})
        (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        return ["config.json", "model.safetensors"]

    def describe(self) -> str:
        a = self.args
        return (f"dflash drafter, {a.num_hidden_layers} layer(s), block size {self.block_size}, target layers "
                f"{a.target_layer_ids}, mask token {a.mask_token_id}")
