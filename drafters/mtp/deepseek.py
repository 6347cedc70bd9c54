"""The ``deepseek_nextn`` family: DeepSeek-V3's multi-token-prediction layer inside the target checkpoint.

config.json: ``model_type: deepseek_v3`` with ``num_nextn_predict_layers`` >= 1; the layer's tensors
are ``model.layers.{num_hidden_layers}.*`` in the target's shards. Name the checkpoint itself as the
draft model: only those tensors are read, lazily (the host loads the target without them:
``hooks.loading.load_target``). mlx-lm's ``convert`` drops ``model.layers.61`` (the nextn layer of
the 61-layer model), so a conversion has none. A DeepSeek checkpoint without the layer that is not
the target itself is handed to the ``draft_model`` family.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional

import mlx.core as mx

from ..base import Compatibility, Drafter, DrafterError, DraftTarget
from ..compat import config_value
from . import target as tg
from .batch import HeadDrafter
from .deepseek_nextn import OWN, SKIPPED, Model, ModelArgs, layer_prefix

FAMILY = "deepseek_nextn"
TYPES = ("deepseek_v3",)
REQUIRED = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "shared_head.head.weight",
            "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.kv_a_proj_with_mqa.weight", "self_attn.o_proj.weight")
IN_TARGET = ("DeepSeek-V3: num_nextn_predict_layers >= 1 and the nextn layer's model.layers.{num_hidden_layers}.* "
             "tensors in its safetensors (mlx-lm's convert drops them: pass the original checkpoint as the draft model)")


def detect(config: Dict[str, Any]) -> bool:
    return config.get("model_type") in TYPES and int(config.get("num_nextn_predict_layers") or 0) >= 1


def _names(path: Optional[Path], config: Dict[str, Any]) -> list:
    prefix = layer_prefix(config)
    return [n for n in tg.headers(path) if n.startswith(prefix)]


def _plain_lm(path: Optional[Path], config: Dict[str, Any], target: DraftTarget) -> bool:
    return path is not None and bool(tg.headers(path)) and not _names(path, config) and not tg.same_dir(path, target.path)


def _draft_model_family() -> Any:
    from ..draft_model import family

    return family


def check(path: Optional[Path], config: Dict[str, Any], target: DraftTarget) -> Compatibility:
    if _plain_lm(path, config, target):
        verdict = _draft_model_family().check(path, config, target)
        verdict.notes.insert(0, "no nextn layer tensors and not the target: checked as a plain draft LM (family draft_model)")
        return verdict
    verdict = Compatibility()
    n = int(config.get("num_nextn_predict_layers") or 0)
    if n != 1:
        verdict.fail(f"num_nextn_predict_layers: {n}; supported: 1 (DeepSeek-V3/R1's; a larger block applies it recursively)")
    else:
        verdict.notes.append(f"num_nextn_predict_layers: 1 -> tensors {layer_prefix(config)}*")
    if target.config.get("model_type") not in TYPES:
        verdict.fail(f"target model_type: {target.config.get('model_type')!r}; a DeepSeek nextn layer needs a {', '.join(TYPES)} target")
    for name in ("hidden_size", "vocab_size", "num_hidden_layers", "kv_lora_rank", "qk_rope_head_dim", "num_attention_heads"):
        d, t = config.get(name), config_value(target.config, name)
        if d is not None and t is not None and d != t:
            verdict.fail(f"{name}: the checkpoint has {d}, the target {t}; the nextn layer is made for its own target")
        elif d is not None:
            verdict.notes.append(f"{name}: {d} on both")
    if path is None or not verdict.ok:
        return verdict
    names = _names(path, config)
    if not names and tg.headers(path):
        verdict.fail(f"{layer_prefix(config)}*: none in {path}'s safetensors files; mlx-lm's convert drops the nextn "
                     "layer (its sanitize filters model.layers.61): pass the original checkpoint as the draft model")
        return verdict
    prefix = layer_prefix(config)
    lost = tg.missing([prefix + r for r in REQUIRED], names)
    if lost:
        verdict.fail(f"nextn layer tensors missing from {path}: {', '.join(lost)}")
    else:
        head = tg.headers(path)[prefix + "eh_proj.weight"]
        verdict.notes.append(f"{prefix}*: {len(names)} tensors; eh_proj.weight {list(head.shape)}")
    return verdict


def load(path: Optional[Path], config: Dict[str, Any], target: DraftTarget, options: Dict[str, Any]) -> Drafter:
    if _plain_lm(path, config, target):
        return _draft_model_family().load(path, config, target, options)
    if path is None or target.model is None:
        raise DrafterError("deepseek_nextn: name the target checkpoint (its nextn layer) as the draft model; load the target first")
    prefix = layer_prefix(config)
    names = [n for n in _names(path, config) if not n[len(prefix):].startswith(SKIPPED)]
    sanitize = getattr(target.model, "sanitize", None)
    if sanitize is None:
        raise DrafterError(f"{type(target.model).__name__} has no sanitize to convert the nextn layer's tensors with")
    weights = Model.parameters_from(sanitize(Model.rename(tg.read_tensors(path, names), prefix)))
    model = Model(ModelArgs.from_dict(config))
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise DrafterError(f"draft model {str(path)!r}: the nextn layer's tensors do not match: {e}") from e
    model.set_dtype(next(v.dtype for k, v in weights.items() if k.startswith(OWN)))
    mx.eval(model.parameters())
    model.eval()
    # mlx-lm's KVCache for the MLA block (its attention takes boolean masks only; no padded caches).
    return HeadDrafter(FAMILY, model, tg.embedding(target.model), model.logits, tg.final_norm(target.model),
                       tg.last_layer(target.model), int(config.get("num_nextn_predict_layers") or 1) + 1, None)
