"""A GGUF checkpoint written as an mlx-lm folder: ``mlx-spec convert`` and the cache behind ``--model x.gguf``."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import time
from collections import Counter
from pathlib import Path
from typing import Any, Dict, List

import mlx.core as mx
import numpy as np

from . import gguf, knobs
from .gguf import ARCHITECTURES, DTYPES, FORMAT, GGUFError
from .gguf_tokenizer import write_tokenizer

log = logging.getLogger("mlx_speculative.gguf")
SOURCE_FILE = "gguf_source.json"  # written last: a folder without it is an unfinished conversion


def _llama3_rope(freqs: np.ndarray, theta: float, head_dim: int, meta: Dict[str, Any], arch: str) -> Dict[str, Any]:
    """The rope_scaling whose factors llama.cpp stored as rope_freqs (Llama 3.1's), checked against them."""
    factor = float(freqs.max())
    old = int(meta.get(f"{arch}.rope.scaling.original_context_length", 8192))
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": old}
    expected = []
    for i in range(0, head_dim, 2):  # convert_hf_to_gguf.py LlamaModel.generate_extra_tensors
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old / 4.0:
            expected.append(1.0)
        elif wavelen > old / 1.0:
            expected.append(factor)
        else:
            smooth = (old / wavelen - 1.0) / (4.0 - 1.0)
            expected.append(1 / ((1 - smooth) / factor + smooth))
    if not np.allclose(freqs.ravel(), expected, rtol=1e-4):
        raise GGUFError("the GGUF file's rope_freqs are not Llama 3's rope scaling (factor "
                        f"{factor:g}, low/high frequency factors 1/4, original context {old}); other rope factors are not supported")
    return scaling


def build_config(meta: Dict[str, Any], tensors: List[Any], what: str = "model") -> Dict[str, Any]:
    """config.json of mlx-lm's llama, qwen2 or qwen3 from a GGUF file's metadata and tensor list."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{what}: GGUF architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if isinstance(value, list):
            raise GGUFError(f"{what}: GGUF {arch}.{key} differs from layer to layer ({value[:4]}...); "
                            "only models with one value for all layers are supported")
        return value

    required = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count",
                "attention.layer_norm_rms_epsilon")
    missing = [f"{arch}.{k}" for k in required if get(k) is None]
    if missing:
        raise GGUFError(f"{what}: the GGUF metadata lacks {', '.join(missing)}; expected every one of "
                        f"{', '.join(f'{arch}.{k}' for k in required)}")
    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    config: Dict[str, Any] = {
        "model_type": arch, "hidden_size": hidden, "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")), "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
    }
    names = {t.name: t for t in tensors}
    head_dim = int(get("attention.key_length", hidden // heads))
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise GGUFError(f"{what}: partial rotary embeddings (rope.dimension_count {get('rope.dimension_count')} of "
                        f"head_dim {head_dim}) are not supported for {arch}")
    embed = names.get("token_embd.weight")
    if embed is None:
        raise GGUFError(f"{what}: the GGUF file has no token_embd.weight")
    config.update({
        "head_dim": head_dim, "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 4096)), "vocab_size": int(embed.shape[-1]),
        "tie_word_embeddings": "output.weight" not in names,
    })
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in names
        config["mlp_bias"] = "blk.0.ffn_up.bias" in names
    kind = get("rope.scaling.type")
    if "rope_freqs.weight" in names:
        if arch != "llama":
            raise GGUFError(f"{what}: rope_freqs (rope scaling factors) are supported for llama only, not {arch}")
        freqs = np.asarray(gguf.load_float(names["rope_freqs.weight"]))
        config["rope_scaling"] = _llama3_rope(freqs, config["rope_theta"], head_dim, meta, arch)
    elif kind in ("linear", "yarn") and get("rope.scaling.factor"):
        config["rope_scaling"] = {"type": kind, "rope_type": kind, "factor": float(get("rope.scaling.factor"))}
        if get("rope.scaling.original_context_length"):
            config["rope_scaling"]["original_max_position_embeddings"] = int(get("rope.scaling.original_context_length"))
    elif kind not in (None, "none"):
        raise GGUFError(f"{what}: GGUF rope scaling {kind!r} is not supported (supported: linear, yarn, llama3)")
    eos = list(dict.fromkeys(int(meta[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta))
    if eos:
        config["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    if "tokenizer.ggml.bos_token_id" in meta:
        config["bos_token_id"] = int(meta["tokenizer.ggml.bos_token_id"])
    return config


def convert(path: Path, out_dir: Path, dtype: str = "keep", what: str = "model", dense: mx.Dtype = mx.float16) -> Dict[str, Any]:
    """Write the GGUF checkpoint at ``path`` (a file, a shard of a split one, or a folder) as an mlx-lm
    folder ``out_dir``: config.json, model.safetensors, the tokenizer files, gguf_source.json. Returns the
    config. ``dtype``: keep (as stored: Q4_0/Q4_1/Q8_0 stay quantized, other blocks become ``dense``), f32,
    bf16 or f16 (every weight a dense array of that dtype)."""
    if dtype not in DTYPES:
        raise GGUFError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    files = gguf.gguf_files(path, what)
    meta, tensors = gguf.read_metadata(files)
    config = build_config(meta, tensors, what)
    weights, bits = gguf.load_tensors(files, tensors, meta, DTYPES[dtype], what, dense)
    if bits:
        common = Counter(bits.values()).most_common(1)[0][0]
        config["quantization"] = {"group_size": 32, "bits": common, "mode": "affine",
                                  **{m: {"group_size": 32, "bits": b} for m, b in bits.items() if b != common}}
    out_dir.mkdir(parents=True, exist_ok=True)
    write_tokenizer(meta, out_dir, config.get("max_position_embeddings"), what)
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=1))
    source = {"files": [str(f) for f in files], "dtype": dtype, "format": FORMAT, "name": meta.get("general.name")}
    if dtype == "keep":
        source["dequantized_to"] = str(dense).split(".")[-1]
    (out_dir / SOURCE_FILE).write_text(json.dumps(source, indent=1))
    return config


def cache_root() -> Path:
    return Path(knobs.cache_root()) / "gguf"  # runtime.cache_dir / $MLX_SPEC_CACHE


def dense_dtype() -> mx.Dtype:
    """The dtype of dequantized blocks and quantization scales in a direct load: float16, but float32 where
    MLX runs on the CPU (its float16 matmuls there take about 2.5x as long as float32 ones, and float32
    scales keep the quantized layers' products exact, as llama.cpp computes them)."""
    return mx.float32 if mx.default_device() == mx.cpu else mx.float16


def cached_folder(path: Path, what: str = "model") -> Path:
    """The mlx-lm folder of the GGUF checkpoint at ``path`` (dtype keep, dequantized blocks in
    ``dense_dtype()``), converted on first use."""
    files = gguf.gguf_files(path.resolve(), what)
    dense = dense_dtype()
    key = hashlib.sha256(json.dumps([FORMAT, str(dense)] + [[str(f), f.stat().st_size, f.stat().st_mtime_ns]
                                                           for f in files]).encode()).hexdigest()[:16]
    out = cache_root() / f"{files[0].stem}-{key}"
    if (out / SOURCE_FILE).is_file():
        return out
    log.info("%s: converting %s into %s (once)", what, files[0], out)
    start = time.perf_counter()
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        convert(files[0], tmp, "keep", what, dense)
        shutil.rmtree(out, ignore_errors=True)  # an unfinished folder of a killed conversion
        tmp.rename(out)
    except OSError:
        if not (out / SOURCE_FILE).is_file():  # not another process's finished folder
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("%s: converted in %.1f s", what, time.perf_counter() - start)
    return out
