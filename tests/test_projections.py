"""Routing a loaded model's projections (nn.Linear) through the plugin's dispatcher (issue 19).

On MLX-CUDA the dispatcher sends 2..32-row projections to plugin/cuda/cuda_matmul.py's kernel; here its
place is taken by ``projections.stand_in()`` (float32 MLX matmul, any device) so that the routing
itself is checked: which calls reach the dispatcher, that the routed model computes what mlx's
``nn.Linear`` computes, that only THAT model instance is affected, and that routing comes off.
Rounds with both dispatchers routed: tests/test_attention_rounds.py.
"""

from __future__ import annotations

from typing import Any, List

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlx_speculative.hooks import attention as host_attention
from mlx_speculative.testing import tiny_models as tm
from mlx_speculative.plugin import cuda
from mlx_speculative.plugin.cuda import backend as cuda_backend, cuda_matmul, projections

pytestmark = pytest.mark.unit


def linears(model: nn.Module) -> List[nn.Module]:
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


def forwards(model: nn.Module) -> List[mx.array]:
    """A 40-token prefill, one-token steps, a 16-position block, a 32-position block: every logit."""
    cache = make_prompt_cache(model)
    out = [model(mx.array([[2 + i % 50 for i in range(40)]]), cache=cache)]
    out += [model(mx.array([[t]]), cache=cache) for t in (12, 13)]
    out.append(model(mx.array([list(range(20, 36))]), cache=cache))
    out.append(model(mx.array([list(range(40, 72))]), cache=cache))
    return out


def test_routed_projections_compute_the_same_and_stay_in_their_model() -> None:
    config = tm.llama_config(num_hidden_layers=2)
    mx.random.seed(3)
    routed_model, other = tm.build_model(config), tm.build_model(config)
    other.update(routed_model.parameters())
    linear_call = nn.Linear.__call__
    want = forwards(other)
    disp = projections.stand_in()
    n = len(linears(routed_model))
    assert n == 2 * 7 + 1  # seven projections a layer and the head
    assert host_attention.route_projections(routed_model, disp) == n
    assert host_attention.route_projections(routed_model, disp) == n  # idempotent
    assert host_attention.routed_projections(routed_model) == n and host_attention.routed_projections(other) == 0
    got = forwards(routed_model)
    for w, g in zip(want, got):
        assert mx.array_equal(w, g).item()
    # The 16-position forward asked the dispatcher; the 32-position one (bf16 takes 2..16 rows), the prefill (40
    # rows) and the one-token steps did not even call it (the routed layers check the rows first).
    assert disp.rows == (2, 16) and disp.counts == {"kernel": n}, disp.counts
    assert all(type(m) is nn.Linear for m in linears(other))
    assert nn.Linear.__call__ is linear_call and "_spec_projections" not in vars(nn.Linear)
    forwards(other)
    assert disp.counts["kernel"] == n  # the other instance never reached it
    # A later dispatcher replaces the first; unrouting gives the layers back to nn.Linear.
    second = projections.stand_in()
    assert host_attention.route_projections(routed_model, second) == n
    forwards(routed_model)
    assert second.counts["kernel"] == n and disp.counts["kernel"] == n
    assert host_attention.unroute_projections(routed_model) == n and host_attention.routed_projections(routed_model) == 0
    assert all(type(m) is nn.Linear for m in linears(routed_model))
    assert host_attention.route_projections(routed_model, None) == 0


def test_bias_declines_and_other_layer_kinds() -> None:
    mx.random.seed(4)
    lin = nn.Linear(16, 24, bias=True)
    x = mx.random.normal((2, 5, 16))  # 10 rows
    want = lin(x)
    disp = projections.stand_in()
    holder = nn.Sequential(lin)
    assert host_attention.route_projections(holder, disp) == 1
    assert mx.allclose(lin(x), want, atol=1e-6).item() and disp.counts["kernel"] == 1
    disp.enabled = False  # the dispatcher declines: the layer's own matmul
    assert mx.array_equal(lin(x), want).item() and disp.counts["mlx"] == 1
    # Quantized and other Linear-like layers keep their class.
    q = nn.QuantizedLinear(64, 32, bias=False, group_size=32, bits=4)
    assert host_attention.route_projections(nn.Sequential(q), disp) == 0 and type(q) is nn.QuantizedLinear


def blocks(model: nn.Module, n: int) -> List[mx.array]:
    """A 40-token prefill, then ``n`` 16-position blocks: every logit."""
    cache = make_prompt_cache(model)
    out = [model(mx.array([[2 + i % 50 for i in range(40)]]), cache=cache)]
    return out + [model(mx.array([[(7 * b + i) % 60 for i in range(16)]]), cache=cache) for b in range(n)]


def sib(layer: nn.Module) -> Any:
    return layer._spec_sib


@pytest.mark.parametrize("bias", [False, True])
def test_sibling_projections_fuse_after_two_alike_forwards(bias: bool) -> None:
    """q/k/v and gate/up are learned as siblings (the same x, one after another) and then made by one
    launch each, every product landing in its own layer (with its own bias): logits bit-equal to nn.Linear's."""
    config = tm.llama_config(num_hidden_layers=2, attention_bias=bias, mlp_bias=bias)
    mx.random.seed(6)
    routed_model, other = tm.build_model(config), tm.build_model(config)
    other.update(routed_model.parameters())
    disp = projections.stand_in()
    host_attention.route_projections(routed_model, disp)
    want, got = blocks(other, 5), blocks(routed_model, 5)
    for w, g in zip(want, got):
        assert mx.array_equal(w, g).item()
    for layer in routed_model.model.layers:
        a, m = layer.self_attn, layer.mlp
        assert host_attention._same(sib(a.q_proj).group, (a.k_proj, a.v_proj))
        assert host_attention._same(sib(m.gate_proj).group, (m.up_proj,))
        assert not sib(a.o_proj).group and not sib(m.down_proj).group and not sib(a.k_proj).group
    # Blocks 1-2 learn; blocks 3-5 fuse: per layer one launch for q/k/v, one for gate/up, o and down alone.
    layers, n = 2, 2 * 7 + 1
    assert disp.counts == {"kernel": 2 * n + 3 * (layers * 4 + 1), "fused": 3 * layers * 3}, disp.counts
    assert host_attention.unroute_projections(routed_model) == n
    assert not any(hasattr(m, "_spec_sib") for m in linears(routed_model))


def test_fusing_stops_where_the_pattern_breaks() -> None:
    """A follower called with another x gets its own product; its leader launches alone from then on."""
    mx.random.seed(7)
    q, k = nn.Linear(32, 48, bias=True), nn.Linear(32, 16, bias=True)
    holder = nn.Sequential(q, k)
    disp = projections.stand_in()
    host_attention.route_projections(holder, disp)
    for _ in range(3):
        x = mx.random.normal((4, 32))
        q(x), k(x)
    assert host_attention._same(sib(q).group, (k,)) and disp.counts["fused"] == 1  # the third pair: one launch
    x, y = mx.random.normal((4, 32)), mx.random.normal((4, 32))
    want_q, want_k = x @ q.weight.T + q.bias, y @ k.weight.T + k.bias
    assert mx.allclose(q(x), want_q, atol=1e-5).item()  # launches q and k over x
    assert sib(k).held is not None  # k's product waits for k(x)
    assert mx.allclose(k(y), want_k, atol=1e-5).item()  # another x: not the held product
    assert sib(q).off and not sib(q).group and sib(k).held is None
    before = dict(disp.counts)
    q(x), k(x)
    assert disp.counts["kernel"] == before["kernel"] + 2 and disp.counts["fused"] == before["fused"]


@pytest.mark.parametrize("shape_x, shape_w, dtype, why", [
    ((1, 4096), (64, 4096), mx.bfloat16, "one row"),
    ((33, 64), (64, 64), mx.bfloat16, "33 rows"),
    ((2, 17, 64), (64, 64), mx.bfloat16, "34 rows"),
    ((4, 12), (64, 12), mx.bfloat16, "K not a multiple of 8"),
    ((4, 64), (64, 64), mx.float32, "float32"),
    ((4, 64), (64, 32), mx.bfloat16, "K mismatch"),
])
def test_the_kernel_declines_what_it_does_not_take(shape_x: Any, shape_w: Any, dtype: mx.Dtype, why: str) -> None:
    """Declined before any kernel is built (these run on the CPU, where none can be)."""
    x, w = mx.zeros(shape_x, dtype), mx.zeros(shape_w, dtype)
    assert cuda_matmul.plan(x, w) is None, why
    assert not cuda_matmul.supports(x, w)
    mixed = mx.zeros((4, 64), mx.float16)
    assert cuda_matmul.plan(mixed, mx.zeros((64, 64), mx.bfloat16)) is None
    with pytest.raises(ValueError, match="2..32 rows"):
        cuda_matmul.mm(x, w)
    assert cuda_matmul.plan_many(x, [w, w]) is None


@pytest.mark.parametrize("columns, K, rows, shape", [
    (4096, 4096, 16, "piped"), (1024, 4096, 2, "piped"), (6144, 4096, 16, "piped"),  # q/o, k/v, fused q/k/v
    (4096, 14336, 16, "piped"), (4096, 20480, 8, "piped"),  # down, a DFlash fc: deep ones
    (28672, 4096, 16, "wide"), (128256, 4096, 16, "wide"), (8193, 8192, 16, "wide"),  # fused gate/up, the head
    (4096, 4096, 17, "narrow"), (1024, 4096, 32, "narrow"), (8192, 8192, 32, "narrow"),  # two row tiles
    (28672, 4096, 32, "wide"), (4096, 14336, 32, "wide"), (8192, 8200, 32, "wide"),
])
def test_the_projection_kernel_shape_by_launch(columns: int, K: int, rows: int, shape: str) -> None:
    """Up to 16 rows: two column groups, loads pipelined, but for the wide launches over K <= 8192 (unpipelined);
    over 16 rows: one column group up to 8192 columns over K <= 8192, two above. The K split is the same."""
    want = {"narrow": cuda_matmul.NARROW, "wide": cuda_matmul.WIDE, "piped": cuda_matmul.PIPED}[shape]
    assert cuda_matmul.shape_for(columns, K, rows) == want
    assert cuda_matmul.NARROW[1] == cuda_matmul.WIDE[1] == cuda_matmul.PIPED[1]
    assert len({cuda_matmul.NARROW, cuda_matmul.WIDE, cuda_matmul.PIPED}) == 3


def test_fused_launches_decline_mixed_or_too_many_weights() -> None:
    x, w = mx.zeros((4, 64), mx.bfloat16), mx.zeros((32, 64), mx.bfloat16)
    assert cuda_matmul.plan_many(x, [w] * (cuda_matmul.MAX_WEIGHTS + 1)) is None
    assert cuda_matmul.plan_many(x, []) is None
    assert cuda_matmul.plan_many(x, [w, mx.zeros((32, 48), mx.bfloat16)]) is None  # another K
    assert cuda_matmul.plan_many(x, [w, w.astype(mx.float16)]) is None
    with pytest.raises(ValueError, match=f"1..{cuda_matmul.MAX_WEIGHTS} weights"):
        cuda_matmul.mm_many(x, [w, mx.zeros((32, 48), mx.bfloat16)])


@pytest.mark.parametrize("bias", [False, True])
def test_model_code_names_the_layers_multiplying_one_x(bias: bool) -> None:
    """``project_all``: the layers' products from launches of up to ``max_weights`` weights (biases added),
    the values each layer gives alone; each layer's own call where it is not routed or x has other rows."""
    mx.random.seed(8)
    layers = [nn.Linear(32, 8 + 4 * i, bias=bias) for i in range(6)]
    holder = nn.Sequential(*layers)
    x = mx.random.normal((3, 4, 32))  # 12 rows
    want = [m(x) for m in layers]
    same = lambda got: all(mx.allclose(g, w, atol=1e-5).item() for g, w in zip(got, want))  # noqa: E731
    assert same(host_attention.project_all(layers, x))  # not routed: their own calls
    disp = projections.stand_in()
    disp.max_weights = 4
    host_attention.route_projections(holder, disp)
    assert same(host_attention.project_all(layers, x)) and disp.counts == {"kernel": 2, "fused": 4}, disp.counts
    assert not any(sib(m).seen or sib(m).group for m in layers)  # the learner saw none of these
    one = mx.random.normal((1, 32))  # one row: outside the dispatcher's rows, each layer's own matmul
    assert all(mx.array_equal(g, m(one)).item() for g, m in zip(host_attention.project_all(layers, one), layers))
    assert disp.counts == {"kernel": 2, "fused": 4}


def test_a_dflash_drafter_projects_with_few_launches() -> None:
    """The DFlash drafter names its siblings: its context append makes every layer's K and V in one launch, and
    each block layer q/k/v in one and gate/up in one; its block's hidden states equal an unrouted copy's."""
    from mlx_speculative.drafters.dflash.model import Model, ModelArgs

    args = ModelArgs(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     num_hidden_layers=3, vocab_size=384, target_layer_ids=[0, 2], mask_token_id=383)
    mx.random.seed(9)
    routed_model, other = Model(args), Model(args)
    other.update(routed_model.parameters())
    disp = projections.stand_in()
    host_attention.route_projections(routed_model, disp)
    feats, block = mx.random.normal((1, 7, 128)), mx.random.normal((1, 16, 64))
    out = []
    for m in (other, routed_model):
        caches = m.make_cache()
        m.append_context(feats, caches)
        out.append(m(block, caches))
    assert mx.array_equal(out[0], out[1]).item()
    # fc; the 6 K/V projections (one launch); per layer q/k/v, o, gate/up, down
    assert disp.counts == {"kernel": 1 + 1 + 3 * 4, "fused": 5 + 3 * (2 + 1)}, disp.counts


def test_reference_is_the_product() -> None:
    mx.random.seed(5)
    x, w = mx.random.normal((3, 4, 32)), mx.random.normal((48, 32))
    assert mx.allclose(cuda_matmul.reference(x, w), x @ w.T, atol=1e-5).item()
    assert cuda_matmul.reference(x.astype(mx.bfloat16), w.astype(mx.bfloat16)).dtype == mx.bfloat16


def test_modes_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(projections.ENV, raising=False)
    monkeypatch.delenv(cuda.PADDED_ENV, raising=False)
    assert not cuda_matmul.available()
    assert projections.resolve_mode() is False and projections.projections_for() is None
    assert projections.resolve_mode("off") is False
    with pytest.raises(ValueError, match="allowed here: auto, off"):
        projections.resolve_mode("on")
    with pytest.raises(ValueError, match="allowed: auto, on, off"):
        projections.resolve_mode("sometimes")
    monkeypatch.setenv(projections.ENV, "ON")
    with pytest.raises(ValueError, match=projections.ENV):
        projections.projections_for()
    monkeypatch.setenv(projections.ENV, "off")
    assert cuda_backend.policy_for() is None  # nothing to route on the CPU


def quantized_linears(model: nn.Module) -> List[nn.Module]:
    return [m for m in model.modules() if isinstance(m, nn.QuantizedLinear)]


def test_quantized_layers_route_only_where_the_dispatcher_takes_them() -> None:
    """A 4-bit model (affine, group 32): a dispatcher that routes 4-bit layers gets its verify-width calls,
    answered by the kernel's reference, and the forwards match the unrouted copy's; one that does not
    leaves (or gives back) ``nn.QuantizedLinear``; nothing else changes class."""
    config = tm.llama_config(num_hidden_layers=2)
    mx.random.seed(4)
    routed_model, other = tm.build_model(config), tm.build_model(config)
    other.update(routed_model.parameters())
    for m in (routed_model, other):
        nn.quantize(m, group_size=32, bits=4)
    qcall = nn.QuantizedLinear.__call__
    want = forwards(other)
    n = len(quantized_linears(routed_model))
    assert n == 2 * 7 + 1 and not linears(routed_model)
    assert host_attention.route_projections(routed_model, projections.stand_in()) == 0  # 4-bit layers not taken
    assert all(type(m) is nn.QuantizedLinear for m in quantized_linears(routed_model))
    disp = projections.stand_in(quantized=True)
    assert host_attention.route_projections(routed_model, disp) == n
    assert host_attention.routed_projections(routed_model) == n and host_attention.routed_projections(other) == 0
    got = forwards(routed_model)
    for w, g in zip(want, got):
        assert w.shape == g.shape and mx.allclose(w, g, atol=1e-4, rtol=1e-4).item()
    assert disp.counts == {"kernel": 2 * n, "quantized": 2 * n}, disp.counts  # the 16- and 32-position forwards
    assert disp.report()["kernel_share"] == 1.0  # "quantized" tallies kernel launches, not more products
    assert nn.QuantizedLinear.__call__ is qcall and "_spec_projections" not in vars(nn.QuantizedLinear)
    assert all(type(m) is nn.QuantizedLinear for m in quantized_linears(other))
    # A 4-bit layer of another kind (8 bits) is asked and declined: mlx's own matmul, the same numbers.
    eight = nn.QuantizedLinear(64, 32, bias=True, group_size=32, bits=8)
    assert host_attention.route_projections(nn.Sequential(eight), disp) == 1
    x = mx.random.normal((4, 64))
    assert mx.array_equal(eight(x), qcall(eight, x)).item() and disp.counts["mlx"] == 1
    # A dispatcher without 4-bit routing gives the layers back; unrouting too.
    assert host_attention.route_projections(routed_model, projections.stand_in()) == 0
    assert all(type(m) is nn.QuantizedLinear for m in quantized_linears(routed_model))
    assert host_attention.route_projections(routed_model, disp) == n
    assert host_attention.unroute_projections(routed_model) == n
    assert all(type(m) is nn.QuantizedLinear for m in quantized_linears(routed_model))
    for w, g in zip(want, forwards(routed_model)):
        assert mx.array_equal(w, g).item()


def test_the_quantized_mode_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto (the default) routes 4-bit layers only where the kernel runs: not here; on is an error here."""
    monkeypatch.delenv(projections.QUANTIZED_ENV, raising=False)
    assert projections.quantized_on() is False
    for mode in ("auto", "off", " OFF "):
        monkeypatch.setenv(projections.QUANTIZED_ENV, mode)
        assert projections.quantized_on() is False
    monkeypatch.setenv(projections.QUANTIZED_ENV, "on")
    with pytest.raises(ValueError, match="allowed here: auto, off"):
        projections.quantized_on()
    monkeypatch.setenv(projections.QUANTIZED_ENV, "maybe")
    with pytest.raises(ValueError, match="allowed: auto, on, off"):
        projections.quantized_on()
    # where the kernel runs (as if: the availability check of this project's own module), auto and the
    # default route 4-bit layers and off does not
    from mlx_speculative.plugin import cuda
    monkeypatch.setattr(cuda, "available", lambda: True)
    for mode, want in (("auto", True), ("off", False), ("on", True)):
        monkeypatch.setenv(projections.QUANTIZED_ENV, mode)
        assert projections.quantized_on() is want
    monkeypatch.delenv(projections.QUANTIZED_ENV)
    assert projections.quantized_on() is True
