"""The tokenizer of a GGUF checkpoint rebuilt from its metadata as a ``tokenizers`` tokenizer.

GGUF keeps a byte-level BPE tokenizer (``tokenizer.ggml.model == "gpt2"``: Llama 3, Qwen2, SmolLM, ...) as
its tokens, merges and token types; the split that runs before the merges is named by
``tokenizer.ggml.pre`` and lives in llama.cpp's code, so it is restated here per name. The result is a
tokenizer.json and a tokenizer_config.json that mlx-lm's ``load_tokenizer`` reads like any other.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Dict, List, Tuple

log = logging.getLogger("mlx_speculative.gguf")

# llama.cpp's token types (gguf.TokenType).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_CONTRACTIONS_I = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
# The splits of llama.cpp's pre-tokenizer types (llama-vocab.cpp), as Hugging Face's tokenizer.json
# files of the same models write them.
QWEN2_SPLIT = (_CONTRACTIONS_I + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPLIT = (_CONTRACTIONS_I + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> how its text is split: a regex (then byte-level, no regex of its own), "digits"
# (each digit alone, then GPT-2's byte-level regex) or "gpt2" (GPT-2's byte-level regex alone).
PRE_TOKENIZERS: Dict[str, str] = {
    "qwen2": QWEN2_SPLIT, "deepseek-r1-qwen": QWEN2_SPLIT, "stablelm2": QWEN2_SPLIT, "megrez": QWEN2_SPLIT,
    "llama-bpe": LLAMA3_SPLIT, "llama3": LLAMA3_SPLIT, "llama-v3": LLAMA3_SPLIT, "falcon3": LLAMA3_SPLIT,
    "smollm": "digits", "starcoder": "digits", "refact": "digits", "codeshell": "digits",
    "gpt-2": "gpt2", "gpt2": "gpt2", "default": "gpt2", "phi-2": "gpt2", "olmo": "gpt2", "mpt": "gpt2",
}
# llama.cpp matches the vocabulary before merging for these (Hugging Face's "ignore_merges": true).
IGNORE_MERGES = {LLAMA3_SPLIT}
# Qwen2's own tokenizer (tokenizer.json, transformers' Qwen2Tokenizer) normalizes text to NFC first.
NFC = {"qwen2", "deepseek-r1-qwen"}

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _pre_tokenizer(pre: str):
    from tokenizers import Regex, pre_tokenizers

    split = PRE_TOKENIZERS.get(pre)
    if split is None:
        log.warning("GGUF tokenizer.ggml.pre %r is not one this loader knows (%s): GPT-2's byte-level split is "
                    "used, which may tokenize some text differently from the model's own tokenizer",
                    pre, ", ".join(sorted(PRE_TOKENIZERS)))
        split = "gpt2"
    if split == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if split == "digits":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _token(tokens: List[str], meta: Dict[str, Any], key: str) -> Tuple[int, str] | None:
    i = meta.get(f"tokenizer.ggml.{key}_token_id")
    if i is None or not 0 <= int(i) < len(tokens):
        return None
    return int(i), tokens[int(i)]


def build_tokenizer(meta: Dict[str, Any], what: str = "model") -> Tuple[Any, Dict[str, Any]]:
    """(a ``tokenizers.Tokenizer``, the tokenizer_config.json dict) from a GGUF file's metadata.

    Raises ValueError when the file holds no tokenizer or one of another kind than byte-level BPE."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

    kind = meta.get("tokenizer.ggml.model")
    if kind is None or "tokenizer.ggml.tokens" not in meta:
        raise ValueError(f"{what}: the GGUF file holds no tokenizer (no tokenizer.ggml.model/tokens metadata)")
    if kind != "gpt2":
        raise ValueError(f"{what}: the GGUF tokenizer is {kind!r}; only byte-level BPE ('gpt2': Llama 3, Qwen2, "
                         f"SmolLM and most recent models) is rebuilt, not SentencePiece ('llama') or others")
    tokens: List[str] = list(meta["tokenizer.ggml.tokens"])
    types: List[int] = [int(t) for t in meta.get("tokenizer.ggml.token_type", [NORMAL] * len(tokens))]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    pre = str(meta.get("tokenizer.ggml.pre", "default"))
    split = PRE_TOKENIZERS.get(pre, "gpt2")
    # Every token keeps its id: added tokens are in the vocabulary too, so that adding them reuses it.
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=split in IGNORE_MERGES))
    tok.pre_tokenizer = _pre_tokenizer(pre)
    if pre in NFC:
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == USER_DEFINED])

    bos, eos = _token(tokens, meta, "bos"), _token(tokens, meta, "eos")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if add_bos or add_eos:
        def seq(piece: str, i: int) -> str:  # "<bos>:i $A:i <eos>:i", each end as the metadata asks
            return " ".join([f"{bos[1]}:{i}"] * add_bos + [f"{piece}:{i}"] + [f"{eos[1]}:{i}"] * add_eos)

        tok.post_processor = processors.TemplateProcessing(
            single=seq("$A", 0), pair=f"{seq('$A', 0)} {seq('$B', 1)}",
            special_tokens=[(t[1], t[0]) for t, on in ((bos, add_bos), (eos, add_eos)) if on])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)

    config: Dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": add_bos,
                              "add_eos_token": add_eos, "clean_up_tokenization_spaces": False}
    for key in ("bos", "eos", "unknown", "padding"):
        found = _token(tokens, meta, key)
        if found is not None:
            config[{"unknown": "unk_token", "padding": "pad_token"}.get(key, f"{key}_token")] = found[1]
    if meta.get("tokenizer.chat_template"):
        config["chat_template"] = str(meta["tokenizer.chat_template"])
    return tok, config


def write_tokenizer(meta: Dict[str, Any], out_dir: Path, model_max_length: int | None, what: str = "model") -> None:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json in ``out_dir``."""
    tok, config = build_tokenizer(meta, what)
    if model_max_length:
        config["model_max_length"] = int(model_max_length)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=1, ensure_ascii=False))
    specials = {k: v for k, v in config.items() if k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(specials, indent=1, ensure_ascii=False))
