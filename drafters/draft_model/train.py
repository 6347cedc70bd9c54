"""Training draft LMs (``mlx-spec train-drafter --kind draft_model``): a small mlx-lm causal LM
distilled on the target's own continuations.

New drafters take the target's architecture and config at fewer layers (``--num-layers``); at the
target's width they start from the target's first layers, embedding, final norm and head (a
quantized target's dequantized), at another ``--hidden-size`` from random weights. ``--init``
starts from any mlx-lm checkpoint instead. Loss: cross-entropy on the target's tokens after the
prompt, plus ``--kl-weight`` x KL(target || drafter) on the same positions. The checkpoint is a
plain mlx-lm one (config.json, model.safetensors, the target's tokenizer files).
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any, Dict, List

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ...hooks.api import loading
from ..checkpoint import copy_tokenizer
from ..compat import config_value
from ..training.spec import Batch, FamilyTrainer, TrainOptions, TrainTarget
from . import DEFAULT_BLOCK_SIZE

DEFAULT_LAYERS = 2


def dense_parameters(model: nn.Module) -> Dict[str, mx.array]:
    """The model's parameters by name, quantized layers' weights dequantized."""
    params = dict(tree_flatten(model.parameters()))
    for name, module in model.named_modules():
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            prefix = f"{name}." if name else ""
            params[prefix + "weight"] = mx.dequantize(module.weight, module.scales, module.get("biases"),
                                                      module.group_size, module.bits, module.mode)
            for extra in ("scales", "biases"):
                params.pop(prefix + extra, None)
    return params


def _text(config: Dict[str, Any]) -> Dict[str, Any]:
    """Where the language model's fields live (``text_config`` for multimodal checkpoints)."""
    return config["text_config"] if isinstance(config.get("text_config"), dict) and "num_hidden_layers" not in config else config


def kept_layers(config: Dict[str, Any], num_layers: int) -> List[int]:
    """The target layers a drafter of ``num_layers`` layers keeps: the first ones, with the last
    layer of each type the first ones would lose in place of the last of them (e.g. gpt-oss's full
    attention after sliding ones: its caches need every type)."""
    text = _text(config)
    depth = int(text["num_hidden_layers"])
    keep = list(range(min(num_layers, depth)))
    for types in (v for k, v in text.items() if k.endswith("types") and isinstance(v, list) and len(v) == depth):
        missing = sorted(set(types) - {types[i] for i in keep}, key=types.index)
        if not missing:
            continue
        if len(set(types)) > len(keep):
            raise ValueError(f"--num-layers: got {num_layers}; allowed: at least {len(set(types))} for this target "
                             f"(one layer of each of its layer types: {', '.join(sorted(set(types)))})")
        last = [max(i for i, t in enumerate(types) if t == m) for m in missing]
        keep = sorted(keep[:len(keep) - len(missing)] + last)
    return keep


def shrink(config: Dict[str, Any], num_layers: int, hidden_size: Any) -> Dict[str, Any]:
    """The target's config at ``num_layers`` layers (per-layer lists cut as ``kept_layers``) and
    optionally another width."""
    keep = kept_layers(config, num_layers)
    config = copy.deepcopy(config)
    for key in ("quantization", "quantization_config"):
        config.pop(key, None)
    text = _text(config)
    depth = int(text["num_hidden_layers"])
    text["num_hidden_layers"] = len(keep)
    for k, v in list(text.items()):
        if k.endswith("types") and isinstance(v, list) and len(v) == depth:  # per-layer lists, e.g. layer_types
            text[k] = [v[i] for i in keep]
    if "max_window_layers" in text:
        text["max_window_layers"] = min(int(text["max_window_layers"]), num_layers)
    if hidden_size is not None and hidden_size != text.get("hidden_size"):
        old = int(text["hidden_size"])
        head_dim = int(text.get("head_dim") or old // int(text["num_attention_heads"]))
        if hidden_size % head_dim:
            raise ValueError(f"--hidden-size: got {hidden_size}; allowed: a multiple of the target's head_dim {head_dim}")
        heads = hidden_size // head_dim
        kv = int(text.get("num_key_value_heads") or text["num_attention_heads"])
        text.update(hidden_size=hidden_size, num_attention_heads=heads, head_dim=head_dim,
                    num_key_value_heads=max(d for d in range(1, min(kv, heads) + 1) if heads % d == 0))
        if "intermediate_size" in text:
            text["intermediate_size"] = max(1, int(text["intermediate_size"]) * hidden_size // old)
    return config


class DraftModelTrainer(FamilyTrainer):
    kind = "draft_model"
    default_block_size = DEFAULT_BLOCK_SIZE
    family_options = ("hidden_size", "kl_weight")

    @classmethod
    def check_options(cls, o: TrainOptions) -> None:
        super().check_options(o)
        if o.kl_weight is not None and not 0 <= o.kl_weight <= 1:
            raise ValueError(f"--kl-weight: got {o.kl_weight}; allowed: 0 to 1 (the KL term's share of the loss)")
        if o.hidden_size is not None and o.hidden_size < 1:
            raise ValueError(f"--hidden-size: got {o.hidden_size}; allowed: 1 or more")

    @property
    def needs_logits(self) -> bool:  # type: ignore[override]
        return bool(self.options.kl_weight)

    def build(self, target: TrainTarget) -> nn.Module:
        from mlx_lm.utils import _get_classes, dequantize_model, load_model

        o = self.options
        if o.init is not None:
            path = loading.resolve_path(o.init, "--init drafter")
            model, config = load_model(path)
            model = dequantize_model(model)
            config = shrink(config, int(_text(config)["num_hidden_layers"]), None)
        else:
            depth = o.num_layers or DEFAULT_LAYERS
            config = shrink(target.config, depth, o.hidden_size)
            model_class, args_class = _get_classes(config)
            model = model_class(args_class.from_dict(config))
            if o.hidden_size is None or o.hidden_size == config_value(target.config, "hidden_size"):
                keep = kept_layers(target.config, depth)
                source = dense_parameters(target.model)
                own = dict(tree_flatten(model.parameters()))
                from_target = {k: re.sub(r"\blayers\.(\d+)\.", lambda m: f"layers.{keep[int(m[1])]}.", k) for k in own}
                model.load_weights([(k, source[t]) for k, t in from_target.items()
                                    if t in source and source[t].shape == own[k].shape], strict=False)
        vocab = config_value(config, "vocab_size")
        if vocab != config_value(target.config, "vocab_size"):
            raise ValueError(f"vocab_size: the drafter has {vocab}, the target {config_value(target.config, 'vocab_size')}; they must be equal")
        model.set_dtype(mx.float32)
        self.config = config
        return model

    def _logits(self, model: nn.Module, batch: Batch) -> mx.array:
        return model(batch.tokens[:, :-1]).astype(mx.float32)  # [b, L-1, V]: position j predicts token j+1

    def loss(self, model: nn.Module, batch: Batch) -> mx.array:
        logits = self._logits(model, batch)[:, batch.first:]  # predictions of the target's own tokens
        labels = batch.tokens[:, batch.first + 1:]
        loss = nn.losses.cross_entropy(logits, labels).mean()
        w = self.options.kl_weight or 0.0
        if w:
            p_log = nn.log_softmax(batch.logits[:, batch.first:-1].astype(mx.float32), axis=-1)
            q_log = nn.log_softmax(logits, axis=-1)
            kl = (mx.exp(p_log) * (p_log - q_log)).sum(-1).mean()
            loss = (1 - w) * loss + w * kl
        return loss

    def draft(self, model: nn.Module, batch: Batch) -> mx.array:
        # Teacher-forced argmax at p .. p+B-2: while the drafts match the target's tokens, they are
        # exactly the drafter's own greedy chain from p, so the matched prefix (all tau counts) is the same.
        preds = mx.argmax(self._logits(model, batch), axis=-1)  # [b, L-1]
        b, n = batch.anchors.shape
        positions = (mx.array(batch.anchors, dtype=mx.int32)[..., None] + mx.arange(self.block_size - 1)).reshape(b, -1)
        return mx.take_along_axis(preds, positions, axis=1).reshape(b, n, -1)

    def anchors_per_forward(self, rows: int, vocab: int) -> int:
        return 1 << 30  # one forward over the sequences serves every anchor

    def save(self, model: nn.Module, out_dir: Path, target: TrainTarget, dtype: mx.Dtype) -> List[str]:
        config = copy.deepcopy(self.config)
        name = str(dtype).split(".")[-1]
        for key in ("torch_dtype", "dtype"):
            if key in _text(config) or key == "torch_dtype":
                _text(config)[key] = name
        weights = {k: v.astype(dtype) for k, v in tree_flatten(model.parameters())}
        mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
        (out_dir / "config.json").write_text(json.dumps(config, indent=1) + "\n")
        return ["config.json", "model.safetensors", *copy_tokenizer(target.path, out_dir)]

    def describe(self) -> str:
        t = _text(self.config)
        return f"draft_model ({t.get('model_type')}), {t['num_hidden_layers']} layer(s) of width {t['hidden_size']}, tau at block {self.block_size}"
