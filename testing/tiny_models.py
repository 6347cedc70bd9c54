"""Tiny real mlx-lm checkpoints with random weights, made locally (tests, benchmarks).

Each checkpoint is what ``mlx_lm.load`` reads: config.json, model.safetensors and a byte-level
BPE tokenizer trained here with ``tokenizers``. Nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, Dict, Optional

import mlx.core as mx
from mlx.utils import tree_flatten

from ..hooks.api import knobs

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_WORDS = (
    "the a model token draft verify accept commit cache layer block round target fast slow small "
    "large text speed decode prefill sample greedy window state hidden head query key value tree "
    "river stone light night day code test plan build run step loop time space word line page book "
    "red green blue one two three four five six seven eight nine ten and or but if then else when"
).split()


def corpus(n_lines: int = 400, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
        lines.append(" ".join(words) + rng.choice([".", "!", "?", ","]))
    return lines


def train_tokenizer(out_dir: Path, vocab_size: int = 384) -> None:
    """A byte-level BPE tokenizer with <s>, </s> and a chat template, saved for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": 4096, "chat_template": CHAT_TEMPLATE,
    }, indent=1))
    (out_dir / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))


def llama_config(**over: Any) -> Dict[str, Any]:
    config = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "vocab_size": 384, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "float32",
    }
    config.update(over)
    return config


def qwen3_config(**over: Any) -> Dict[str, Any]:
    config = llama_config(model_type="qwen3", architectures=["Qwen3ForCausalLM"], tie_word_embeddings=True)
    config.update(over)
    return config


def build_model(config: Dict[str, Any]):
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    return model_class(args_class.from_dict(config))


def save_checkpoint(model, config: Dict[str, Any], out_dir: Path, tokenizer_dir: Optional[Path]) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=1))
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            if (tokenizer_dir / name).exists():
                shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir


def layer_index(name: str) -> Optional[int]:
    """The layer number in a weight name (``model.layers.3.mlp...`` -> 3), or None."""
    parts = name.split(".")
    if "layers" in parts:
        i = parts.index("layers") + 1
        if i < len(parts) and parts[i].isdigit():
            return int(parts[i])
    return None


def make_checkpoint(
    out_dir: Path, config: Dict[str, Any], seed: int = 0, tokenizer_dir: Optional[Path] = None,
    logit_scale: float = 1.0, quiet_layers_from: Optional[int] = None, quiet_scale: float = 0.05,
) -> Path:
    """Random weights for ``config``'s architecture, written as an mlx-lm checkpoint.

    ``logit_scale`` multiplies the output head (the final norm for tied embeddings) so that logits
    have large margins; greedy continuations then survive the rounding differences between
    one-token and multi-token forwards. ``quiet_layers_from`` scales the output projections of
    the layers from that index by ``quiet_scale``: the first layers then decide most tokens, so a
    drafter cut from them (``make_truncated_drafter``) agrees often but not always.
    """
    mx.random.seed(seed)
    model = build_model(config)
    params = dict(tree_flatten(model.parameters()))
    scaled = {}
    for name, w in params.items():
        if logit_scale != 1.0 and (name.endswith("lm_head.weight") or (
            config.get("tie_word_embeddings") and name.endswith("norm.weight") and "layers" not in name
        )):
            scaled[name] = w * logit_scale
        layer = layer_index(name)
        if quiet_layers_from is not None and layer is not None and layer >= quiet_layers_from and (
            name.endswith(("o_proj.weight", "down_proj.weight"))
        ):
            scaled[name] = w * quiet_scale
    if scaled:
        model.load_weights(list(scaled.items()), strict=False)
    mx.eval(model.parameters())
    if tokenizer_dir is None:
        tokenizer_dir = out_dir / "_tokenizer"
        train_tokenizer(tokenizer_dir, vocab_size=min(config.get("vocab_size", 384), 384))
        save_checkpoint(model, config, out_dir, tokenizer_dir)
        shutil.rmtree(tokenizer_dir)
        return out_dir
    return save_checkpoint(model, config, out_dir, tokenizer_dir)


def make_truncated_drafter(target_dir: Path, out_dir: Path, num_layers: int) -> Path:
    """A draft LM made of the target's first ``num_layers`` layers plus its embedding and head.

    It agrees with the target often but not always, which gives partial acceptance.
    """
    config = json.loads((target_dir / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    weights = mx.load(str(target_dir / "model.safetensors"))
    kept = {}
    for name, w in weights.items():
        layer = layer_index(name)
        if layer is None or layer < num_layers:
            kept[name] = w
    out_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out_dir / "model.safetensors"), kept, metadata={"format": "mlx"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=1))
    for name in TOKENIZER_FILES:
        if (target_dir / name).exists():
            shutil.copy(target_dir / name, out_dir / name)
    return out_dir


def random_pair_dir() -> Path:
    return Path(knobs.cache_root()) / "random-pair"  # runtime.cache_dir / $MLX_SPEC_CACHE


def ensure_random_pair(announce=print) -> tuple[Path, Path]:
    """A tiny random llama target and a 2-layer drafter cut from it (benchmarks of the host's own
    costs); made on first use and cached (``$MLX_SPEC_CACHE`` or ~/.cache/mlx-speculative). The
    embedded demo (demo/) is a trained pair; this one's text is gibberish.
    """
    root = random_pair_dir()
    target, drafter = root / "target", root / "drafter"
    if not (target / "model.safetensors").exists() or not (drafter / "model.safetensors").exists():
        announce(f"[mlx-spec] making a tiny random pair (once; random weights): target {target}, drafter {drafter}")
        tmp = root.with_name(f"{root.name}.tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        make_checkpoint(
            tmp / "target", llama_config(num_hidden_layers=4, hidden_size=128, intermediate_size=256),
            seed=7, logit_scale=4.0, quiet_layers_from=2,
        )
        make_truncated_drafter(tmp / "target", tmp / "drafter", num_layers=2)
        shutil.rmtree(root, ignore_errors=True)
        try:
            tmp.rename(root)
        except OSError:  # another process made it meanwhile (the same seeded pair)
            shutil.rmtree(tmp, ignore_errors=True)
    return target, drafter


def gemma3_text_config(**over: Any) -> Dict[str, Any]:
    """Sliding-window attention (RotatingKVCache) on every layer but each 2nd (KVCache)."""
    config = llama_config(
        model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32,
        sliding_window=8, sliding_window_pattern=2, rope_local_base_freq=10000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    )
    config.update(over)
    return config


def qwen3_5_config(**over: Any) -> Dict[str, Any]:
    """GatedDeltaNet hybrid: ArraysCache (conv + recurrent state) layers and a full-attention KVCache layer."""
    config = llama_config(
        model_type="qwen3_5", architectures=["Qwen3_5ForCausalLM"], num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, full_attention_interval=2,
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters={"type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.25},
    )
    config.update(over)
    return config


def falcon_h1_config(**over: Any) -> Dict[str, Any]:
    """SSM hybrid: every layer holds a CacheList(ArraysCache (Mamba-2 conv + SSM state), KVCache)."""
    config = {
        "model_type": "falcon_h1", "architectures": ["FalconH1ForCausalLM"],
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 384,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "mamba_d_conv": 4, "mamba_d_head": 16, "mamba_d_ssm": 64, "mamba_d_state": 16, "mamba_expand": 2,
        "mamba_n_groups": 1, "mamba_n_heads": 4, "mamba_chunk_size": 16,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 4096,
        "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "float32",
    }
    config.update(over)
    return config


def deepseek_v3_config(**over: Any) -> Dict[str, Any]:
    """Multi-head latent attention (MLA) and a few routed experts."""
    config = llama_config(
        model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=2, moe_intermediate_size=32, n_shared_experts=1,
        n_routed_experts=4, num_experts_per_tok=2, routed_scaling_factor=1.0, kv_lora_rank=16,
        q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, topk_method="noaux_tc",
        scoring_func="sigmoid", norm_topk_prob=True, n_group=1, topk_group=1, moe_layer_freq=1,
        first_k_dense_replace=1,
    )
    config.update(over)
    return config


def gpt_oss_config(**over: Any) -> Dict[str, Any]:
    """Attention sinks, sliding-window (RotatingKVCache) and full-attention layers, a few experts."""
    config = llama_config(
        model_type="gpt_oss", architectures=["GptOssForCausalLM"], num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=64,
        num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 2,
    )
    config.update(over)
    return config


def mamba2_config(**over: Any) -> Dict[str, Any]:
    """A pure SSM: every layer an ArraysCache (conv state + SSM state)."""
    config = {
        "model_type": "mamba2", "architectures": ["Mamba2ForCausalLM"], "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 384, "num_heads": 8, "head_dim": 16,
        "state_size": 16, "n_groups": 1, "conv_kernel": 4, "layer_norm_epsilon": 1e-5, "use_bias": False,
        "use_conv_bias": True, "tie_word_embeddings": False, "time_step_limit": [0.0, 1e4],
        "time_step_rank": "auto", "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "float32",
    }
    config.update(over)
    return config


def qwen3_next_config(**over: Any) -> Dict[str, Any]:
    """GatedDeltaNet hybrid with routed experts: ArraysCache layers and a full-attention KVCache layer."""
    config = llama_config(
        model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"], num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, full_attention_interval=2,
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
        moe_intermediate_size=32, shared_expert_intermediate_size=32, norm_topk_prob=True,
        partial_rotary_factor=0.25, rms_norm_eps=1e-6,
    )
    config.update(over)
    return config


def jamba_config(**over: Any) -> Dict[str, Any]:
    """Mamba (its own selective scan, ArraysCache) and attention (KVCache) layers, every 2nd with experts."""
    config = {
        "model_type": "jamba", "architectures": ["JambaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "attn_layer_offset": 1,
        "attn_layer_period": 2, "expert_layer_offset": 1, "expert_layer_period": 2, "num_experts": 4,
        "num_experts_per_tok": 2, "mamba_d_conv": 4, "mamba_d_state": 16, "mamba_expand": 2, "mamba_dt_rank": "auto",
        "mamba_proj_bias": False, "mamba_conv_bias": True, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
        "vocab_size": 384, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
        "torch_dtype": "float32",
    }
    config.update(over)
    return config


def lfm2_config(**over: Any) -> Dict[str, Any]:
    """Gated short convolutions (ArraysCache: a conv window only) and attention (KVCache) layers."""
    config = {
        "model_type": "lfm2", "architectures": ["Lfm2ForCausalLM"], "hidden_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 384, "max_position_embeddings": 4096,
        "norm_eps": 1e-5, "conv_bias": False, "conv_L_cache": 3, "block_dim": 64, "block_ff_dim": 192,
        "block_multiple_of": 16, "block_ffn_dim_multiplier": 1.0, "block_auto_adjust_ff_dim": True,
        "rope_theta": 1000000.0, "full_attn_idxs": [1, 3], "tie_word_embeddings": True, "bos_token_id": 0,
        "eos_token_id": 1, "torch_dtype": "float32",
    }
    config.update(over)
    return config


EXTRA_CONFIGS = {
    "mamba2": mamba2_config,
    "gemma3_text": gemma3_text_config,
    "qwen3_5": qwen3_5_config,
    "falcon_h1": falcon_h1_config,
    "deepseek_v3": deepseek_v3_config,
    "gpt_oss": gpt_oss_config,
    "qwen3_next": qwen3_next_config,
    "jamba": jamba_config,
    "lfm2": lfm2_config,
}


# The architectures the cache-transaction tests and benchmarks cover, one tiny config each.
ARCH_CONFIGS = {
    "llama": llama_config,
    "qwen3": qwen3_config,
    "gemma3_text": gemma3_text_config,
    "qwen3_5": qwen3_5_config,
    "falcon_h1": falcon_h1_config,
    "mamba2": mamba2_config,
    "deepseek_v3": deepseek_v3_config,
    "gpt_oss": gpt_oss_config,
}
