"""GGUF checkpoints (llama.cpp's format, LM Studio's and Ollama's) as mlx-lm folders.

A ``.gguf`` file, a folder holding one, or llama.cpp's split shards (``name-00001-of-00003.gguf``) is
converted into a normal mlx-lm folder: config.json from the metadata, model.safetensors with Hugging
Face tensor names, and the tokenizer rebuilt from the metadata (hooks/gguf_tokenizer.py). A model named
by a GGUF path is converted once into the cache folder (``$MLX_SPEC_CACHE/gguf``, else
~/.cache/mlx-speculative/gguf), keyed by each file's path, size and modification time; later loads read
that folder. ``mlx-spec convert`` writes such a folder where the user says, in a dtype of their choice.

Tensors: MLX's own GGUF reader (``mx.load``) where it reads the whole file (F32, F16, Q4_0, Q4_1, Q8_0
only), else the ``gguf`` package's reader. Q4_0, Q4_1 and Q8_0 blocks are MLX's affine quantization at
group size 32 (a scale and a bias per 32 values), so they stay quantized layers (repacked bit for bit
where MLX's reader does not read the file). Other block types have no MLX layout and are dequantized with
the ``gguf`` package (one log line says which and to what dtype).
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx
import numpy as np

from .loading import CheckpointError

log = logging.getLogger("mlx_speculative.gguf")

FORMAT = 1  # bump when the conversion's output changes: cached folders of older versions are remade
ARCHITECTURES = ("llama", "qwen2", "qwen3")
# GGUF block types MLX's affine quantization holds as they are (bits at group size 32).
MLX_QUANTIZED = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}
FLOATS = ("F32", "F16", "BF16")
DEQUANTIZED = ("Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
SUPPORTED = (*FLOATS, *MLX_QUANTIZED, *DEQUANTIZED)
MLX_READS = ("F32", "F16", *MLX_QUANTIZED)  # as stored (its reader turns BF16 into float16, fails on the rest)
DTYPES = {"keep": None, "f32": mx.float32, "bf16": mx.bfloat16, "f16": mx.float16}
_SHARD = re.compile(r"^(?P<stem>.+)-(?P<i>\d{5})-of-(?P<n>\d{5})\.gguf$")

# GGUF tensor names -> Hugging Face's (the names mlx-lm's llama, qwen2 and qwen3 read).
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


class GGUFError(CheckpointError):
    """A GGUF checkpoint this loader cannot read; the message says what and what is supported."""


def is_gguf(path: Path) -> bool:
    """A GGUF file (by its magic bytes), or a folder without config.json that holds *.gguf files."""
    if path.is_dir():
        return not (path / "config.json").exists() and any(path.glob("*.gguf"))
    try:
        with path.open("rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def gguf_files(path: Path, what: str = "model") -> List[Path]:
    """The file(s) of one GGUF checkpoint: the file itself, all shards of a split one, or a folder's."""
    if path.is_dir():
        found = sorted(path.glob("*.gguf"))
        stems = {m["stem"] if (m := _SHARD.match(f.name)) else f.stem for f in found}
        if len(stems) != 1:
            raise GGUFError(f"{what} folder {str(path)!r} holds several GGUF checkpoints "
                            f"({', '.join(f.name for f in found)}); name the .gguf file to load")
        path = found[0]
    m = _SHARD.match(path.name)
    if not m:
        return [path]
    n = int(m["n"])
    shards = [path.with_name(f"{m['stem']}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]
    missing = [s.name for s in shards if not s.is_file()]
    if missing:
        raise GGUFError(f"{what} {str(path)!r} is shard {int(m['i'])} of {n}; missing: {', '.join(missing)}")
    return shards


def _value(field: Any) -> Any:
    v = field.contents()
    if isinstance(v, (np.floating, float)) and not isinstance(v, bool):
        return float(str(np.float32(v)))  # GGUF keeps float32: 1e-05, not 9.999999747378752e-06
    return v.item() if isinstance(v, np.generic) else v


def read_metadata(files: List[Path]) -> Tuple[Dict[str, Any], List[Any]]:
    """(metadata of the first file, every file's gguf.ReaderTensor): headers only, data memory-mapped."""
    from gguf import GGUFReader

    readers = []
    for f in files:
        try:
            readers.append(GGUFReader(str(f)))
        except (ValueError, OSError, KeyError) as e:
            raise GGUFError(f"{str(f)!r} is not a readable GGUF file: {e}") from e
    meta = {k: _value(v) for k, v in readers[0].fields.items() if not k.startswith("GGUF.")}
    return meta, [t for r in readers for t in r.tensors]


def hf_name(name: str, what: str = "model") -> Optional[str]:
    """The Hugging Face name of a GGUF tensor; None for those folded into config.json (rope_freqs)."""
    base, _, leaf = name.rpartition(".")
    if base == "rope_freqs":
        return None
    if base in _GLOBAL:
        return f"{_GLOBAL[base]}.{leaf}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER:
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}.{leaf}"
    raise GGUFError(f"{what}: GGUF tensor {name!r} has no counterpart in mlx-lm's {'/'.join(ARCHITECTURES)} models")


def load_float(tensor: Any) -> np.ndarray:
    """A float tensor of a gguf.GGUFReader as float32."""
    from gguf.quants import dequantize

    return dequantize(tensor.data, tensor.tensor_type).astype(np.float32)


def _unpermute(x: mx.array, heads: int) -> mx.array:
    """Undo llama.cpp's Q/K row permutation (convert_hf_to_gguf.py LlamaModel.permute) over axis 0."""
    # rows [heads, head_dim/2, 2] (interleaved rotary pairs) -> [heads, 2, head_dim/2] (rotate-half)
    return x.reshape(heads, -1, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def _repack(raw: np.ndarray, kind: str) -> Tuple[mx.array, mx.array, mx.array]:
    """A Q4_0/Q4_1/Q8_0 tensor's blocks [rows, bytes] as MLX's (packed uint32, scales, biases), exactly."""
    rows = raw.shape[0]
    size = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[kind]
    blocks = np.ascontiguousarray(raw).reshape(rows, -1, size)  # [rows, groups, block bytes]
    d = blocks[..., 0:2].copy().view(np.float16)  # [rows, groups, 1]
    if kind == "Q8_0":
        q = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)  # [rows, groups, 32]
        bias = d * np.float16(-128)
    else:
        qs = blocks[..., 4:] if kind == "Q4_1" else blocks[..., 2:]  # [rows, groups, 16]: value j, j + 16
        values = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [rows, groups, 32]
        q = values[..., 0::2] | (values[..., 1::2] << 4)  # MLX packs value 2k in the low nibble of byte k
        bias = blocks[..., 2:4].copy().view(np.float16) if kind == "Q4_1" else d * np.float16(-8)
    packed = np.ascontiguousarray(q.reshape(rows, -1)).view(np.uint32)
    return mx.array(packed), mx.array(d[..., 0]), mx.array(bias[..., 0])


def _mlx_reader(files: List[Path]) -> Optional[Dict[str, mx.array]]:
    """Every tensor through MLX's GGUF reader, or None where it fails (block types it does not read)."""
    out: Dict[str, mx.array] = {}
    for f in files:
        try:
            out.update(mx.load(str(f)))
        except (RuntimeError, ValueError) as e:
            log.debug("MLX's GGUF reader failed on %s (%s); reading with the gguf package", f, e)
            return None
    return out


def load_tensors(files: List[Path], tensors: List[Any], meta: Dict[str, Any], dtype: Optional[mx.Dtype],
                 what: str = "model", dense: mx.Dtype = mx.float16) -> Tuple[Dict[str, mx.array], Dict[str, int]]:
    """(Hugging Face name -> array, quantized module -> bits) of a checkpoint's tensors.

    ``dtype`` None keeps each tensor's own form: Q4_0/Q4_1/Q8_0 quantized (their float16 scales and biases
    in ``dense``), the other block types dequantized into ``dense``; a dtype makes every weight a dense
    array of that dtype."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    kinds = {t.name: t.tensor_type.name for t in tensors}
    bad = sorted({k for k in kinds.values() if k not in SUPPORTED})
    if bad:
        raise GGUFError(f"{what}: GGUF tensor type(s) {', '.join(bad)} are not supported "
                        f"(supported: {', '.join(SUPPORTED)})")
    native = _mlx_reader(files) if all(k in MLX_READS for k in kinds.values()) else None
    arch = meta["general.architecture"]
    heads = int(meta[f"{arch}.attention.head_count"])
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
    out: Dict[str, mx.array] = {}
    bits: Dict[str, int] = {}
    dequantized: Counter = Counter()
    for t in tensors:
        name, kind = hf_name(t.name, what), kinds[t.name]
        if name is None:
            continue
        # [out, in] arrays (GGUF lists dims innermost first); a quantized one as (packed, scales, biases)
        if kind in MLX_QUANTIZED:
            stem = t.name[: -len(".weight")]
            parts = ((native[t.name], native[stem + ".scales"], native[stem + ".biases"]) if native is not None
                     else _repack(t.data, kind))
        elif kind in FLOATS:
            parts = (native[t.name],) if native is not None else (mx.array(dequantize(t.data, t.tensor_type)),)
            if kind != "F32" and native is None:
                parts = (parts[0].astype(mx.float16 if kind == "F16" else mx.bfloat16),)
        else:
            dequantized[kind] += 1
            parts = (mx.array(dequantize(t.data, GGMLQuantizationType[kind])).astype(dtype or dense),)
        if arch == "llama" and (".self_attn.q_proj." in name or ".self_attn.k_proj." in name):
            n = heads if ".q_proj." in name else kv_heads
            parts = tuple(_unpermute(p, n) for p in parts)
        if len(parts) == 3 and dtype is None:
            module = name[: -len(".weight")]
            out[name], out[module + ".scales"], out[module + ".biases"] = parts[0], *(p.astype(dense) for p in parts[1:])
            bits[module] = MLX_QUANTIZED[kind]
        elif len(parts) == 3:
            w, s, b = parts  # float32 scales and biases: the dequantized values are exact
            out[name] = mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), group_size=32,
                                      bits=MLX_QUANTIZED[kind]).astype(dtype)
        else:
            out[name] = parts[0] if dtype is None else parts[0].astype(dtype)
    if dequantized:
        log.warning("%s: GGUF block types without an MLX layout dequantized to %s: %s", what,
                    str(dtype or dense).split(".")[-1],
                    ", ".join(f"{k} ({n} tensors)" for k, n in sorted(dequantized.items())))
    return out, bits
