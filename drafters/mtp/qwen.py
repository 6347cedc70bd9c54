"""The ``qwen3_5_mtp`` family: the Qwen3.5 / Qwen3.6 / Qwen3-Next MTP head, in two layouts.

- Inside the target's own checkpoint (Hugging Face layout): ``mtp.*`` tensors next to the model's,
  ``text_config.mtp_num_hidden_layers`` (Qwen3.5) or ``mtp_num_hidden_layers`` (Qwen3-Next) >= 1.
  Name the checkpoint itself as the draft model. Only the ``mtp.*`` tensors are read, lazily.
  mlx-lm's ``convert`` drops them (its sanitize filters ``mtp.*``), so an mlx-lm conversion has
  none: the original checkpoint still serves as the draft model for a converted target.
- Standalone, as mlx-vlm's ``python -m mlx_vlm.split_mtp`` writes it: ``model_type: qwen3_5_mtp``,
  the source's ``text_config`` and ``block_size``, the tensors without ``mtp.`` in mlx-lm's layout
  (bf16 or quantized).

A Qwen3.5 checkpoint without ``mtp.*`` tensors that is not the target itself (e.g. a small Qwen3.5
as a plain draft LM for a large one) is handed to the ``draft_model`` family.

Plain attention targets (mlx-lm's ``llama``, ``qwen3``, ...: any decoder with ``embed_tokens``,
``norm`` and an lm_head) have no head of their own; ``mlx-spec train-drafter --kind mtp`` trains one
in the standalone layout (``plain_head_config``): a ``qwen3_5_text`` full-attention layer of the
target's width, heads, head_dim, MLP size, norm epsilon and RoPE (all dims rotated), and one more
top-level field, ``target_model_type`` (the target's model_type, e.g. ``"llama"``). Real Qwen
releases and mlx-vlm's split lack that field: it is optional, and a head without it needs a
qwen3_5 / qwen3_next target; a head with it needs a target of exactly that type.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional

from mlx.utils import tree_flatten

from ..base import Compatibility, Drafter, DrafterError, DraftTarget
from ..checkpoint import load_into
from ..compat import check_tokenizer, config_value
from . import target as tg
from .batch import HeadDrafter
from .qwen3_5_mtp import (QWEN3_5_TYPES, QWEN3_NEXT_TYPES, STANDALONE_TYPE, Model, ModelArgs, layer_family,
                          sanitized_names, text_config)

FAMILY = "qwen3_5_mtp"
TARGET_FIELD = "target_model_type"  # only in heads trained here for another type of target
SPLIT_HINT = ("split the head out of the original Hugging Face checkpoint with mlx-vlm "
              "(`python -m mlx_vlm.split_mtp --model <original> --output <folder>`, model_type qwen3_5_mtp) and "
              "pass that folder as the draft model, or pass the original checkpoint itself as the draft model")

IN_TARGET = ("Qwen3.5 / Qwen3.6 / Qwen3-Next: (text_config.)mtp_num_hidden_layers >= 1 and the mtp.* tensors in "
             "its safetensors (mlx-lm's convert drops them: " + SPLIT_HINT + "; a plain target (llama, qwen3, ...) "
             "gets a head from `mlx-spec train-drafter --kind mtp`)")


def is_standalone(config: Dict[str, Any]) -> bool:
    return config.get("model_type") == STANDALONE_TYPE


def detect(config: Dict[str, Any]) -> bool:
    if is_standalone(config):
        return True
    text = text_config(config)
    return str(text.get("model_type")) in QWEN3_5_TYPES + QWEN3_NEXT_TYPES and int(text.get("mtp_num_hidden_layers") or 0) >= 1


def target_type(config: Dict[str, Any]) -> str:
    """A target's model_type: its ``text_config``'s (multimodal checkpoints, Qwen3.5) or its own."""
    return str(text_config(config).get("model_type", ""))


def plain_head_config(target: Dict[str, Any], block_size: int) -> Dict[str, Any]:
    """A new head for a plain attention target (llama, qwen3, ...), in the standalone layout: one
    full-attention qwen3_5 layer (gated attention, q/k norms) of the target's sizes, RoPE over every
    dim with the target's theta and scaling, ``target_model_type`` naming what it was trained for."""
    t = text_config(target)
    hidden, heads = int(t["hidden_size"]), int(t["num_attention_heads"])
    rope = dict(t.get("rope_parameters") or t.get("rope_scaling") or {})
    if isinstance(rope.get("full_attention"), dict):  # per layer type (Gemma 3 style): the full layers'
        rope = dict(rope["full_attention"])
    kind = rope.pop("type", None) or rope.pop("rope_type", None) or "default"
    rope = {"rope_type": kind, **rope, "rope_theta": float(rope.get("rope_theta", t.get("rope_theta", 10000.0))),
            "partial_rotary_factor": float(rope.get("partial_rotary_factor", t.get("partial_rotary_factor", 1.0)))}
    text = {"model_type": "qwen3_5_text", "hidden_size": hidden,
            "intermediate_size": int(t.get("intermediate_size") or 4 * hidden), "num_hidden_layers": 1,
            "num_attention_heads": heads, "num_key_value_heads": int(t.get("num_key_value_heads") or heads),
            "head_dim": int(t.get("head_dim") or hidden // heads), "vocab_size": int(t["vocab_size"]),
            "rms_norm_eps": float(t.get("rms_norm_eps", 1e-6)), "rope_parameters": rope,
            "max_position_embeddings": int(t.get("max_position_embeddings") or 131072), "attention_bias": False,
            "full_attention_interval": 1, "layer_types": ["full_attention"], "mtp_num_hidden_layers": 1,
            "tie_word_embeddings": bool(t.get("tie_word_embeddings", target.get("tie_word_embeddings", False)))}
    return {"block_size": int(block_size), "model_type": STANDALONE_TYPE, TARGET_FIELD: target_type(target),
            "text_config": text, "tie_word_embeddings": text["tie_word_embeddings"]}


def _mtp_names(path: Optional[Path], standalone: bool) -> List[str]:
    heads = tg.headers(path)
    return list(heads) if standalone else [n for n in heads if n.startswith("mtp.")]


def _plain_lm(path: Optional[Path], config: Dict[str, Any], target: DraftTarget) -> bool:
    """A Qwen checkpoint with no head, other than the target: a plain draft LM."""
    return (not is_standalone(config) and path is not None and bool(tg.headers(path))
            and not _mtp_names(path, False) and not tg.same_dir(path, target.path))


def _draft_model_family() -> Any:
    from ..draft_model import family

    return family


def expected_names(args: ModelArgs) -> List[str]:
    return [k for k, _ in tree_flatten(Model(args).parameters())]


def check(path: Optional[Path], config: Dict[str, Any], target: DraftTarget) -> Compatibility:
    if _plain_lm(path, config, target):
        verdict = _draft_model_family().check(path, config, target)
        verdict.notes.insert(0, "no mtp.* tensors and not the target: checked as a plain draft LM (family draft_model)")
        return verdict
    verdict = Compatibility()
    standalone = is_standalone(config)
    text = text_config(config)
    where = "text_config." if isinstance(config.get("text_config"), dict) else ""
    verdict.notes.append(f"layout: {'standalone (mlx-vlm split_mtp)' if standalone else 'mtp.* inside the target checkpoint'}")
    try:
        family = layer_family(text)
    except ValueError as e:
        verdict.fail(str(e))
        return verdict
    depth = int(text.get("mtp_num_hidden_layers") or 1)
    if depth != 1:
        verdict.fail(f"{where}mtp_num_hidden_layers: {depth}; supported: 1 (every published Qwen3.5/3.6/Qwen3-Next head; "
                     "a larger block applies it recursively)")
    else:
        verdict.notes.append(f"{where}mtp_num_hidden_layers: 1 (one full-attention layer of the {family} kind, its own KV cache)")
    t_type = target_type(target.config)
    trained_for = config.get(TARGET_FIELD)
    if trained_for:
        if t_type and t_type != trained_for:
            verdict.fail(f"target model_type: {t_type!r}; this head was trained for a {trained_for!r} target "
                         f"({TARGET_FIELD}: {trained_for!r}); allowed: {trained_for} (train one for this target with "
                         "`mlx-spec train-drafter --kind mtp`)")
        else:
            verdict.notes.append(f"{TARGET_FIELD}: {trained_for!r}, the target's model_type")
    else:
        allowed = QWEN3_NEXT_TYPES if family == "qwen3_next" else QWEN3_5_TYPES
        if t_type and t_type not in allowed:
            verdict.fail(f"target model_type: {t_type!r}; a {family} MTP head needs a target of type {', '.join(allowed)} "
                         f"(or, trained by `mlx-spec train-drafter --kind mtp` for another type, {TARGET_FIELD} in its "
                         "config.json naming that type)")
    for name in ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
        d, t = text.get(name), config_value(target.config, name)
        if d is not None and t is not None and d != t:
            verdict.fail(f"{where}{name}: the head has {d}, the target has {t}; they must be equal "
                         "(the head is made for its own target: it reads its hidden states, embedding and lm_head)")
        elif d is not None:
            verdict.notes.append(f"{where}{name}: {d} on both")
    if path is None:
        return verdict
    names = _mtp_names(path, standalone)
    if not names and tg.headers(path):
        verdict.fail(f"mtp.*: none in {path}'s safetensors files; mlx-lm's convert drops them (its sanitize filters "
                     f"mtp.*), so an mlx-lm conversion has no head: {SPLIT_HINT}")
        return verdict
    if names and verdict.ok:
        got = sanitized_names(names)
        prefix = "" if standalone else "mtp."
        lost = [prefix + n for n in tg.missing(expected_names(ModelArgs(text)), got)
                if not (n.endswith((".scales", ".biases")))]
        if lost:
            verdict.fail(f"{prefix or 'head '}tensors missing from {path}: {', '.join(lost[:6])}"
                         f"{f' and {len(lost) - 6} more' if len(lost) > 6 else ''}")
        else:
            fc = tg.headers(path).get(f"{prefix}fc.weight")
            verdict.notes.append(f"{prefix}*: {len(names)} tensors, all the head needs"
                                 + (f"; {prefix}fc.weight {list(fc.shape)}" if fc is not None else ""))
    if standalone:
        check_tokenizer(target.path, path, verdict)
    return verdict


def load(path: Optional[Path], config: Dict[str, Any], target: DraftTarget, options: Dict[str, Any]) -> Drafter:
    if _plain_lm(path, config, target):
        return _draft_model_family().load(path, config, target, options)
    if path is None:
        raise DrafterError("the qwen3_5_mtp family needs a checkpoint: the target's own (mtp.* inside) or a split head")
    if target.model is None:
        raise DrafterError("MTP heads use the target's embedding, lm_head and hidden states: load the target first")
    standalone = is_standalone(config)
    args = ModelArgs.from_dict(config)
    names = _mtp_names(path, standalone)
    raw = tg.read_tensors(path, names)
    hf = not standalone and tg.file_format(next(iter({tg.headers(path)[n].file for n in names}))) != "mlx"
    weights = Model.sanitize(raw, hf_layout=hf)
    model = Model(args)
    load_into(model, weights, config, path, f"a {layer_family(args.text)} MTP head")
    head = tg.lm_head(target.model)
    block = int(args.block_size) if standalone and args.block_size else args.depth + 1
    return HeadDrafter(FAMILY, model, tg.embedding(target.model), head, tg.final_norm(target.model),
                       tg.last_layer(target.model), block, target.backend)
