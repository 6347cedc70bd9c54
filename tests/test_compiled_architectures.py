"""Compiled verify forwards on mlx-lm's architectures: the plain forward's logits bit for bit, or a decline.

Each architecture is a tiny random model built from mlx-lm's own classes (fp32, CPU) with padded caches
after a 19-token prefill; three forwards of 4, 16 and 8 positions follow, one by the plain forward and
one by the compiled forward on a copy of the caches. Full-attention models (their caches all
``PaddedKVCache``) must take the compiled path and match exactly; models with rotating, recurrent or
mixed caches must be declined ("caches") and keep the plain forward.
"""

from __future__ import annotations

import copy
from typing import Any, Dict

import mlx.core as mx
import pytest

from mlx_speculative.hooks import recurrent
from mlx_speculative.testing import tiny_models as tm
from mlx_speculative.hooks.batch import forward
from mlx_speculative.plugin.cuda import backend as cuda_backend, compiled

pytestmark = pytest.mark.unit

BASE = tm.llama_config(num_hidden_layers=2)
# The keys the llama-like families below read besides llama's (unknown keys are dropped by their ModelArgs).
EXTRA: Dict[str, Any] = dict(
    head_dim=BASE["hidden_size"] // BASE["num_attention_heads"], layer_norm_eps=1e-5, norm_eps=1e-5,
    layer_norm_epsilon=1e-5, max_position_embeddings=512, rope_traditional=False, partial_rotary_factor=1.0,
    embedding_multiplier=1.0, attention_multiplier=1.0, logits_scaling=1.0, residual_multiplier=1.0,
    use_qk_norm=False, logit_scale=1.0, bias=False, qkv_bias=False, attention_bias=False, mlp_bias=False,
    tie_word_embeddings=False, rotary_emb_base=10000, query_pre_attn_scalar=16, hidden_act="silu", scale_depth=1.0,
    dim_model_base=BASE["hidden_size"], use_sliding_window=False, num_layers=2, scale_emb=1.0, use_qkv_bias=False,
    use_bias=False, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, num_local_experts=4,
    decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
)
FULL_ATTENTION = ["llama", "qwen3", "deepseek_v3", "mistral", "qwen2", "phi3", "gemma", "gemma2", "starcoder2", "olmo2",
                  "granite", "cohere", "internlm2", "exaone", "minicpm", "stablelm", "glm4", "ernie4_5", "helium",
                  "smollm3", "qwen3_moe", "mixtral", "phimoe", "nemotron", "seed_oss", "hunyuan_v1_dense"]
OTHER_CACHES = ["gemma3_text", "qwen3_5", "falcon_h1", "mamba2", "gpt_oss"]  # rotating / recurrent layers


def config_for(arch: str) -> Dict[str, Any]:
    if arch in tm.ARCH_CONFIGS:
        return tm.ARCH_CONFIGS[arch]()
    return dict(BASE, **EXTRA, model_type=arch)


def run(arch: str) -> compiled.CompiledForward:
    mx.random.seed(3)
    model = tm.build_model(config_for(arch))
    mx.eval(model.parameters())
    recurrent.scope_model(model)  # what the host does for every model it loads
    fwd = compiled.CompiledForward(cuda_backend.PaddedKVCache, grow=32)
    plain = cuda_backend.make_padded_cache(model, bucket=16)
    mx.eval(forward(model, mx.array([[5 + i % 30 for i in range(19)]], dtype=mx.uint32), plain, [])[0])
    comp = [copy.copy(c) for c in plain]
    for W in (4, 16, 8):
        toks = mx.array([[3 + (i * 5 + W) % 40 for i in range(W)]], dtype=mx.uint32)
        want = forward(model, toks, plain, [])[0]
        got = fwd(model, toks, comp, [])
        if got is None:
            break
        assert mx.array_equal(got[0], want), (arch, W, mx.abs(got[0] - want).max().item())
        assert all(a.offset == b.offset for a, b in zip(comp, plain))
    return fwd


@pytest.mark.parametrize("arch", FULL_ATTENTION)
def test_full_attention_compiles_exactly(arch: str) -> None:
    fwd = run(arch)
    assert fwd.counts == {"compiled": 3} and not fwd.failed, (fwd.counts, fwd.failed)


@pytest.mark.parametrize("arch", OTHER_CACHES)
def test_other_caches_are_declined(arch: str) -> None:
    fwd = run(arch)
    assert fwd.counts == {"plain: caches": 1}, fwd.counts
