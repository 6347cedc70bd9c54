"""Tiny real mlx-lm checkpoints with random weights, made locally (tests, the demo, benchmarks).

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


def _layer_index(name: str) -> Optional[int]:
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
        layer = _layer_index(name)
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
        layer = _layer_index(name)
        if layer is None or layer < num_layers:
            kept[name] = w
    out_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out_dir / "model.safetensors"), kept, metadata={"format": "mlx"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=1))
    for name in TOKENIZER_FILES:
        if (target_dir / name).exists():
            shutil.copy(target_dir / name, out_dir / name)
    return out_dir


def demo_dir() -> Path:
    root = os.environ.get("MLX_SPEC_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "mlx-speculative")
    return Path(root) / "demo-v2"


def ensure_demo_pair(announce=print) -> tuple[Path, Path]:
    """The embedded default: a tiny random llama target and a 1-layer drafter cut from it.

    Made on first use and cached (``$MLX_SPEC_CACHE`` or ~/.cache/mlx-speculative).
    """
    root = demo_dir()
    target, drafter = root / "target", root / "drafter"
    if not (target / "model.safetensors").exists() or not (drafter / "model.safetensors").exists():
        announce(f"[mlx-spec] no model given: making the tiny random demo pair in {root} (once; random weights, the text is gibberish)")
        tmp = root.with_name(root.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        make_checkpoint(
            tmp / "target", llama_config(num_hidden_layers=4, hidden_size=128, intermediate_size=256),
            seed=7, logit_scale=4.0, quiet_layers_from=2,
        )
        make_truncated_drafter(tmp / "target", tmp / "drafter", num_layers=2)
        shutil.rmtree(root, ignore_errors=True)
        tmp.rename(root)
    return target, drafter
