"""The ``gemma4_assistant`` family: Google's Gemma 4 assistant checkpoints (their own repos).

config.json: ``model_type: gemma4_assistant``, ``backbone_hidden_size`` (the target's hidden size),
a nested ``text_config`` (``model_type: gemma4_text``: the assistant's own layers, their layer
types, head dims, RoPE and sliding window, which must be the target's), ``use_ordered_embeddings``
with ``num_centroids`` and ``centroid_intermediate_top_k`` (the sparse head of the E2B / E4B
assistants). Tensors: ``model.embed_tokens``, ``model.layers.N.*``, ``model.norm``,
``pre_projection``, ``post_projection``, ``masked_embedding.{centroids, token_ordering}``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional


from ..base import Compatibility, Drafter, DrafterError, DraftTarget
from ..checkpoint import load_into, read_tensors
from ..compat import check_tokenizer, config_value
from . import target as tg
from .assistant import AssistantDrafter, target_kv_layers
from .gemma4_assistant import Model, ModelArgs

FAMILY = "gemma4_assistant"
DEFAULT_BLOCK_SIZE = 4  # mlx-vlm's default for these assistants (3 draft tokens); the config has no depth


def detect(config: Dict[str, Any]) -> bool:
    return config.get("model_type") == "gemma4_assistant" or "Gemma4AssistantForCausalLM" in (config.get("architectures") or [])


def _target_text(config: Dict[str, Any]) -> Dict[str, Any]:
    text = config.get("text_config")
    return dict(text) if isinstance(text, dict) else dict(config)


def _target_args(config: Dict[str, Any]) -> Any:
    """The target's text args as mlx-lm builds them (its defaults for fields the config leaves out)."""
    from mlx_lm.models import gemma4_text

    return gemma4_text.ModelArgs.from_dict({**_target_text(config), "model_type": "gemma4_text"})


def check(path: Optional[Path], config: Dict[str, Any], target: DraftTarget) -> Compatibility:
    verdict = Compatibility()
    text = config.get("text_config")
    if not isinstance(text, dict):
        verdict.fail("text_config: missing; a gemma4_assistant config nests the assistant's layers in text_config")
        return verdict
    t = _target_text(target.config)
    t_type = str(t.get("model_type", target.config.get("model_type", "")))
    if t_type and not t_type.startswith("gemma4"):
        verdict.fail(f"target model_type: {t_type!r}; a Gemma 4 assistant reads the K/V of a gemma4 / gemma4_text target")
        return verdict
    t_hidden = config_value(target.config, "hidden_size")
    b = config.get("backbone_hidden_size")
    if t_hidden is not None and b != t_hidden:
        verdict.fail(f"backbone_hidden_size: the assistant has {b}, the target's hidden_size is {t_hidden}; they must be "
                     "equal (pre_projection reads the target's embedding and hidden state, post_projection writes one)")
    else:
        verdict.notes.append(f"backbone_hidden_size: {b} = the target's hidden_size")
    t_vocab = config_value(target.config, "vocab_size")
    if t_vocab is not None and text.get("vocab_size") != t_vocab:
        verdict.fail(f"text_config.vocab_size: the assistant has {text.get('vocab_size')}, the target {t_vocab}; they must be equal")
    else:
        verdict.notes.append(f"text_config.vocab_size: {t_vocab} on both")
    types = list(text.get("layer_types") or [])
    ta = _target_args(target.config)
    own = target_kv_layers(ta.layer_types, ta.num_kv_shared_layers)
    lacking = sorted(set(types) - set(own))
    if lacking:
        verdict.fail(f"text_config.layer_types: the assistant's layers need {sorted(set(types))}, but the target has no layer "
                     f"of type {lacking} with its own K/V (it has {sorted(own)})")
    else:
        verdict.notes.append("layer types: " + ", ".join(f"{k} reads the target's layer {own[k]}" for k in sorted(set(types))))
    checks = [("head_dim", "sliding_attention"), ("global_head_dim", "full_attention"), ("sliding_window", "sliding_attention")]
    for name, kind in checks:
        if kind in types and text.get(name) != getattr(ta, name):
            verdict.fail(f"text_config.{name}: the assistant has {text.get(name)}, the target {getattr(ta, name)}; its {kind} "
                         "queries attend over the target's keys, so they must be equal")
        elif kind in types:
            verdict.notes.append(f"text_config.{name}: {text.get(name)} on both")
    heads, kv = int(text.get("num_attention_heads", 1)), int(ta.num_key_value_heads or 1)
    if heads % kv:
        verdict.fail(f"text_config.num_attention_heads: {heads} is not a multiple of the target's num_key_value_heads {kv}")
    rope, t_rope = text.get("rope_parameters") or {}, ta.rope_parameters or {}
    for kind in sorted(set(types)):
        mine, theirs = (rope.get(kind) or {}).get("rope_theta"), (t_rope.get(kind) or {}).get("rope_theta")
        if mine is not None and theirs is not None and mine != theirs:
            verdict.fail(f"text_config.rope_parameters.{kind}.rope_theta: {mine} vs the target's {theirs}: the queries "
                         "must be rotated as the target rotated its keys")
    if config.get("use_ordered_embeddings"):
        n, k, v = int(config.get("num_centroids", 0)), int(config.get("centroid_intermediate_top_k", 0)), int(text.get("vocab_size", 0))
        if n <= 0 or v % n or not 0 < k <= n:
            verdict.fail(f"num_centroids / centroid_intermediate_top_k: {n} / {k}; the clusters must split vocab_size {v} "
                         "evenly and 0 < top_k <= num_centroids")
        else:
            verdict.notes.append(f"sparse head: {k} of {n} clusters of {v // n} tokens per step")
    if path is not None:
        heads = tg.headers(path)
        if heads and "pre_projection.weight" not in heads:
            verdict.fail(f"pre_projection.weight: not in {path}'s safetensors files; a gemma4_assistant needs it")
        elif heads:
            verdict.notes.append(f"pre_projection.weight: {list(heads['pre_projection.weight'].shape)}")
        check_tokenizer(target.path, path, verdict)
    return verdict


def load(path: Optional[Path], config: Dict[str, Any], target: DraftTarget, options: Dict[str, Any]) -> Drafter:
    if path is None:
        raise DrafterError("the gemma4_assistant family needs the assistant's checkpoint (speculative.draft_model)")
    if target.model is None:
        raise DrafterError("a Gemma 4 assistant reads the target's K/V and hidden states: load the target first")
    args = ModelArgs.from_dict(config)
    model = Model(args)
    load_into(model, model.sanitize(read_tensors(path)), config, path, "a gemma4_assistant of this config")
    ta = _target_args(target.config)
    kv = target_kv_layers(ta.layer_types, ta.num_kv_shared_layers)
    kv = {kind: kv[kind] for kind in set(model.layer_types)}
    block = int(args.block_size or DEFAULT_BLOCK_SIZE)
    return AssistantDrafter(model, tg.embedding(target.model), tg.final_norm(target.model), tg.last_layer(target.model),
                            kv, int(args.text_config.get("sliding_window") or 0), block)
