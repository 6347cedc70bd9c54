"""Qwen3.5 / Qwen3.6 / Qwen3-Next multi-token-prediction head (the checkpoints' ``mtp.*`` tensors).

One step: h = fc(concat[pre_fc_norm_embedding(embed(token_{t+1})), pre_fc_norm_hidden(hidden_t)])
at position t, then one full-attention decoder layer of the target's own kind (gated attention,
partial RoPE; MoE where the target is MoE) with its own KV cache, then ``norm``; the target's
lm_head reads the result. ``hidden_t`` is the target's final hidden state AFTER its final norm (what
its lm_head reads, as vLLM and SGLang hand it over); a deeper draft step reads this head's own
normed output instead. The decoder layer is mlx-lm's own class for the target's model type.

Tensor names: ``mtp.fc``, ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``,
``mtp.layers.0.*``, ``mtp.norm`` inside the target's shards (Hugging Face layout: zero-centred
RMSNorm weights, experts per expert or fused ``gate_up_proj``); the same without ``mtp.`` and in
mlx-lm's layout (norms + 1, experts stacked as ``switch_mlp``) in mlx-vlm's standalone split
(``model_type: qwen3_5_mtp``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

QWEN3_5_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
QWEN3_NEXT_TYPES = ("qwen3_next",)
STANDALONE_TYPE = "qwen3_5_mtp"  # mlx-vlm's split_mtp output
# HF Qwen3.5/Qwen3-Next RMSNorms scale by (1 + weight); mlx-lm stores weight + 1.
NORM_SUFFIXES = ("norm.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight")


def text_config(config: Dict[str, Any]) -> Dict[str, Any]:
    """The language model's fields: ``text_config`` (Qwen3.5, the standalone split) or the top level (Qwen3-Next)."""
    text = config.get("text_config")
    return dict(text) if isinstance(text, dict) else dict(config)


def layer_family(text: Dict[str, Any]) -> str:
    """'qwen3_5' or 'qwen3_next': whose mlx-lm decoder layer the head's layer is."""
    kind = str(text.get("model_type", ""))
    if kind in QWEN3_NEXT_TYPES:
        return "qwen3_next"
    if kind in QWEN3_5_TYPES:
        return "qwen3_5"
    raise ValueError(f"text_config.model_type: {kind!r}; allowed: {', '.join(QWEN3_5_TYPES + QWEN3_NEXT_TYPES)}")


@dataclass
class ModelArgs:
    text: Dict[str, Any]  # the language model's config fields (HF names)
    block_size: Optional[int] = None  # the standalone split's default block (mlx-vlm: depth + 2)

    @property
    def hidden_size(self) -> int:
        return int(self.text["hidden_size"])

    @property
    def rms_norm_eps(self) -> float:
        return float(self.text.get("rms_norm_eps", 1e-6))

    @property
    def depth(self) -> int:
        return int(self.text.get("mtp_num_hidden_layers") or 1)

    @property
    def vocab_size(self) -> int:
        return int(self.text["vocab_size"])

    @classmethod
    def from_dict(cls, config: Dict[str, Any]) -> "ModelArgs":
        return cls(text_config(config), config.get("block_size"))

    def layer(self) -> nn.Module:
        """The head's decoder layer: mlx-lm's class for the target's type, always full attention."""
        if layer_family(self.text) == "qwen3_next":
            from mlx_lm.models import qwen3_next

            args = qwen3_next.ModelArgs.from_dict({**self.text, "full_attention_interval": 1, "mlp_only_layers": []})
            return qwen3_next.Qwen3NextDecoderLayer(args, 0)
        from mlx_lm.models import qwen3_5

        args = qwen3_5.TextModelArgs.from_dict({**self.text, "full_attention_interval": 1, "num_hidden_layers": 1})
        return qwen3_5.DecoderLayer(args, 0)


class Model(nn.Module):
    """The head: [B, L] (embedding, hidden) pairs -> normed hidden states [B, L, H]."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        H, eps = args.hidden_size, args.rms_norm_eps
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(H, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(H, eps=eps)
        self.layers = [args.layer()]
        self.norm = nn.RMSNorm(H, eps=eps)

    def __call__(self, embeds: mx.array, hidden: mx.array, cache: List[Any], mask: Any = None) -> mx.array:
        """embeds (of token t+1) and hidden (of position t): [B, L, H] each; positions start at the
        cache's offset. ``mask``: None for the causal mask over the cache."""
        h = self.fc(mx.concatenate([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], axis=-1))
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask if mask is not None else create_attention_mask(h, c), c)
        return self.norm(h)  # [B, L, H]

    def make_cache(self, factory: Callable[[], Any] = KVCache) -> List[Any]:
        return [factory() for _ in self.layers]

    @staticmethod
    def sanitize(weights: Dict[str, mx.array], hf_layout: bool) -> Dict[str, mx.array]:
        """Tensors of the checkpoint -> this module's parameter names and conventions.

        ``hf_layout``: the tensors come as Hugging Face saved them (inside the target's shards):
        ``mtp.`` prefix, zero-centred norms, experts not stacked. Otherwise mlx-vlm's split (mlx).
        """
        out: Dict[str, mx.array] = {}
        for key, value in weights.items():
            if key.startswith("mtp."):
                key = key[len("mtp."):]
            if hf_layout and key.endswith(NORM_SUFFIXES) and value.ndim == 1:
                value = value + 1.0
            out[key] = value
        return stack_experts(out)


_EXPERT = re.compile(r"(.*)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|scales|biases)$")


def stack_experts(weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
    """Per-expert (Qwen3-Next) or fused ``gate_up_proj`` (Qwen3.5-MoE) tensors -> mlx-lm's ``switch_mlp``."""
    out = dict(weights)
    for key in [k for k in out if k.endswith(".experts.gate_up_proj")]:
        base = key[: -len(".experts.gate_up_proj")]
        gate_up = out.pop(key)  # [E, 2 * I, H]: gate rows first
        mid = gate_up.shape[-2] // 2
        out[f"{base}.switch_mlp.gate_proj.weight"] = gate_up[..., :mid, :]
        out[f"{base}.switch_mlp.up_proj.weight"] = gate_up[..., mid:, :]
        out[f"{base}.switch_mlp.down_proj.weight"] = out.pop(f"{base}.experts.down_proj")
    groups: Dict[tuple, Dict[int, str]] = {}
    for key in out:
        m = _EXPERT.fullmatch(key)
        if m:
            groups.setdefault((m[1], m[3], m[4]), {})[int(m[2])] = key
    for (base, proj, suffix), keys in groups.items():
        if sorted(keys) != list(range(len(keys))):
            raise ValueError(f"{base}.experts: expert indices {sorted(keys)} are not 0..{len(keys) - 1}")
        out[f"{base}.switch_mlp.{proj}.{suffix}"] = mx.stack([out.pop(keys[e]) for e in range(len(keys))])
    return out



def sanitized_names(names: List[str]) -> List[str]:
    """The parameter names ``Model.sanitize`` makes of these tensor names (no tensor is read)."""
    out = set()
    for name in names:
        name = name[len("mtp."):] if name.startswith("mtp.") else name
        m = _EXPERT.fullmatch(name)
        if name.endswith(".experts.gate_up_proj"):
            base = name[: -len(".experts.gate_up_proj")]
            out |= {f"{base}.switch_mlp.gate_proj.weight", f"{base}.switch_mlp.up_proj.weight"}
        elif name.endswith(".experts.down_proj"):
            out.add(f"{name[: -len('.experts.down_proj')]}.switch_mlp.down_proj.weight")
        elif m:
            out.add(f"{m[1]}.switch_mlp.{m[3]}.{m[4]}")
        else:
            out.add(name)
    return sorted(out)
