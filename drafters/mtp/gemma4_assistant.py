"""Gemma 4 assistant (``model_type: gemma4_assistant``): Google's MTP drafter for Gemma 4 targets.

A few Gemma 4 decoder layers (mlx-lm's ``gemma4_text.DecoderLayer``, all of them KV-shared: no
K/V projections) that attend over the TARGET's K/V: a ``sliding_attention`` layer over the K/V of
the target's last sliding-attention layer, a ``full_attention`` layer over its last full-attention
layer's. The assistant keeps no cache. One draft step for a row whose pending token sits at P:

    x = pre_projection(concat[target_embed(token) * sqrt(H_target), hidden])     # [B, 1, H]
    x = layers(x) with queries at position P over the target's keys at positions < P
    state = norm(x); hidden' = post_projection(state); logits = head(state)

``hidden`` is the target's final hidden state at P-1 after its final norm (HF's hidden_states[-1])
for the first step, then the previous step's ``hidden'``; ``token`` is the pending token, then
each draft. The query stays at P for the whole block. ``head``: the assistant's own tied
embedding (``model.embed_tokens``), or with ``use_ordered_embeddings`` the centroid-routed sparse
head (``masked_embedding``): ``centroids`` scores ``num_centroids`` clusters of
``vocab_size / num_centroids`` tokens each (``token_ordering`` lists them cluster by cluster), and
only the tokens of the ``centroid_intermediate_top_k`` best clusters get logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma4_text

NEG = float("-inf")


@dataclass
class ModelArgs:
    backbone_hidden_size: int
    text_config: Dict[str, Any] = field(default_factory=dict)
    use_ordered_embeddings: bool = False
    num_centroids: int = 2048
    centroid_intermediate_top_k: int = 32
    tie_word_embeddings: bool = True
    block_size: Optional[int] = None  # not in Google's config; mlx-vlm's field (its default: 4)

    @classmethod
    def from_dict(cls, config: Dict[str, Any]) -> "ModelArgs":
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in config.items() if k in names})

    def text(self) -> gemma4_text.ModelArgs:
        """The layers' args: every layer KV-shared (HF: num_kv_shared_layers 0 or unset means all)."""
        text = dict(self.text_config)
        text["num_kv_shared_layers"] = int(text.get("num_kv_shared_layers") or text["num_hidden_layers"])
        text["hidden_size_per_layer_input"] = 0
        return gemma4_text.ModelArgs.from_dict(text)


class MaskedHead(nn.Module):
    """The centroid-routed sparse head over the tied embedding."""

    def __init__(self, args: ModelArgs, hidden: int, vocab: int):
        super().__init__()
        self.top_k = args.centroid_intermediate_top_k
        self.num_centroids = args.num_centroids
        self.per_cluster = vocab // args.num_centroids
        self.centroids = nn.Linear(hidden, args.num_centroids, bias=False)
        self.token_ordering = mx.zeros((vocab,), dtype=mx.int32)  # cluster c: [c * per_cluster, (c+1) * per_cluster)
        self.freeze(keys="token_ordering", recurse=False)  # an index table, never trained

    def clusters(self, state: mx.array) -> mx.array:
        """[..., top_k] the selected clusters (unordered)."""
        scores = self.centroids(state)  # [..., num_centroids]
        return mx.stop_gradient(mx.argpartition(scores, kth=-self.top_k, axis=-1)[..., -self.top_k:])

    def select(self, state: mx.array, embed: mx.array) -> Tuple[mx.array, mx.array]:
        """(token ids [..., top_k * per_cluster], their logits) of the selected clusters' tokens."""
        ordering = self.token_ordering.reshape(self.num_centroids, self.per_cluster)
        ids = ordering[self.clusters(state)].reshape(*state.shape[:-1], -1)  # [..., K]
        rows = embed[ids]  # [..., K, H]
        return ids, (rows @ state[..., None])[..., 0]  # logits [..., K]

    def logits(self, state: mx.array, embed: mx.array, softcap: Optional[float] = None) -> mx.array:
        """[..., V]: the selected tokens' logits, -inf elsewhere (their probability is exactly 0)."""
        ids, logits = self.select(state, embed)
        if softcap:
            logits = mx.tanh(logits / softcap) * softcap
        full = mx.full((*state.shape[:-1], embed.shape[0]), NEG, dtype=logits.dtype)
        return mx.put_along_axis(full, ids, logits, axis=-1)


class Inner(nn.Module):
    def __init__(self, text: gemma4_text.ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(text.vocab_size, text.hidden_size)
        self.layers = [gemma4_text.DecoderLayer(text, i) for i in range(text.num_hidden_layers)]
        self.norm = nn.RMSNorm(text.hidden_size, eps=text.rms_norm_eps)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        text = args.text()
        self.text = text
        self.model = Inner(text)
        self.pre_projection = nn.Linear(2 * args.backbone_hidden_size, text.hidden_size, bias=False)
        self.post_projection = nn.Linear(text.hidden_size, args.backbone_hidden_size, bias=False)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False)
        if args.use_ordered_embeddings:
            self.masked_embedding = MaskedHead(args, text.hidden_size, text.vocab_size)
        self.softcap = self.text.final_logit_softcapping

    @property
    def layer_types(self) -> Tuple[str, ...]:
        return tuple(layer.layer_type for layer in self.model.layers)

    def __call__(self, x: mx.array, shared: Dict[str, Tuple[mx.array, mx.array]], masks: Dict[str, Any],
                 offset: Any) -> Tuple[mx.array, mx.array]:
        """x: [B, L, 2 * H_target] (embedding, hidden); ``shared``: per layer type the target's K/V
        ([B, n_kv, S, D] each); ``masks``: per layer type [B, 1, L, S] booleans; ``offset``: the
        queries' first position (an int, or [B]). Returns (hidden' [B, L, H_target], state [B, L, H])."""
        h = self.pre_projection(x)
        for layer in self.model.layers:
            h, _, _ = layer(h, masks[layer.layer_type], None, shared_kv=shared[layer.layer_type], offset=offset)
        state = self.model.norm(h)
        return self.post_projection(state), state

    def dense_logits(self, state: mx.array) -> mx.array:
        """[..., V] over the whole vocabulary (the tied embedding, or the untied lm_head)."""
        out = self.lm_head(state) if not self.args.tie_word_embeddings else self.model.embed_tokens.as_linear(state)
        return mx.tanh(out / self.softcap) * self.softcap if self.softcap else out

    def logits(self, state: mx.array) -> mx.array:
        """[..., V] the distribution the drafter samples from: sparse (-inf outside the selected
        clusters) with ordered embeddings, else dense."""
        if not self.args.use_ordered_embeddings:
            return self.dense_logits(state)
        return self.masked_embedding.logits(state, self.model.embed_tokens.weight, self.softcap)

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        out = {}
        for k, v in weights.items():
            if k == "masked_embedding.token_ordering":
                v = v.astype(mx.int32)
            if k == "lm_head.weight" and self.args.tie_word_embeddings:
                continue
            if any(s in k for s in (".self_attn.k_proj", ".self_attn.v_proj", ".self_attn.k_norm", "rotary_emb")):
                continue  # KV-shared layers have no K/V projections of their own
            out[k] = v
        for i in range(len(self.model.layers)):
            out.setdefault(f"model.layers.{i}.layer_scalar", mx.ones((1,)))
        return out
