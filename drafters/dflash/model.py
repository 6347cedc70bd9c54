"""DFlash drafter (z-lab, block diffusion): a few Qwen3-style layers that draft a whole block at once.

The block [last committed token, mask x (B-1)] attends, non-causally, to itself and to context
K/V made from the target's hidden states: hidden_norm(fc(concat of the outputs of the target
layers named by target_layer_ids)), injected in every layer. The embedding and lm_head are the
target's (the checkpoint holds neither), so ``Model`` maps embeddings to final hidden states.

Parameter names follow the z-lab checkpoints: fc, hidden_norm, norm, layers.N.self_attn.{q,k,v,o}_proj,
layers.N.self_attn.{q,k}_norm, layers.N.mlp.{gate,up,down}_proj, layers.N.{input,post_attention}_layernorm.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import BaseModelArgs, scaled_dot_product_attention
from mlx_lm.models.cache import KVCache
from mlx_lm.models.rope_utils import initialize_rope

from ...hooks.api import MaskSpec, describe, project_all
from .config import build_target_layer_ids, normalize_config


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str = "qwen3"
    hidden_size: int = 4096
    num_hidden_layers: int = 5
    intermediate_size: int = 12288
    num_attention_heads: int = 32
    num_key_value_heads: Optional[int] = None
    head_dim: Optional[int] = None
    rms_norm_eps: float = 1e-6
    vocab_size: Optional[int] = None
    rope_theta: float = 1000000.0
    rope_scaling: Optional[Dict[str, Any]] = None
    partial_rotary_factor: float = 1.0
    max_position_embeddings: Optional[int] = None
    attention_bias: bool = False
    layer_types: Optional[List[str]] = None
    sliding_window: Optional[int] = None
    block_size: int = 16
    num_target_layers: Optional[int] = None
    mask_token_id: Optional[int] = None
    target_layer_ids: Optional[List[int]] = None
    tie_word_embeddings: bool = False
    architectures: List[str] = field(default_factory=list)
    layout: str = "dflash_config"
    # HF hidden_states index = layer id + this (DFlash: 1, i.e. the output of decoder layer id).
    layer_id_offset: int = 1

    @classmethod
    def from_dict(cls, params: Dict[str, Any]) -> "ModelArgs":
        return super().from_dict(normalize_config(params))

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        if self.target_layer_ids is None and self.num_target_layers is not None:
            self.target_layer_ids = build_target_layer_ids(self.num_target_layers, self.num_hidden_layers)

    @property
    def capture_layers(self) -> List[int]:
        """Target decoder layers whose output is read (0-based), in fc's input order."""
        return [i + self.layer_id_offset - 1 for i in (self.target_layer_ids or [])]


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = self.head_dim**-0.5
        dim = args.hidden_size
        self.q_proj = nn.Linear(dim, self.n_heads * self.head_dim, bias=args.attention_bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=args.attention_bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=args.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=args.attention_bias)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.rope = initialize_rope(
            int(self.head_dim * args.partial_rotary_factor), args.rope_theta, False,
            args.rope_scaling, args.max_position_embeddings,
        )
        sliding = args.layer_types[layer_idx] == "sliding_attention"
        # Keys less than ``window`` positions behind the query, as flash-attention applies z-lab's
        # ``sliding_window`` (their eager/sdpa paths build no mask and would attend to everything).
        self.window = args.sliding_window if sliding else None

    def keys_values(self, x: mx.array, offset: Any, kv: Optional[List[mx.array]] = None) -> Tuple[mx.array, mx.array]:
        """K/V of positions offset.. (context or block alike): [B, n_kv, L, D] each, K roped.
        ``offset``: an int, or [B] per row (a batch's rows sit at different positions).
        ``kv``: k_proj(x), v_proj(x) where the caller made them (one launch with siblings)."""
        B, L, _ = x.shape
        k, v = kv if kv is not None else project_all([self.k_proj, self.v_proj], x)
        k = self.k_norm(k.reshape(B, L, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        v = v.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        return self.rope(k, offset=offset), v

    def append(self, context: mx.array, cache: Any, kv: Optional[List[mx.array]] = None) -> None:
        """Context K/V ([B, n, H] context states) appended to the layer's cache at each row's offset."""
        cache.update_and_fetch(*self.keys_values(context, cache.offset, kv))

    def __call__(self, x: mx.array, cache: Any, widths: Optional[mx.array] = None, masks: Optional[dict] = None) -> mx.array:
        """The block [B, T, H] attending, non-causally, to the context in ``cache`` and to itself.

        ``widths`` [B]: only a row's first widths[b] block positions are real (shorter rows and
        shape-stable padding); no real position attends to the others. The block's K/V go into the
        cache right after the context and are trimmed off again: context and block are then one range
        of keys in any cache (an attention kernel takes them from bounds), and nothing is copied.
        ``masks``: the block's masks so far, by (window, keys), shared by its layers.
        """
        B, T, _ = x.shape
        start = cache.offset  # int, or [B]: the block continues each row's context positions
        end = cache.size()  # the slot the block starts at (batched rows are left-padded up to it)
        lp = getattr(cache, "left_padding", None)
        q, *kv = project_all([self.q_proj, self.k_proj, self.v_proj], x)
        q = self.q_norm(q.reshape(B, T, self.n_heads, -1)).transpose(0, 2, 1, 3)
        q = self.rope(q, offset=start)
        k, v = cache.update_and_fetch(*self.keys_values(x, start, kv))  # [B, n_kv, S, D]: context, block, padding
        cache.trim(T)
        masks = {} if masks is None else masks
        key = (self.window, k.shape[2], end)  # every layer's cache holds the same positions: one mask a block
        if key not in masks:
            masks[key] = self.mask(T, k.shape[2], end, start, lp, widths, cache)
        # mlx-lm's function, by name: a host routing this model's attention (hooks/attention.py) sees it.
        out = scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=masks[key])
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, T, -1))

    def mask(self, T: int, S: int, end: int, start: Any, lp: Optional[mx.array],
             widths: Optional[mx.array], cache: Any) -> Optional[mx.array]:
        """[B|1, 1, T|1, S] bool, or None when every key is real and in the window.

        Row b sees slots [lp_b, end + w_b): its context from its left padding (batched caches), then its
        block up to its width; slots past them are a shape-stable cache's padding. Described to ``cache``,
        which this layer's attention call gets with it (later layers share it: the dispatcher remembers it)."""
        windowed = self.window is not None
        if lp is None and widths is None and isinstance(end, int) and S == end + T and not windowed:
            return None
        cols = mx.arange(S)[None]  # [1, S]
        lp_b = (lp if lp is not None else mx.zeros((1,), mx.int32))[:, None]  # [B|1, 1]
        w_b = widths[:, None] if widths is not None else T
        end_b = end[:, None] if isinstance(end, mx.array) and end.ndim == 1 else end  # rows at their own lengths: [B, 1]
        mask = ((cols >= lp_b) & (cols < end_b + w_b))[:, None, None, :]  # [B|1, 1, 1, S]
        if windowed:
            start_b = start if isinstance(start, int) else start.reshape(-1, 1)  # int | [B|1, 1] (a compiled call: [])
            q_pos = start_b + mx.arange(T)[None]  # [B|1, T]
            key_pos = cols - lp_b  # [B|1, S]: a slot's position in its row
            return mask & ((q_pos[:, :, None] - key_pos[:, None, :]) < self.window)[:, None]  # [B|1, 1, T, S]
        # One row for every query (not causal): an attention kernel applies it from these bounds.
        return describe(mask, MaskSpec(1, S, 0 if lp is None else lp, end + (T if widths is None else widths), S, S),
                        cache)

    def blocks(self, x: mx.array, context: mx.array, anchors: mx.array) -> mx.array:
        """``__call__`` for many blocks at once (training, offline evaluation).

        x: [b, n*T, H] n blocks back to back, block j at positions anchors[:, j] + 0..T-1;
        context: [b, S, H] positions 0..S-1; anchors: [b, n]. Block j sees the context positions
        before its anchor and its own block (non-causal), as a round's block sees its cache.
        """
        b, S, _ = context.shape
        n = anchors.shape[1]
        T = x.shape[1] // n
        xb = x.reshape(b * n, T, -1)
        offsets = anchors.reshape(-1)  # [b*n]: one RoPE offset per block
        q = self.q_norm(self.q_proj(xb).reshape(b * n, T, self.n_heads, -1)).transpose(0, 2, 1, 3)
        q = self.rope(q, offset=offsets)  # [b*n, heads, T, D]
        k, v = self.keys_values(xb, offsets)  # [b*n, n_kv, T, D]
        ctx_k, ctx_v = self.keys_values(context, 0)  # [b, n_kv, S, D]

        def side_by_side(t: mx.array) -> mx.array:  # [b*n, h, T, D] -> [b, h, n*T, D]
            h = t.shape[1]
            return t.reshape(b, n, h, T, -1).transpose(0, 2, 1, 3, 4).reshape(b, h, n * T, -1)

        q = side_by_side(q)
        k = mx.concatenate([ctx_k, side_by_side(k)], axis=2)  # [b, n_kv, S + n*T, D]
        v = mx.concatenate([ctx_v, side_by_side(v)], axis=2)
        q_pos = (anchors[:, :, None] + mx.arange(T)).reshape(b, n * T)  # [b, n*T]
        q_anchor = mx.repeat(anchors, T, axis=1)  # [b, n*T]
        ctx_seen = mx.arange(S)[None, None] < q_anchor[:, :, None]  # [b, n*T, S]
        block_id = mx.arange(n * T) // T
        own_block = mx.broadcast_to(block_id[:, None] == block_id[None], (b, n * T, n * T))
        mask = mx.concatenate([ctx_seen, own_block], axis=2)  # [b, n*T, S + n*T]
        if self.window is not None:
            key_pos = mx.concatenate([mx.broadcast_to(mx.arange(S)[None], (b, S)), q_pos], axis=1)
            mask = mask & ((q_pos[:, :, None] - key_pos[:, None]) < self.window)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask[:, None])
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, n * T, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        gate, up = project_all([self.gate_proj, self.up_proj], x)
        return self.down_proj(nn.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(args, layer_idx)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, cache: Any, widths: Optional[mx.array] = None, masks: Optional[dict] = None) -> mx.array:
        # The context is already normalised (hidden_norm) and sits in the cache; only the block
        # goes through input_layernorm.
        h = x + self.self_attn(self.input_layernorm(x), cache, widths, masks)
        return h + self.mlp(self.post_attention_layernorm(h))

    def blocks(self, x: mx.array, context: mx.array, anchors: mx.array) -> mx.array:
        h = x + self.self_attn.blocks(self.input_layernorm(x), context, anchors)
        return h + self.mlp(self.post_attention_layernorm(h))


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        n_taps = len(args.target_layer_ids or [])
        self.fc = nn.Linear(n_taps * args.hidden_size, args.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def context_states(self, hidden: mx.array) -> mx.array:
        """[B, n, n_taps*H] concatenated target hidden states -> [B, n, H] context."""
        return self.hidden_norm(self.fc(hidden))

    def append_context(self, hidden: mx.array, cache: List[Any]) -> None:
        """Append the context K/V of ``hidden`` ([B, n, n_taps*H] target features of committed
        positions) to every layer's cache, each row at its own context length."""
        context = self.context_states(hidden)
        # every layer's K and V from the same context states: one launch for all where projections are routed
        kv = project_all([p for layer in self.layers for p in (layer.self_attn.k_proj, layer.self_attn.v_proj)], context)
        for i, (layer, c) in enumerate(zip(self.layers, cache)):
            layer.self_attn.append(context, c, kv[2 * i:2 * i + 2])

    def __call__(self, embeddings: mx.array, cache: List[Any], widths: Optional[mx.array] = None,
                 outputs: Optional[List[mx.array]] = None) -> mx.array:
        """The block's final hidden states [B, T, H] (normed): ``embeddings`` [B, T, H] of
        [last committed token, mask x (T-1)] attending to the context in ``cache``.
        ``widths`` [B]: real block positions per row (the rest pads the block).
        ``outputs``: each layer's output but the last appended (a caller evaluating the block in stages)."""
        h = embeddings
        masks: dict = {}
        for i, (layer, c) in enumerate(zip(self.layers, cache)):
            h = layer(h, c, widths, masks)
            if outputs is not None and i < len(self.layers) - 1:
                outputs.append(h)
        return self.norm(h)

    def blocks(self, embeddings: mx.array, hidden: mx.array, anchors: mx.array) -> mx.array:
        """Many blocks over one sequence's features in one forward (training, offline evaluation).

        embeddings: [b, n, T, H] blocks [token at the anchor, mask x (T-1)]; hidden: [b, S, taps*H]
        the target's features of positions 0..S-1; anchors: [b, n] (each <= S). Block j sees the
        features of positions < anchors[:, j], as ``__call__`` with those positions in its cache.
        Returns [b, n, T, H] normed states.
        """
        b, n, T, H = embeddings.shape
        context = self.context_states(hidden)
        h = embeddings.reshape(b, n * T, H)
        for layer in self.layers:
            h = layer.blocks(h, context, anchors)
        return self.norm(h).reshape(b, n, T, H)

    def make_cache(self, factory: Callable[[], Any] = KVCache) -> List[Any]:
        """One context cache per layer (``factory``: e.g. a padded KVCache on CUDA)."""
        return [factory() for _ in self.layers]

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        out = {}
        for k, v in weights.items():
            name = canonical_name(k)
            if name is not None:
                out[name] = v
        return out


_RENAMES = {"encoder.fc.": "fc.", "encoder.output_norm_enc.": "hidden_norm."}  # Muse assistant


def canonical_name(name: str) -> Optional[str]:
    """A checkpoint tensor's name in this Model, or None for tensors the drafter does not use.

    The target's embedding and head are used. speculators exports may carry copies (its lm_head
    is the verifier's, frozen) and the d2t/t2d maps of a full draft vocabulary.
    """
    if name.startswith("model."):
        name = name[len("model."):]
    for old, new in _RENAMES.items():
        if name.startswith(old):
            name = new + name[len(old):]
    if name.split(".")[0] in ("embed_tokens", "lm_head", "verifier_lm_head", "verifier_norm", "d2t", "t2d"):
        return None
    return name
