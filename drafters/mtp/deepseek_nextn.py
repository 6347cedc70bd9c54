"""DeepSeek-V3 multi-token-prediction ("nextn") layer, stored in the target's own checkpoint as decoder
layer ``model.layers.{num_hidden_layers}`` (``num_nextn_predict_layers: 1``).

One step at position t: h = eh_proj(concat[enorm(embed(token_{t+1})), hnorm(hidden_t)]) (the embedding
is zeroed at position 0), then a full decoder block of the target's kind (MLA attention with its own
KV cache; MoE where layer N would be MoE: mlx-lm's ``DeepseekV3DecoderLayer``), whose output feeds the
next step; logits = shared_head.head(shared_head.norm(h)). ``hidden_t`` is the target's final hidden
state after its final norm (as vLLM and SGLang hand it over). The layer's own ``embed_tokens`` copy
equals the target's embedding and is not read; the target's is used.

Tensor names under ``model.layers.{N}.``: ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``,
``shared_head.head``, ``embed_tokens`` and the block's (``self_attn.*`` with ``kv_b_proj``, ``mlp.*`` per
expert, ``input_layernorm``, ``post_attention_layernorm``; fp8 with ``weight_scale_inv`` in the
published checkpoint), turned into mlx-lm's layout by the target model's own ``sanitize``.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache
from mlx_lm.models.deepseek_v3 import DeepseekV3DecoderLayer, ModelArgs

OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")  # the layer's own tensors, beside its block
SKIPPED = ("embed_tokens.",)  # the target's embedding is used instead


def layer_prefix(config: Dict[str, Any], k: int = 0) -> str:
    return f"model.layers.{int(config['num_hidden_layers']) + k}."


class SharedHead(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)


class Model(nn.Module):
    """The nextn layer: [B, L] (embedding, hidden) pairs -> the block's output [B, L, H]."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        H = args.hidden_size
        self.enorm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.hnorm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.block = DeepseekV3DecoderLayer(args, args.num_hidden_layers)
        self.shared_head = SharedHead(args)

    def __call__(self, embeds: mx.array, hidden: mx.array, cache: List[Any], mask: Any = None) -> mx.array:
        c = cache[0]
        if isinstance(getattr(c, "offset", None), int) and c.offset == 0:
            embeds = mx.concatenate([mx.zeros_like(embeds[:, :1]), embeds[:, 1:]], axis=1)  # position 0: no token before
        h = self.eh_proj(mx.concatenate([self.enorm(embeds), self.hnorm(hidden)], axis=-1))
        if mask is None and h.shape[1] > 1:
            mask = create_attention_mask(h, c, return_array=True)  # MLA takes boolean masks only
        return self.block(h, mask, c)

    def logits(self, h: mx.array) -> mx.array:
        return self.shared_head.head(self.shared_head.norm(h))

    def make_cache(self, factory: Callable[[], Any] = KVCache) -> List[Any]:
        return [factory()]

    @staticmethod
    def rename(weights: Dict[str, mx.array], prefix: str) -> Dict[str, mx.array]:
        """``model.layers.{N}.`` tensors -> ``model.layers.0.`` (what the target's sanitize converts:
        fp8 blocks, per-expert weights, ``kv_b_proj``); the embedding copy left out."""
        return {"model.layers.0." + k[len(prefix):]: v for k, v in weights.items()
                if k.startswith(prefix) and not k[len(prefix):].startswith(SKIPPED)}

    @staticmethod
    def parameters_from(sanitized: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """The target sanitize's ``model.layers.0.`` names -> this module's."""
        out = {}
        for k, v in sanitized.items():
            rest = k[len("model.layers.0."):]
            out[rest if rest.startswith(OWN) else "block." + rest] = v
        return out
