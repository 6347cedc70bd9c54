"""The unrolled training forwards of MTP drafters (``train.py``): every position at once, each draft
step as decoding chains it. Step s at index i predicts token i + s + 1 for both kinds of drafter."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from ...hooks.api import taps


class Context:
    """A stand-in for a head layer's cache in training: the rope offset of the block it is given, and
    the keys / values of earlier steps put before the block's own (``update_and_fetch``)."""

    def __init__(self, offset: int, keys: List[mx.array], values: List[mx.array]):
        self.offset = offset
        self.keys, self.values = keys, values
        self.new: Tuple[mx.array, mx.array] = (mx.array(0), mx.array(0))

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Tuple[mx.array, mx.array]:
        self.new = (keys, values)
        return mx.concatenate(self.keys + [keys], axis=2), mx.concatenate(self.values + [values], axis=2)


def head_mask(n: int, step: int) -> mx.array:
    """[n, step * n]: step ``step``'s entry i attends to step-1 entries <= i (its context), to the entries
    of its own chain at the steps between (index i each), and to itself."""
    i = mx.arange(n)
    blocks = [i[None, :] <= i[:, None]] + [i[None, :] == i[:, None]] * (step - 1)
    return mx.concatenate(blocks, axis=1)


def head_steps(model: nn.Module, embed: Callable[[mx.array], mx.array], head: Callable[[mx.array], mx.array],
               tokens: mx.array, hidden: mx.array, steps: int) -> List[mx.array]:
    """Per step, logits [b, L-1, V]: step s at index i reads token i + s and step s-1's output at i
    (step 1: the target's hidden state at i), at position i + s - 1."""
    L = tokens.shape[1]
    n = L - 1
    emb = embed(tokens).astype(hidden.dtype)  # [b, L, H]
    h = hidden[:, :n]
    keys: List[mx.array] = []
    values: List[mx.array] = []
    out = []
    for s in range(1, steps + 1):
        cache = Context(s - 1, keys, values)
        h = model(emb[:, mx.minimum(mx.arange(n) + s, L - 1)], h, [cache], mask=head_mask(n, s))  # [b, n, H]
        keys, values = keys + [cache.new[0]], values + [cache.new[1]]
        out.append(head(h))
    return out


def layer_kv(model: nn.Module, index: int, x: mx.array) -> Tuple[mx.array, mx.array]:
    """The K/V the target's decoder layer ``index`` writes for its input ``x`` [b, L, H] (the output of
    layer index - 1): the layer itself runs on a fresh cache; its output is not used."""
    layer = taps.decoder_layers(model)[index]
    cache = KVCache()
    layer(x, None, cache)
    return cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :]  # [b, n_kv, L, D]


def flat(x: mx.array) -> mx.array:
    """[b, n_kv, L, D] -> [b, L, n_kv * D]."""
    b, h, L, d = x.shape
    return x.transpose(0, 2, 1, 3).reshape(b, L, h * d)


def assistant_masks(L: int, window: int) -> Dict[str, mx.array]:
    """[L-1, L] per layer type: the query of pending position p = i + 1 reads keys j < p (and, sliding,
    p - j < window)."""
    p = mx.arange(1, L)[:, None]
    j = mx.arange(L)[None, :]
    full = j < p
    return {"full_attention": full, "sliding_attention": full & (p - j < window)}


def assistant_steps(model: nn.Module, embed: Callable[[mx.array], mx.array], tokens: mx.array, feats: mx.array,
                    kv: Dict[str, Tuple[int, int]], steps: int, window: int) -> List[mx.array]:
    """Per step, the assistant's normed state [b, L-1, H] for pending positions p = 1 .. L-1 (index
    p - 1): step s reads token p + s - 1 and step s-1's hidden' (step 1: the target's final hidden
    state at p - 1); the queries sit at p throughout, over the target's K/V of positions < p."""
    b, L = tokens.shape
    n = L - 1
    Hb = model.args.backbone_hidden_size
    offset, shared = Hb, {}
    for kind in sorted(kv):
        heads, dim = kv[kind]
        w = heads * dim
        unflat = lambda x: x.reshape(b, L, heads, dim).transpose(0, 2, 1, 3)  # noqa: E731
        shared[kind] = (unflat(feats[..., offset:offset + w]), unflat(feats[..., offset + w:offset + 2 * w]))
        offset += 2 * w
    masks = assistant_masks(L, window)
    emb = embed(tokens).astype(feats.dtype)
    h = feats[:, :n, :Hb]
    out = []
    for s in range(1, steps + 1):
        x = mx.concatenate([emb[:, mx.minimum(mx.arange(n) + s, L - 1)], h], axis=-1)
        h, state = model(x, shared, masks, 1)
        out.append(state)
    return out


def _labels(tokens: mx.array, step: int, first: int) -> Tuple[mx.array, mx.array]:
    """(labels [b, L-1], valid [L-1]): token i + step + 1, where it is one of the target's own."""
    L = tokens.shape[1]
    pos = mx.arange(L - 1) + step + 1
    labels = tokens[:, mx.minimum(pos, L - 1)]
    return labels, ((pos <= L - 1) & (pos > first)).astype(mx.float32)


def unrolled_loss(logits: List[mx.array], tokens: mx.array, first: int) -> mx.array:
    total = mx.array(0.0)
    for s, lg in enumerate(logits, start=1):
        labels, valid = _labels(tokens, s, first)
        ce = nn.losses.cross_entropy(lg.astype(mx.float32), labels)  # [b, L-1]
        total = total + (ce * valid).sum() / mx.maximum(valid.sum() * tokens.shape[0], 1)
    return total / len(logits)


def cluster_loss(model: Any, states: List[mx.array], tokens: mx.array, first: int) -> mx.array:
    """The sparse head's centroids: cross-entropy of the cluster that holds the target's token."""
    head = model.masked_embedding
    cluster = mx.argsort(head.token_ordering) // head.per_cluster  # [V]: token -> its cluster
    total = mx.array(0.0)
    for s, state in enumerate(states, start=1):
        labels, valid = _labels(tokens, s, first)
        ce = nn.losses.cross_entropy(head.centroids(state).astype(mx.float32), cluster[labels])
        total = total + (ce * valid).sum() / mx.maximum(valid.sum() * tokens.shape[0], 1)
    return total / len(states)
