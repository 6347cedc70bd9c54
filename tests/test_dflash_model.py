"""The DFlash drafter forward against a naive, independent recomputation of its definition:
context = hidden_norm(fc(target states)) as extra K/V in every layer, block non-causal, RoPE
positions continuing from the context (HF rotate-half, partial rotary), sliding windows, GQA."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from mlx_speculative.drafters.dflash import tiny
from mlx_speculative.drafters.dflash.model import Model, ModelArgs

pytestmark = pytest.mark.unit

FIXTURES = Path(__file__).parent / "fixtures" / "dflash"


def rms(x: mx.array, w: mx.array, eps: float) -> mx.array:
    return x * mx.rsqrt((x * x).mean(axis=-1, keepdims=True) + eps) * w


def rope(x: mx.array, pos: mx.array, dims: int, base: float) -> mx.array:
    """HF rotate-half RoPE on the first ``dims`` features of x: [L, heads, D], pos: [L]."""
    half = dims // 2
    inv = base ** (-mx.arange(0, dims, 2).astype(mx.float32) / dims)  # [half]
    ang = pos.astype(mx.float32)[:, None] * inv[None]  # [L, half]
    cos, sin = mx.cos(ang)[:, None], mx.sin(ang)[:, None]
    x1, x2, rest = x[..., :half], x[..., half:dims], x[..., dims:]
    return mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)


def naive(model: Model, emb: mx.array, hidden: mx.array) -> mx.array:
    """emb [T, H] of the block at positions n..n+T-1; hidden [n, taps*H] of positions 0..n-1."""
    a = model.args
    eps, hd, T, n = a.rms_norm_eps, a.head_dim, emb.shape[0], hidden.shape[0]
    dims = int(hd * a.partial_rotary_factor)
    ctx = rms(hidden @ model.fc.weight.T, model.hidden_norm.weight, eps)  # [n, H]
    q_pos, k_pos = mx.arange(n, n + T), mx.arange(n + T)
    h = emb
    for i, layer in enumerate(model.layers):
        at = layer.self_attn
        x = rms(h, layer.input_layernorm.weight, eps)
        kv_in = mx.concatenate([ctx, x], axis=0)  # [n+T, H]: context, then the block
        q = rope(rms((x @ at.q_proj.weight.T).reshape(T, -1, hd), at.q_norm.weight, eps), q_pos, dims, a.rope_theta)
        k = rope(rms((kv_in @ at.k_proj.weight.T).reshape(n + T, -1, hd), at.k_norm.weight, eps), k_pos, dims, a.rope_theta)
        v = (kv_in @ at.v_proj.weight.T).reshape(n + T, -1, hd)
        groups = q.shape[1] // k.shape[1]
        k, v = mx.repeat(k, groups, axis=1), mx.repeat(v, groups, axis=1)
        scores = mx.einsum("thd,shd->hts", q, k) / math.sqrt(hd)  # [heads, T, n+T]
        if a.layer_types[i] == "sliding_attention" and a.sliding_window is not None:
            allowed = (q_pos[:, None] - k_pos[None]) < a.sliding_window  # non-causal inside the block
            scores = mx.where(allowed[None], scores, -mx.inf)
        out = mx.einsum("hts,shd->thd", mx.softmax(scores, axis=-1), v).reshape(T, -1)
        h = h + out @ at.o_proj.weight.T
        m = rms(h, layer.post_attention_layernorm.weight, eps)
        mlp = layer.mlp
        h = h + ((mx.sigmoid(m @ mlp.gate_proj.weight.T) * (m @ mlp.gate_proj.weight.T)) * (m @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T
    return rms(h, model.norm.weight, eps)


@pytest.mark.parametrize("name, window", [
    ("z-lab__Qwen3.5-4B-DFlash", 8),  # sliding layer, window smaller than the context
    ("z-lab__Qwen3-8B-DFlash-b16", None),
    ("speculators-issue-613__dflash-qwen3.6-35b-a3b", None),  # partial rotary 0.25
])
def test_forward_matches_naive_definition(name: str, window: Any, tmp_path: Path) -> None:
    real = json.loads((FIXTURES / f"{name}.config.json").read_text())
    config = tiny.shrink_config(real, target_layer_ids=[0, 1, 3], mask_token_id=383, num_target_layers=4,
                                sliding_window=window)
    config_dir = tiny.write_checkpoint(tmp_path / "d", config, seed=7)
    args = ModelArgs.from_dict(json.loads((config_dir / "config.json").read_text()))
    model = Model(args)
    model.load_weights(list(model.sanitize(mx.load(str(config_dir / "model.safetensors"))).items()))
    mx.random.seed(0)
    n, T = 20, 6
    hidden = mx.random.normal((1, n, 3 * args.hidden_size))
    emb = mx.random.normal((1, T, args.hidden_size))
    expect = naive(model, emb[0], hidden[0])  # [T, H]
    # In one go, and with the context fed in chunks over earlier rounds (what a batch's prepare does).
    cache = model.make_cache()
    model.append_context(hidden, cache)
    once = model(emb, cache)[0]
    cache = model.make_cache()
    for lo, hi in ((0, 7), (7, 8), (8, 15)):
        model.append_context(hidden[:, lo:hi], cache)
        model(emb[:, :3], cache)  # a round's block between the appends writes nothing
    model.append_context(hidden[:, 15:], cache)
    chunked = model(emb, cache)[0]
    assert mx.allclose(once, expect, atol=1e-4).item()
    assert mx.allclose(chunked, expect, atol=1e-4).item()
    assert cache[0].offset == n

    # Rows of a batch: contexts of different lengths (merged caches, left padding), one block
    # forward for both, and a row whose block is shorter (widths): each row equals its own definition.
    from mlx_speculative.hooks.batch import merge_rows

    short = model.make_cache()
    model.append_context(hidden[:, :11], short)
    full = model.make_cache()
    model.append_context(hidden, full)
    batched = merge_rows([short, full])
    out = model(mx.concatenate([emb, emb]), batched, mx.array([4, T]))  # [2, T, H]
    assert mx.allclose(out[1], expect, atol=1e-4).item()
    expect_short = naive(model, emb[0, :4], hidden[0, :11])
    assert mx.allclose(out[0, :4], expect_short, atol=1e-4).item()
