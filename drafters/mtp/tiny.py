"""Tiny MTP checkpoints with random weights in the real layouts (tests, demos, the bench).

- ``write_qwen_target``: a tiny Qwen3.5 (nested ``text_config``) or Qwen3-Next target in the Hugging
  Face layout (``model.language_model.*`` / ``model.*``, conv1d [C, 1, K], zero-centred norms,
  per-expert tensors), its ``mtp.*`` head inside its own shards (``model-0000i-of-0000n.safetensors``
  + ``model.safetensors.index.json``), as the published checkpoints ship it.
- ``split_qwen_head``: that head split out as mlx-vlm's ``split_mtp`` writes it (``qwen3_5_mtp``).
- ``write_plain_head``: a random head in that layout for a plain target (llama, qwen3, ...), as
  ``mlx-spec train-drafter --kind mtp`` writes it for one (``target_model_type``).
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional

import mlx.core as mx
from mlx.utils import tree_flatten

from ...testing import tiny_models as tm
from .qwen3_5_mtp import Model as QwenHead
from .qwen3_5_mtp import ModelArgs as QwenArgs
from .qwen3_5_mtp import text_config

QWEN3_5_TEXT = dict(
    model_type="qwen3_5_text", hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, vocab_size=384, rms_norm_eps=1e-6, linear_num_value_heads=4,
    linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
    full_attention_interval=2, tie_word_embeddings=False, mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1]},
)
HF_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight", ".q_norm.weight",
            ".k_norm.weight", "mtp.norm.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight")


def qwen3_5_config(**text: Any) -> Dict[str, Any]:
    """A Qwen3.5 (Qwen3_5ForConditionalGeneration) config.json with a tiny ``text_config``."""
    return {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
            "text_config": {**QWEN3_5_TEXT, **text}, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1}


def qwen3_next_config(**over: Any) -> Dict[str, Any]:
    return tm.qwen3_next_config(mtp_num_hidden_layers=1, **over)


def to_hf(weights: Dict[str, mx.array], config: Dict[str, Any]) -> Dict[str, mx.array]:
    """mlx-lm parameters of a Qwen3.5 / Qwen3-Next model (or head, ``mtp.``) -> Hugging Face's names and conventions."""
    out: Dict[str, mx.array] = {}
    fused = str(text_config(config).get("model_type", "")).startswith("qwen3_5_moe")
    for orig, v in weights.items():
        k = orig
        if k.startswith("language_model.model."):
            k = "model.language_model." + k[len("language_model.model."):]
        elif k.startswith("language_model."):
            k = k[len("language_model."):]
        if "conv1d.weight" in k:
            v = v.moveaxis(2, 1)  # [C, K, 1] -> [C, 1, K]
        if k.endswith(HF_NORMS) and v.ndim == 1:
            v = v - 1.0
        m = re.fullmatch(r"(.*)\.switch_mlp\.(gate_proj|up_proj|down_proj)\.weight", k)
        if m and fused:
            if m[2] == "gate_proj":
                out[f"{m[1]}.experts.gate_up_proj"] = mx.concatenate([v, weights[orig.replace("gate_proj", "up_proj")]], axis=-2)
            elif m[2] == "down_proj":
                out[f"{m[1]}.experts.down_proj"] = v
            continue
        if m:
            out.update({f"{m[1]}.experts.{e}.{m[2]}.weight": v[e] for e in range(v.shape[0])})
            continue
        out[k] = v
    return out


def head_tensors(config: Dict[str, Any], seed: int, scale: float = 1.0) -> Dict[str, mx.array]:
    """A random head for ``config``, as ``mtp.*`` tensors in the Hugging Face layout."""
    mx.random.seed(seed)
    head = QwenHead(QwenArgs.from_dict(config))
    params = {k: (v if k.endswith("norm.weight") else v * scale) for k, v in tree_flatten(head.parameters())}
    return to_hf({"mtp." + k: v for k, v in params.items()}, config)


def save_shards(out_dir: Path, weights: Dict[str, mx.array], shards: int, last: List[str], metadata: str = "pt") -> None:
    """``weights`` in ``shards`` files with an index; the names in ``last`` all in the last file."""
    names = [n for n in sorted(weights) if n not in last]
    per = -(-len(names) // max(1, shards - 1)) if shards > 1 else len(names)
    groups = [names[i:i + per] for i in range(0, len(names), per)] if shards > 1 else []
    groups = (groups + [[]] * shards)[: shards - 1] + [list(last) + ([] if shards > 1 else names)]
    weight_map = {}
    for i, group in enumerate(groups, start=1):
        name = f"model-{i:05d}-of-{shards:05d}.safetensors"
        mx.save_safetensors(str(out_dir / name), {n: weights[n] for n in group}, metadata={"format": metadata})
        weight_map.update({n: name for n in group})
    total = sum(v.nbytes for v in weights.values())
    (out_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))


def write_qwen_target(out_dir: Path, config: Dict[str, Any], *, seed: int = 0, tokenizer_dir: Optional[Path] = None,
                      head_seed: Optional[int] = None, head: bool = True, shards: int = 2, logit_scale: float = 3.0,
                      quiet_from: Optional[int] = None) -> Path:
    """A tiny Qwen3.5 / Qwen3-Next target in the Hugging Face layout, with its ``mtp.*`` head in its last shard.

    ``quiet_from``: the output projections of layers from that index are scaled by 0.05 (attention,
    GatedDeltaNet and MLP alike), so that the last tokens decide the next one: greedy text a small
    drafter can learn from a few thousand tokens (a fully random target's is chaotic)."""
    with tempfile.TemporaryDirectory() as tmp:
        made = tm.make_checkpoint(Path(tmp) / "t", config, seed=seed, tokenizer_dir=tokenizer_dir, logit_scale=logit_scale)
        raw = dict(mx.load(str(made / "model.safetensors")))
        if quiet_from is not None:
            outs = ("o_proj.weight", "out_proj.weight", "down_proj.weight")
            raw = {k: v * 0.05 if k.endswith(outs) and (tm.layer_index(k) or 0) >= quiet_from and "layers." in k else v
                   for k, v in raw.items()}
        weights = to_hf(raw, config)
        out_dir.mkdir(parents=True, exist_ok=True)
        for f in made.iterdir():
            if f.name != "model.safetensors":
                shutil.copy(f, out_dir / f.name)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    mtp = head_tensors(config, seed=seed + 1000 if head_seed is None else head_seed) if head else {}
    weights.update(mtp)
    save_shards(out_dir, weights, shards, sorted(mtp))
    return out_dir


def split_qwen_head(target_dir: Path, out_dir: Path, block_size: Optional[int] = None) -> Path:
    """The target's ``mtp.*`` head as a standalone drafter folder, as mlx-vlm's ``split_mtp`` writes
    it: the tensors without ``mtp.`` in mlx-lm's layout, ``model_type: qwen3_5_mtp``, the source's
    ``text_config``, ``block_size`` = depth + 2, the tokenizer files."""
    source = json.loads((target_dir / "config.json").read_text())
    text = text_config(source)
    index = json.loads((target_dir / "model.safetensors.index.json").read_text())["weight_map"]
    raw: Dict[str, mx.array] = {}
    for name, f in index.items():
        if name.startswith("mtp."):
            raw[name] = mx.load(str(target_dir / f))[name]
    weights = QwenHead.sanitize(raw, hf_layout=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    depth = int(text.get("mtp_num_hidden_layers", 1) or 1)
    config = {"block_size": int(block_size or depth + 2), "model_type": "qwen3_5_mtp", "text_config": copy.deepcopy(text),
              "tie_word_embeddings": bool(text.get("tie_word_embeddings", True))}
    (out_dir / "config.json").write_text(json.dumps(dict(sorted(config.items())), indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json"):
        if (target_dir / name).exists():
            shutil.copy(target_dir / name, out_dir / name)
    return out_dir


def write_plain_head(target_dir: Path, out_dir: Path, *, seed: int = 0, block_size: int = 4) -> Path:
    """A random Qwen3.5-style head for the plain target in ``target_dir`` (``qwen.plain_head_config``),
    the tensors in mlx-lm's layout, the target's tokenizer files."""
    from .qwen import plain_head_config

    config = plain_head_config(json.loads((target_dir / "config.json").read_text()), block_size)
    mx.random.seed(seed)
    weights = dict(tree_flatten(QwenHead(QwenArgs.from_dict(config)).parameters()))
    out_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in tm.TOKENIZER_FILES:
        if (target_dir / name).exists():
            shutil.copy(target_dir / name, out_dir / name)
    return out_dir


GEMMA4_TEXT = dict(
    model_type="gemma4_text", architectures=["Gemma4ForCausalLM"], hidden_size=64, intermediate_size=96,
    num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1, head_dim=16, global_head_dim=32,
    num_kv_shared_layers=2, sliding_window=8, vocab_size=384, vocab_size_per_layer_input=384,
    hidden_size_per_layer_input=8, rms_norm_eps=1e-6, final_logit_softcapping=30.0, use_double_wide_mlp=True,
    tie_word_embeddings=True, max_position_embeddings=4096, bos_token_id=0, eos_token_id=1, pad_token_id=2,
    layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
                 "full_attention"],
    rope_parameters={"full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
                     "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}},
    torch_dtype="float32",
)


def gemma4_text_config(**over: Any) -> Dict[str, Any]:
    """A tiny Gemma 4 text target (per-layer inputs, KV-shared layers, sliding windows), HF field names."""
    return {**copy.deepcopy(GEMMA4_TEXT), **over}


def assistant_config(real: Dict[str, Any], target: Dict[str, Any], *, ordered: bool = True, hidden: int = 32,
                     centroids: int = 24, top_k: int = 4, **text: Any) -> Dict[str, Any]:
    """``real`` (google/gemma-4-E2B-it-assistant's config.json) with tiny sizes for ``target``, same fields."""
    config = copy.deepcopy(real)
    t = config["text_config"]
    t.update(hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=4,
             num_key_value_heads=target["num_key_value_heads"], head_dim=target["head_dim"],
             global_head_dim=target["global_head_dim"], sliding_window=target["sliding_window"],
             vocab_size=target["vocab_size"], rope_parameters=copy.deepcopy(target["rope_parameters"]), dtype="float32")
    t.update(text)
    config.update(backbone_hidden_size=target["hidden_size"], use_ordered_embeddings=ordered, num_centroids=centroids,
                  centroid_intermediate_top_k=top_k, dtype="float32")
    for k in ("audio_token_id", "boa_token_id", "boi_token_id", "eoa_token_id", "eoi_token_id", "image_token_id"):
        config[k] = target["vocab_size"] - 1
    return config


def write_assistant(out_dir: Path, config: Dict[str, Any], seed: int = 0, tokenizer_dir: Optional[Path] = None) -> Path:
    """Random weights for a gemma4_assistant config under its tensor names (token_ordering int64, as HF stores it)."""
    from .gemma4_assistant import Model as Assistant
    from .gemma4_assistant import ModelArgs as AssistantArgs

    mx.random.seed(seed)
    model = Assistant(AssistantArgs.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    if config.get("use_ordered_embeddings"):
        vocab = config["text_config"]["vocab_size"]
        weights["masked_embedding.token_ordering"] = mx.random.permutation(vocab).astype(mx.int64)
    out_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in tm.TOKENIZER_FILES:
        if tokenizer_dir is not None and (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir


def write_gemma_target(out_dir: Path, config: Dict[str, Any], *, seed: int = 0, tokenizer_dir: Optional[Path] = None,
                       logit_scale: float = 3.0, quiet_from: Optional[int] = None) -> Path:
    """A tiny Gemma 4 text target (mlx-lm's layout). ``quiet_from``: layers from that index add
    little to the residual stream (their post-attention, post-feedforward and per-layer-input norms
    scaled by 0.05: Gemma normalises each block's output, so scaling its projections would not do),
    so that the next token depends mostly on the current one."""
    made = tm.make_checkpoint(out_dir, config, seed=seed, tokenizer_dir=tokenizer_dir, logit_scale=logit_scale)
    if quiet_from is None:
        return made
    norms = ("post_attention_layernorm.weight", "post_feedforward_layernorm.weight", "post_per_layer_input_norm.weight")
    weights = dict(mx.load(str(made / "model.safetensors")))
    weights = {k: v * 0.05 if k.endswith(norms) and (tm.layer_index(k) or 0) >= quiet_from else v for k, v in weights.items()}
    mx.save_safetensors(str(made / "model.safetensors"), weights, metadata={"format": "mlx"})
    return made


def deepseek_to_hf(weights: Dict[str, mx.array], config: Dict[str, Any]) -> Dict[str, mx.array]:
    """mlx-lm deepseek_v3 parameters -> Hugging Face's: experts one by one, ``kv_b_proj`` from mlx-lm's
    ``embed_q`` / ``unembed_out`` split of it."""
    out: Dict[str, mx.array] = {}
    for k, v in weights.items():
        m = re.fullmatch(r"(.*)\.mlp\.switch_mlp\.(gate_proj|up_proj|down_proj)\.weight", k)
        if m:
            out.update({f"{m[1]}.mlp.experts.{e}.{m[2]}.weight": v[e] for e in range(v.shape[0])})
        elif k.endswith(".self_attn.embed_q.weight"):
            base = k[: -len(".embed_q.weight")]
            wk, wv = v.swapaxes(-1, -2), weights[base + ".unembed_out.weight"]  # [h, nope, r], [h, v, r]
            merged = mx.concatenate([wk, wv], axis=1)
            out[base + ".kv_b_proj.weight"] = merged.reshape(-1, merged.shape[-1])
        elif not k.endswith(".self_attn.unembed_out.weight"):
            out[k] = v
    return out


def write_deepseek_target(out_dir: Path, config: Dict[str, Any], *, seed: int = 0, tokenizer_dir: Optional[Path] = None,
                          shards: int = 2, logit_scale: float = 3.0, nextn: bool = True) -> Path:
    """A tiny DeepSeek-V3 target in the Hugging Face layout with its nextn layer ``model.layers.{N}``
    (enorm, hnorm, eh_proj, the block, shared_head, its embedding copy) in its last shard."""
    from .deepseek_nextn import Model as NextN
    from .deepseek_nextn import ModelArgs as NextNArgs

    with tempfile.TemporaryDirectory() as tmp:
        made = tm.make_checkpoint(Path(tmp) / "t", config, seed=seed, tokenizer_dir=tokenizer_dir,
                                  logit_scale=logit_scale, quiet_layers_from=1)
        weights = deepseek_to_hf(dict(mx.load(str(made / "model.safetensors"))), config)
        out_dir.mkdir(parents=True, exist_ok=True)
        for f in made.iterdir():
            if f.name != "model.safetensors":
                shutil.copy(f, out_dir / f.name)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    layer: Dict[str, mx.array] = {}
    if nextn:
        mx.random.seed(seed + 1000)
        params = dict(tree_flatten(NextN(NextNArgs.from_dict(config)).parameters()))
        prefix = f"model.layers.{config['num_hidden_layers']}."
        block = deepseek_to_hf({"model.layers.0." + k[len("block."):]: v for k, v in params.items() if k.startswith("block.")}, config)
        layer = {prefix + k[len("model.layers.0."):]: v for k, v in block.items()}
        layer.update({prefix + k: v for k, v in params.items() if not k.startswith("block.")})
        layer[prefix + "embed_tokens.weight"] = weights["model.embed_tokens.weight"]
        layer[prefix + "shared_head.head.weight"] = weights["lm_head.weight"]
    weights.update(layer)
    save_shards(out_dir, weights, shards, sorted(layer))
    return out_dir
