"""Tiny GGUF checkpoints written with the ``gguf`` package's own writer (tests of hooks/gguf.py).

Each is a real mlx-lm architecture with random weights and a byte-level BPE tokenizer trained here, and
comes with its reference: the same weights (as the GGUF file's blocks dequantize) in an mlx-lm folder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Tuple

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from mlx_speculative.testing import tiny_models as tm

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED = ["<tool>"]
CODE = ["def add(a, b):\n    return a + b  # 12 + 345 = 357", "for i in range(10):\n\tprint(i ** 2)",
        "x = [1, 22, 333, 4444]\nif x and y: pass", "class Stack:\n    def push(self, item): ...",
        "Don't stop, it's 2024! I'll say: \"we've\" 3.14", "  leading  spaces\n\n\nand  newlines  ",
        # pieces the splits cut differently: "(value" and ".append" (qwen2, llama3) or "(", "value" (GPT-2);
        # "12345" digit by digit (qwen2, smollm) or "123", "45" (llama3); ":\n" together (qwen2, llama3)
        "print(value.append(items)):\n\treturn 12345 + 2024;\n"]
# llama.cpp's pre-tokenizer names -> the split its Hugging Face tokenizer.json writes.
PRE = {"qwen2": "qwen2", "llama-bpe": "llama3", "smollm": "digits"}
# Where the float16 scales sit in the blocks of the types gguf.quants cannot quantize (ggml-common.h).
K_SCALES = {"Q4_K": (0, 4), "Q6_K": (208, 210), "Q2_K": (80, 84), "Q3_K": (108, 110), "Q5_K": (0, 4)}


def train_tokenizer(out_dir: Path, pre: str, vocab_size: int = 400) -> Any:
    """A byte-level BPE with ``pre``'s split, saved for transformers; returns the ``tokenizers`` object."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    from mlx_speculative.hooks.gguf_tokenizer import LLAMA3_SPLIT, QWEN2_SPLIT

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=PRE[pre] == "digits")
    split = {"qwen2": QWEN2_SPLIT, "llama3": LLAMA3_SPLIT}.get(PRE[pre])
    tok = Tokenizer(models.BPE(ignore_merges=PRE[pre] == "llama3"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated") if split else pre_tokenizers.Digits(individual_digits=True),
        byte_level])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(tm.corpus() + CODE * 40, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in USER_DEFINED])
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIALS[0], "eos_token": SPECIALS[2],
        "pad_token": SPECIALS[0], "add_bos_token": False, "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE}))
    return tok


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute, over the rows of any row-major array."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def blocks(w: np.ndarray, kind: str, rng: np.random.Generator) -> Tuple[np.ndarray, Any]:
    """(what the GGUF file stores for ``w`` as ``kind``, its gguf type): gguf.quants' quantizer where it
    has one; for the K-quants it has none, random blocks whose float16 scales are set small and finite."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quantize

    qtype = GGMLQuantizationType[kind]
    if kind == "F32":
        return w.astype(np.float32), qtype
    if kind not in K_SCALES:
        return quantize(w.astype(np.float32), qtype), qtype
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (w.shape[0], w.shape[1] // block, size), dtype=np.uint8)
    lo, hi = K_SCALES[kind]
    scales = rng.uniform(1e-5, 4e-5 if kind in ("Q6_K", "Q3_K") else 4e-4, (w.shape[0], w.shape[1] // block, (hi - lo) // 2))
    raw[..., lo:hi] = scales.astype(np.float16).view(np.uint8).reshape(raw[..., lo:hi].shape)
    return raw.reshape(w.shape[0], -1), qtype


_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(hf: str) -> str:
    module, leaf = hf.rsplit(".", 1)
    if module in _NAMES:
        return f"{_NAMES[module]}.{leaf}"
    _, _, i, rest = module.split(".", 3)
    return f"blk.{i}.{_LAYER[rest]}.{leaf}"


def write_pair(root: Path, arch: str, kind: str, tokenizer_dir: Path, pre: str, seed: int = 0,
               permute_qk: bool = True, overrides: Dict[str, str] | None = None,
               extra: Dict[str, np.ndarray] | None = None, add_bos: bool = False, split: int = 0,
               **config_over: Any) -> Tuple[Path, Path]:
    """(model.gguf, its reference mlx-lm folder) for a tiny ``arch`` model whose matrices are stored as
    ``kind`` (norms and biases in F32); ``overrides`` stores single tensors (GGUF names) as other types;
    ``split``: llama.cpp's split shards of at most that many tensors (the first shard's path is returned)."""
    import gguf

    from mlx_speculative.hooks.gguf_tokenizer import CONTROL, NORMAL
    from mlx_speculative.hooks.gguf_tokenizer import USER_DEFINED as USER

    tok_json = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab: Dict[str, int] = dict(tok_json["model"]["vocab"])
    added = {a["content"]: a for a in tok_json["added_tokens"]}
    vocab.update({c: a["id"] for c, a in added.items()})
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    maker = tm.qwen3_config if arch == "qwen3" else tm.llama_config
    config = maker(model_type=arch, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=64, vocab_size=len(tokens), rope_theta=10000.0,
                   max_position_embeddings=2048, tie_word_embeddings=arch == "qwen2", eos_token_id=vocab[SPECIALS[2]],
                   bos_token_id=vocab[SPECIALS[0]], **config_over)
    config.pop("architectures", None)
    mx.random.seed(seed)
    rng = np.random.default_rng(seed)
    params = {k: np.array(v) for k, v in tree_flatten(tm.build_model(config).parameters())}
    path = root / f"{arch}-{kind}.gguf"
    root.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), arch, split_max_tensors=split)
    w.add_block_count(2), w.add_context_length(2048), w.add_embedding_length(256), w.add_feed_forward_length(512)
    w.add_head_count(4), w.add_head_count_kv(2), w.add_layer_norm_rms_eps(1e-5), w.add_rope_freq_base(10000.0)
    w.add_key_length(64), w.add_value_length(64)
    if config.get("rope_scaling"):
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR), w.add_rope_scaling_factor(config["rope_scaling"]["factor"])
    w.add_tokenizer_model("gpt2"), w.add_tokenizer_pre(pre), w.add_token_list(tokens)
    w.add_token_types([CONTROL if t in SPECIALS else USER if t in USER_DEFINED else NORMAL for t in tokens])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok_json["model"]["merges"]])
    w.add_bos_token_id(vocab[SPECIALS[0]]), w.add_eos_token_id(vocab[SPECIALS[2]]), w.add_pad_token_id(vocab[SPECIALS[0]])
    w.add_add_bos_token(add_bos), w.add_chat_template(CHAT_TEMPLATE)
    reference = {}
    for name, value in params.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if value.ndim == 1:  # norms near 1 (the final one x4: logits of a few units), biases near 0
            value = rng.normal(1.0, 0.1, value.shape) if name.endswith("norm.weight") else rng.normal(0, 0.05, value.shape)
            value = value * (4.0 if name == "model.norm.weight" else 1.0)
        value = value.astype(np.float32)
        gname = gguf_name(name)
        stored_kind = (overrides or {}).get(gname, kind if value.ndim == 2 else "F32")
        data, qtype = blocks(value, stored_kind, rng)
        reference[name] = gguf.quants.dequantize(data, qtype).reshape(value.shape) if stored_kind != "F32" else data
        if arch == "llama" and permute_qk and (".q_proj." in name or ".k_proj." in name):
            data = permute(data, 4 if ".q_proj." in name else 2)
        w.add_tensor(gname, data, raw_dtype=qtype if data.dtype == np.uint8 else None)
    for gname, value in (extra or {}).items():
        w.add_tensor(gname, value)
    shards = w.format_shard_names(path)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    path = shards[0]
    ref_dir = root / f"{arch}-{kind}-reference"
    ref_dir.mkdir(exist_ok=True)
    mx.save_safetensors(str(ref_dir / "model.safetensors"), {k: mx.array(v) for k, v in reference.items()},
                        metadata={"format": "mlx"})
    (ref_dir / "config.json").write_text(json.dumps(config))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (ref_dir / f).write_bytes((tokenizer_dir / f).read_bytes())
    return path, ref_dir


def logits(model: Any, ids: List[int]) -> np.ndarray:
    out = model(mx.array([ids]))  # [1, L, V]
    return np.array(out.astype(mx.float32))[0]
