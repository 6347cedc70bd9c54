"""EAGLE-3 drafter (arXiv 2503.01840): fc over three (or more) target layers, one decoder layer
whose attention takes [normed token embedding || hidden_norm(hidden)], its own lm_head over a
reduced draft vocabulary. Chain drafting: each step feeds its own output hidden state forward.

Layouts of config.json (``config_layout``), all read into one flat ``ModelArgs``:

- ``eagle``: SafeAILab EAGLE's own (``eagle/traineagle3/config.json``: ``LlamaForCausalLM`` with
  ``draft_vocab_size``; SpecForge's template is the same with ``LlamaForCausalLMEagle3``). No layer
  ids: the published default, hidden_states[2, N//2, N-3] (the INPUT of those decoder layers).
- ``specforge``: ``eagle_config.eagle_aux_hidden_state_layer_ids``; SGLang adds one before capturing
  (``layers_to_capture = [i + 1 ...]``, the input of layer i+1): the ids name the OUTPUT of layer i.
- ``speculators``: ``speculators_model_type: eagle3``, geometry in ``transformer_layer_config``,
  top-level ``eagle_aux_hidden_state_layer_ids`` (3 or more): vLLM's ``aux_hidden_state_layers``,
  the INPUT of layer i (hidden_states[i]; N = the last layer's output); flags ``norm_before_fc``,
  ``fc_norm``, ``norm_before_residual``, ``norm_output``.

In every layout fc reads the taps concatenated in ascending layer order, whatever order the ids are listed in.

Tensor names: fc, norm, lm_head, d2t, t2d, embed_tokens (optional), the first layer as
``midlayer.*`` (EAGLE, SpecForge) or ``layers.0.*`` (speculators), its hidden_norm inside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import BaseModelArgs, scaled_dot_product_attention
from mlx_lm.models.cache import KVCache
from mlx_lm.models.rope_utils import initialize_rope

INPUT, OUTPUT = "input", "output"  # what a layer id i names: hidden_states[i] (input of layer i), or layer i's output
SPECULATORS_ARCHS = ("Eagle3Speculator", "Eagle3DraftModel")
EAGLE_ARCHS = ("LlamaForCausalLMEagle3",)
CONVENTION = {"eagle": INPUT, "specforge": OUTPUT, "speculators": INPUT}
DEFAULT_BLOCK_SIZE = 8  # chain depth 7


def default_layer_ids(num_target_layers: int) -> List[int]:
    """The published default (EAGLE, SGLang, vLLM, speculators): hidden_states[2, N//2, N-3]."""
    n = num_target_layers
    return [2, n // 2, n - 3]


def config_layout(config: Dict[str, Any]) -> Optional[str]:
    """``eagle``, ``specforge``, ``speculators``, or None for a config that is no EAGLE-3 drafter."""
    archs = set(config.get("architectures") or [])
    spec = config.get("speculators_config") or {}
    if config.get("speculators_model_type") == "eagle3" or spec.get("algorithm") == "eagle3" or archs & set(SPECULATORS_ARCHS):
        return "speculators"
    if isinstance(config.get("eagle_config"), dict):
        return "specforge"
    if archs & set(EAGLE_ARCHS) or "draft_vocab_size" in config:
        return "eagle"
    return None


def normalize_config(config: Dict[str, Any]) -> Dict[str, Any]:
    """One flat dict with HF field names out of any of the three layouts."""
    layout = config_layout(config) or "eagle"
    flat = dict(config)
    ids = None
    if layout == "speculators":
        layer = dict(config.get("transformer_layer_config") or {})
        flat = {**layer, **{k: v for k, v in config.items() if k != "transformer_layer_config"}}
        flat["model_type"] = layer.get("model_type", "llama")
        ids = config.get("eagle_aux_hidden_state_layer_ids")
        methods = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
        flat["speculative_tokens"] = methods[0].get("speculative_tokens")
        flat["head_norm"] = True
    elif layout == "specforge":
        ids = config["eagle_config"].get("eagle_aux_hidden_state_layer_ids")
        # SpecForge's norm_output: whether the head reads norm(h) (speculators' means something else).
        flat["head_norm"] = bool(config.get("norm_output", True))
        flat["norm_output"] = False
    else:
        flat["head_norm"], flat["norm_output"] = True, False
    flat["aux_layer_ids"] = list(ids) if ids else None
    flat["layer_convention"] = CONVENTION[layout] if ids else INPUT
    flat["layout"] = layout
    if flat.get("use_sliding_window") is False:
        flat["sliding_window"] = None
    rope = flat.get("rope_parameters")
    if isinstance(rope, dict):
        flat.setdefault("rope_theta", rope.get("rope_theta"))
    return {k: v for k, v in flat.items() if v is not None or k == "sliding_window"}


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str = "llama"
    hidden_size: int = 4096
    num_hidden_layers: int = 1
    intermediate_size: int = 14336
    num_attention_heads: int = 32
    num_key_value_heads: Optional[int] = None
    head_dim: Optional[int] = None
    rms_norm_eps: float = 1e-5
    vocab_size: int = 128256
    draft_vocab_size: Optional[int] = None
    target_hidden_size: Optional[int] = None
    rope_theta: float = 10000.0
    rope_scaling: Optional[Dict[str, Any]] = None
    max_position_embeddings: Optional[int] = None
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    layer_types: Optional[List[str]] = None
    sliding_window: Optional[int] = None
    tie_word_embeddings: bool = False
    architectures: List[str] = field(default_factory=list)
    layout: str = "eagle"
    aux_layer_ids: Optional[List[int]] = None  # as the checkpoint names them (None: the default)
    layer_convention: str = INPUT
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False  # speculators: the next draft step reads norm(h) instead of h
    head_norm: bool = True  # the head reads norm(h) (SpecForge's norm_output: false reads h)
    speculative_tokens: Optional[int] = None

    @classmethod
    def from_dict(cls, params: Dict[str, Any]) -> "ModelArgs":
        return super().from_dict(normalize_config(params))

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.draft_vocab_size is None:
            self.draft_vocab_size = self.vocab_size
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers

    @property
    def taps(self) -> int:
        return len(self.aux_layer_ids) if self.aux_layer_ids else 3

    @property
    def feature_size(self) -> int:
        """Width of one captured target layer (fc reads taps x this)."""
        return int(self.target_hidden_size or self.hidden_size)

    def layer_ids(self, num_target_layers: int) -> List[int]:
        """fc's taps in its input order: the checkpoint's ids in ascending layer order whatever order its config
        lists them (vLLM and mlx-vlm append each tap as the target's layer loop passes it; every published
        config lists them ascending), else the published default."""
        return sorted(self.aux_layer_ids) if self.aux_layer_ids else default_layer_ids(num_target_layers)

    def capture_layers(self, num_target_layers: int) -> List[int]:
        """Target decoder layers whose OUTPUT is read (0-based), in fc's input order."""
        shift = 1 if self.layer_convention == INPUT else 0
        return [i - shift for i in self.layer_ids(num_target_layers)]


class Unrolled:
    """One layer's keys and values while training unrolls the chain (training-time test): step 0
    over every position, later steps at each position alone (step s at index t is position t + s)."""

    def __init__(self) -> None:
        self.step = 0
        self.k0: Optional[mx.array] = None
        self.v0: Optional[mx.array] = None
        self.later: List[Tuple[mx.array, mx.array]] = []


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int, in_dim: int):
        super().__init__()
        self.n_heads, self.n_kv_heads, hd = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        self.scale = hd**-0.5
        bias = args.attention_bias
        self.q_proj = nn.Linear(in_dim, self.n_heads * hd, bias=bias)
        self.k_proj = nn.Linear(in_dim, self.n_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(in_dim, self.n_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * hd, args.hidden_size, bias=bias)
        self.qk_norm = args.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
            self.k_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
        self.rope = initialize_rope(hd, args.rope_theta, False, args.rope_scaling, args.max_position_embeddings)
        self.window = args.sliding_window if args.layer_types[layer_idx] == "sliding_attention" else None

    def qkv(self, x: mx.array, offset: Any) -> Tuple[mx.array, mx.array, mx.array]:
        """[B, heads, T, D] queries and [B, kv_heads, T, D] keys, values at positions offset.. (int or [B])."""
        B, T, _ = x.shape
        q = self.q_proj(x).reshape(B, T, self.n_heads, -1)
        k = self.k_proj(x).reshape(B, T, self.n_kv_heads, -1)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        v = self.v_proj(x).reshape(B, T, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        q, k = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)
        return self.rope(q, offset=offset), self.rope(k, offset=offset), v

    def __call__(self, x: mx.array, cache: Any) -> mx.array:
        if isinstance(cache, Unrolled):
            return self.unrolled(x, cache)
        B, T, _ = x.shape
        q, k, v = self.qkv(x, cache.offset)
        mask = cache.make_mask(T, return_array=False, window_size=self.window)
        k, v = cache.update_and_fetch(k, v)
        out = scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, T, -1))

    def unrolled(self, x: mx.array, mem: Unrolled) -> mx.array:
        """Step ``mem.step`` of the unrolled chain, x: [b, T, in] (index t at position t + step).

        Index t sees what decoding's draft step at position t + s sees: step 0's positions <= t
        (the target's features) and steps 1..s at index t (its own earlier chain positions)."""
        b, T, _ = x.shape
        s = mem.step
        q, k, v = self.qkv(x, s)
        if s == 0:
            mem.k0, mem.v0 = k, v
        else:
            mem.later.append((k, v))
        rep = self.n_heads // self.n_kv_heads
        expand = (lambda a: mx.repeat(a, rep, axis=1)) if rep > 1 else (lambda a: a)  # noqa: E731
        scores = (q * self.scale) @ expand(mem.k0).transpose(0, 1, 3, 2)  # [b, h, T, T]
        t = mx.arange(T)
        seen = t[None] <= t[:, None]  # [T(query), T(key)]
        if self.window is not None:
            seen = seen & ((t[:, None] + s - t[None]) < self.window)
        scores = mx.where(seen, scores, mx.finfo(scores.dtype).min)
        later = [((q * self.scale) * expand(kj)).sum(-1, keepdims=True) for kj, _ in mem.later]  # [b, h, T, 1] each
        if self.window is not None:
            later = [mx.where(s - j < self.window, l, mx.finfo(l.dtype).min) for j, l in enumerate(later, 1)]
        p = mx.softmax(mx.concatenate([scores, *later], axis=-1), axis=-1, precise=True)  # [b, h, T, T + s]
        out = p[..., :T] @ expand(mem.v0)
        for j, (_, vj) in enumerate(mem.later):
            out = out + p[..., T + j : T + j + 1] * expand(vj)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, T, -1))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim, hidden, bias = args.hidden_size, args.intermediate_size, args.mlp_bias
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class FirstLayer(nn.Module):
    """EAGLE-3's decoder layer: attention over [input_layernorm(embedding) || hidden_norm(hidden)],
    the residual stream is the hidden state (normed first with ``norm_before_residual``)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.norm_before_residual = args.norm_before_residual
        self.self_attn = Attention(args, 0, 2 * args.hidden_size)
        self.mlp = MLP(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.hidden_norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, emb: mx.array, hidden: mx.array, cache: Any) -> mx.array:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        h = residual + self.self_attn(mx.concatenate([self.input_layernorm(emb), normed], axis=-1), cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderLayer(nn.Module):
    """Layers after the first (speculators drafters with num_hidden_layers > 1): plain llama layers."""

    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(args, layer_idx, args.hidden_size)
        self.mlp = MLP(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, cache: Any) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Model(nn.Module):
    def __init__(self, args: ModelArgs, own_embedding: bool = False):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        H, F = args.hidden_size, args.taps * args.feature_size
        if own_embedding:
            self.embed_tokens = nn.Embedding(args.vocab_size, H)
        if args.norm_before_fc:
            self.input_norm = nn.RMSNorm(F, eps=args.rms_norm_eps)
        if args.fc_norm:
            self.fc_norm = [nn.RMSNorm(args.feature_size, eps=args.rms_norm_eps) for _ in range(args.taps)]
        self.fc = nn.Linear(F, H, bias=False)
        self.layers = [FirstLayer(args)] + [DecoderLayer(args, i) for i in range(1, args.num_hidden_layers)]
        self.norm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.lm_head = nn.Linear(H, args.draft_vocab_size, bias=False)

    def project(self, features: mx.array) -> mx.array:
        """[B, n, taps*F] captured target states (fc's input order) -> [B, n, H]."""
        if self.args.norm_before_fc:
            features = self.input_norm(features)
        if self.args.fc_norm:
            parts = mx.split(features, self.args.taps, axis=-1)
            features = mx.concatenate([norm(p) for norm, p in zip(self.fc_norm, parts)], axis=-1)
        return self.fc(features)

    def __call__(self, emb: mx.array, hidden: mx.array, cache: List[Any]) -> mx.array:
        """[B, T, H] raw output states: ``emb`` [B, T, H] token embeddings, ``hidden`` [B, T, H]
        (projected features, or the previous step's ``carry``), positions at the caches' offsets."""
        h = self.layers[0](emb, hidden, cache[0])
        for layer, c in zip(self.layers[1:], cache[1:]):
            h = layer(h, c)
        return h

    def logits(self, h: mx.array) -> mx.array:
        """[..., draft_vocab_size] over the draft vocabulary."""
        return self.lm_head(self.norm(h) if self.args.head_norm else h)

    def carry(self, h: mx.array) -> mx.array:
        """What the next draft step reads as its hidden state."""
        return self.norm(h) if self.args.norm_output else h

    def unrolled(self, embs: List[mx.array], hidden: mx.array) -> List[mx.array]:
        """The chain over every position at once (training, offline evaluation).

        ``hidden`` [b, T, H]: projected features of positions 0..T-1; ``embs[s]`` [b, T, H]: the
        token embedding step s reads at index t (the token at position t + 1 + s). Returns the raw
        output states of each step, [b, T, H] each: step s at index t is decoding's draft step
        s + 1 for a round whose pending token is at position t + 1."""
        mems = [Unrolled() for _ in self.layers]
        out: List[mx.array] = []
        for s, emb in enumerate(embs):
            for m in mems:
                m.step = s
            out.append(self(emb, hidden if s == 0 else self.carry(out[-1]), mems))
        return out

    def make_cache(self, factory: Callable[[], Any] = KVCache) -> List[Any]:
        """One cache per layer (``factory``: e.g. a padded KVCache on CUDA); sliding layers keep KVCache."""
        return [KVCache() if layer.self_attn.window is not None else factory() for layer in self.layers]

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        out = {}
        for k, v in weights.items():
            name = canonical_name(k)
            if name is not None:
                out[name] = v
        return out


DROPPED = ("d2t", "t2d", "verifier_lm_head", "verifier_norm")


def canonical_name(name: str) -> Optional[str]:
    """A checkpoint tensor's name in ``Model``, or None for tensors that are no parameter of it
    (the vocabulary maps are read apart; speculators' frozen verifier head and norm are unused)."""
    if name.startswith("model."):
        name = name[len("model."):]
    if name.startswith("midlayer."):
        name = "layers.0." + name[len("midlayer."):]
    return None if name.split(".")[0] in DROPPED else name


def checkpoint_name(name: str, layout: str) -> str:
    """``Model``'s parameter name as the layout writes it."""
    if layout != "speculators" and name.startswith("layers.0."):
        return "midlayer." + name[len("layers.0."):]
    return name
