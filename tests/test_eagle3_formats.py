"""EAGLE-3 checkpoint layouts: the real config.json files (SafeAILab EAGLE, SpecForge, speculators)
parse and resolve to kind eagle3 (an explicit wrong kind is overridden with a warning), each
layout's layer-id convention maps to the right target layers, ``mlx-spec check`` explains every
mismatch field by field, tiny checkpoints in each layout load with a non-trivial ``d2t``, and the
unrolled training forward is the decoding chain."""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Any, Dict, List

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map

from conftest import make_host
from mlx_speculative.drafters import registry
from mlx_speculative.drafters.base import DraftTarget
from mlx_speculative.drafters.eagle3 import check, detect, tiny
from mlx_speculative.drafters.eagle3.model import Model, ModelArgs
from mlx_speculative.testing import tiny_models as tm
from mlx_speculative.hooks.cli import main

pytestmark = pytest.mark.integration

FIXTURES = Path(__file__).parent / "fixtures" / "eagle3"
EAGLE = "SafeAILab__EAGLE__traineagle3"
SPECFORGE = "sgl-project__SpecForge__llama3-8B-eagle3"
SPECULATORS = "speculators-issue-1065__eagle3-qwen3moe"
LLAMA_8B = "meta-llama__Llama-3.1-8B-Instruct"
QWEN3_235B = {"hidden_size": 4096, "num_hidden_layers": 94, "vocab_size": 151936, "model_type": "qwen3_moe"}


def real(name: str) -> Dict[str, Any]:
    return json.loads((FIXTURES / f"{name}.config.json").read_text())


def specforge(ids: List[int]) -> Dict[str, Any]:
    """SpecForge's template with the ``eagle_config`` its published configs carry."""
    config = real(SPECFORGE)
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}
    return config


# -- real configs and the layer conventions --------------------------------------------------

def test_real_configs_and_their_conventions() -> None:
    eagle, template = ModelArgs.from_dict(real(EAGLE)), ModelArgs.from_dict(real(SPECFORGE))
    for args in (eagle, template):  # no ids: hidden_states[2, N//2, N-3], the input of those layers
        assert args.layout == "eagle" and args.aux_layer_ids is None and args.draft_vocab_size == 32000
        assert args.layer_ids(32) == [2, 16, 29] and args.capture_layers(32) == [1, 15, 28]
        assert (args.hidden_size, args.num_key_value_heads, args.head_dim, args.vocab_size) == (4096, 8, 128, 128256)
    spec = ModelArgs.from_dict(real(SPECULATORS))  # four taps, input of layer i (vLLM's aux_hidden_state_layers)
    assert spec.layout == "speculators" and spec.aux_layer_ids == [2, 46, 91, 93] and spec.taps == 4
    assert spec.capture_layers(94) == [1, 45, 90, 92]
    assert (spec.hidden_size, spec.num_attention_heads, spec.head_dim, spec.vocab_size) == (4096, 64, 128, 151936)
    assert spec.norm_before_fc and spec.norm_before_residual and spec.norm_output and not spec.fc_norm
    assert spec.sliding_window == 2048 and spec.layer_types == ["sliding_attention"] and spec.speculative_tokens == 3
    # SpecForge's qwen3-235B config says [1, 46, 90], the output of those layers: SGLang captures
    # hidden_states[2, 47, 91], the published default, i.e. the same layers as an EAGLE config without ids.
    forge = ModelArgs.from_dict(specforge([1, 46, 90]))
    assert forge.layout == "specforge" and forge.capture_layers(94) == [1, 46, 90] == eagle.capture_layers(94)


@pytest.mark.parametrize("name", [EAGLE, SPECFORGE, SPECULATORS])
def test_real_configs_detected_as_eagle3(name: str, tmp_path: Path) -> None:
    assert detect(real(name))
    (tmp_path / "config.json").write_text(json.dumps(real(name)))
    assert registry.resolve(str(tmp_path)).kind == "eagle3"
    wrong = registry.resolve(str(tmp_path), "dflash")
    assert wrong.kind == "eagle3" and "'dflash' conflicts with the drafter's family 'eagle3'" in wrong.warnings[0]
    assert not detect(tm.llama_config()) and not detect(json.loads(
        (Path(__file__).parent / "fixtures" / "dflash" / "speculators-issue-613__dflash-qwen3.6-35b-a3b.config.json").read_text()))


def test_real_pairs_are_compatible() -> None:
    llama = DraftTarget(config=real(LLAMA_8B), num_layers=32)
    for name in (EAGLE, SPECFORGE):
        verdict = check(None, real(name), llama)
        assert verdict.ok, verdict.reasons
        assert any("[2, 16, 29] (absent: the published default" in n and "[1, 15, 28]" in n for n in verdict.notes), verdict.notes
    verdict = check(None, real(SPECULATORS), DraftTarget(config=QWEN3_235B, num_layers=94))
    assert verdict.ok, verdict.reasons


def _reasons(config: Dict[str, Any], target: Dict[str, Any], layers: int) -> str:
    verdict = check(None, config, DraftTarget(config=target, num_layers=layers))
    assert not verdict.ok
    return " | ".join(verdict.reasons)


def test_refusals_name_field_value_and_target_value() -> None:
    llama = real(LLAMA_8B)
    assert "hidden_size: the drafter has 4096, the target's hidden_size is 2048" in _reasons(real(EAGLE), dict(llama, hidden_size=2048), 32)
    wide = dict(real(EAGLE), target_hidden_size=5120)
    assert "target_hidden_size: the drafter reads 5120-wide target states, the target's hidden_size is 4096" in _reasons(wide, llama, 32)
    assert "vocab_size: the drafter has 128256, the target has 128000" in _reasons(real(EAGLE), dict(llama, vocab_size=128000), 32)
    assert "transformer_layer_config.vocab_size: the drafter has 151936" in _reasons(real(SPECULATORS), dict(QWEN3_235B, vocab_size=1000), 94)
    msg = _reasons(real(SPECULATORS), dict(QWEN3_235B, num_hidden_layers=48), 48)
    assert "eagle_aux_hidden_state_layer_ids: [2, 46, 91, 93] (from the checkpoint) names layer(s) [91, 93]" in msg
    assert "hidden_states[id]: the input of decoder layer id" in msg and "48 decoder layers (0..47)" in msg
    zero = dict(real(SPECULATORS), eagle_aux_hidden_state_layer_ids=[0, 46, 91])
    assert "names layer(s) [0] (hidden_states[0] is the embedding output, which is not captured)" in _reasons(zero, QWEN3_235B, 94)
    msg = _reasons(specforge([1, 46, 94]), llama, 94)
    assert "eagle_config.eagle_aux_hidden_state_layer_ids: [1, 46, 94]" in msg and "the output of decoder layer id" in msg
    msg = _reasons(real(EAGLE), llama, 3)  # the default on a 3-layer target: hidden_states[2, 1, 0]
    assert "[2, 1, 0] (absent: the published default [2, N//2, N-3]) names layer(s) [0]" in msg
    assert "draft_vocab_size: 200000; allowed: 1 to vocab_size (128256)" in _reasons(dict(real(EAGLE), draft_vocab_size=200000), llama, 32)
    assert "hidden_act: 'gelu'; supported: 'silu'" in _reasons(dict(real(EAGLE), hidden_act="gelu"), llama, 32)
    assert "num_hidden_layers: 2; the eagle layout has exactly one decoder layer" in _reasons(dict(real(EAGLE), num_hidden_layers=2), llama, 32)


# -- tiny checkpoints ---------------------------------------------------------------------------

LAYOUTS = {  # real config, layer ids for a 4-layer target (None: the default), captured layer outputs
    "eagle": (EAGLE, None, [1, 1, 0]),
    "specforge": (SPECFORGE, [0, 1, 3], [0, 1, 3]),
    "speculators": (SPECULATORS, [1, 2, 4], [0, 1, 3]),
}


def tiny_checkpoint(layout: str, out: Path, **over: Any) -> Path:
    name, ids, _ = LAYOUTS[layout]
    return tiny.write_checkpoint(out, tiny.shrink_config(real(name), layer_ids=ids), seed=5, **over)


@pytest.fixture(scope="module")
def llama_target(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return tm.make_checkpoint(tmp_path_factory.mktemp("e3target") / "t", tm.llama_config(num_hidden_layers=4), seed=8,
                              tokenizer_dir=tokenizer_dir)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_tiny_checkpoints_load_with_a_nontrivial_d2t(layout: str, llama_target: Path, tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    path = tiny_checkpoint(layout, tmp_path / layout)
    weights = mx.load(str(path / "model.safetensors"))
    assert ("midlayer.self_attn.q_proj.weight" in weights) == (layout != "speculators")
    assert weights["midlayer.hidden_norm.weight" if layout != "speculators" else "layers.0.hidden_norm.weight"].shape == (64,)
    d2t, t2d = np.array(weights["d2t"]), np.array(weights["t2d"])
    assert weights["d2t"].dtype == mx.int64 and weights["t2d"].dtype == mx.bool_ and d2t.shape == (256,) and t2d.sum() == 256
    host = make_host({"draft_model": str(path), "kind": "dflash"})  # wrong: overridden, with a warning
    with caplog.at_level(logging.WARNING, logger="mlx_speculative"):
        target = host.load(str(llama_target))
    assert "conflicts with the drafter's family 'eagle3'" in caplog.text
    drafter = target.attachments["speculative"].drafter
    assert drafter.kind == "eagle3" and drafter.capture_layers() == LAYOUTS[layout][2]
    ids = np.arange(256) + d2t  # target id = draft id + d2t[draft id]
    assert np.array(drafter.targets).tolist() == ids.tolist() == np.nonzero(t2d)[0].tolist()
    assert (d2t != 0).sum() > 200 and ids.max() > 300  # far from the identity
    logits = mx.arange(256, dtype=mx.float32)[None]  # the draft id d scores d: the best is the last
    full = drafter.full_vocab(logits)[0]
    assert int(mx.argmax(full).item()) == int(ids[-1]) and int(mx.isinf(full).sum().item()) == 384 - 256
    rc = main(["check", "--model", str(llama_target), "--draft-model", str(path)])
    assert rc == 0


def test_cli_check_reads_d2t_and_tensor_shapes(llama_target: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tiny_checkpoint("specforge", tmp_path / "ok")
    assert main(["check", "--model", str(llama_target), "--draft-model", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["kind"] == "eagle3" and report["compatible"]
    assert any("d2t: 256 draft tokens -> distinct target ids within 0..383" in n for n in report["checked"])
    weights = dict(mx.load(str(path / "model.safetensors")))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((path / "config.json").read_text())
    weights["d2t"] = weights["d2t"].at[3].add(500)  # draft id 3 -> a target id past the vocabulary
    weights["fc.weight"] = weights["fc.weight"][:, :128]
    weights.pop("lm_head.weight")
    mx.save_safetensors(str(bad / "model.safetensors"), weights)
    assert main(["check", "--model", str(llama_target), "--draft-model", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "verdict: NOT compatible" in out
    assert "x fc.weight: shape [64, 128]; expected [64, 192] (hidden_size x 3 taps x 64)" in out
    assert "x lm_head.weight: not found" in out
    assert "x d2t: draft ids [3] map to target ids [" in out and "outside the target's vocabulary (vocab_size 384" in out
    weights = dict(mx.load(str(path / "model.safetensors")))
    d2t = np.array(weights["d2t"])
    d2t[1] = d2t[0] - 1  # draft id 1 -> the target id of draft id 0
    weights["d2t"] = mx.array(d2t)
    weights.pop("t2d")
    mx.save_safetensors(str(bad / "model.safetensors"), weights)
    assert main(["check", "--model", str(llama_target), "--draft-model", str(bad)]) == 1
    assert "x d2t: 1 draft ids map to a target id another draft id maps to too" in capsys.readouterr().out


def test_own_embedding_with_another_width(llama_target: Path, tmp_path: Path) -> None:
    """``target_hidden_size``: a 32-wide drafter reading 64-wide target states, with its own embedding."""
    from conftest import greedy_reference, no_stop

    config = tiny.shrink_config(real(EAGLE), hidden_size=32, head_dim=8, target_hidden_size=64)
    path = tiny.write_checkpoint(tmp_path / "narrow", config, seed=6, own_embedding=True)
    host = make_host({"draft_model": str(path)})
    target = host.load(str(llama_target))
    assert "embed_tokens" in target.attachments["speculative"].drafter.model
    prompt = [5, 9, 13, 5, 9, 13, 5]
    result = host.generate(target, prompt, no_stop(12))
    assert result.tokens == greedy_reference(target.model, prompt, 12)
    assert result.report["speculative"].rounds > 0 and result.report["speculative"].fallback is None
    weights = dict(mx.load(str(path / "model.safetensors")))
    weights.pop("embed_tokens.weight")
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    verdict = registry.check(registry.resolve(str(path)), DraftTarget(config=tm.llama_config(), num_layers=4))
    assert "embed_tokens.weight: absent, and the drafter (32 wide) cannot borrow the target's 64-wide embedding" in " ".join(verdict.reasons)


# -- the unrolled training forward is the decoding chain ------------------------------------------

@pytest.mark.parametrize("layout, flags", [
    ("specforge", {}),
    ("speculators", {"norm_before_fc": True, "fc_norm": True, "norm_before_residual": True, "norm_output": True}),
    ("speculators2", {"norm_output": False}),
])
def test_unrolled_chain_equals_the_decoding_chain(layout: str, flags: Dict[str, Any]) -> None:
    name, ids, _ = LAYOUTS[layout.rstrip("2")]
    extra = {"num_hidden_layers": 2} if layout == "speculators2" else {}  # two sliding layers (window 8 < T)
    config = tiny.shrink_config(real(name), layer_ids=ids, **extra, **flags)
    args = ModelArgs.from_dict(config)
    assert args.layer_types[0] == ("sliding_attention" if layout.startswith("speculators") else "full_attention")
    model = Model(args)
    mx.random.seed(2)
    model.update(tree_map(lambda w: mx.random.normal(w.shape) * 0.3, model.parameters()))
    T, S, H = 14, 5, args.hidden_size
    feats = mx.random.normal((1, T, 3 * H))
    embs = [mx.random.normal((1, T, H)) for _ in range(S)]
    unrolled = model.unrolled(embs, model.project(feats))  # S x [1, T, H]
    for t in (0, 5, T - 1):
        cache = model.make_cache()
        h = model(embs[0][:, : t + 1], model.project(feats[:, : t + 1]), cache)[:, -1:]  # positions 0..t
        assert mx.allclose(h[0, 0], unrolled[0][0, t], atol=1e-4).item()
        for s in range(1, S):  # the chain: position t + s, its own previous state
            h = model(embs[s][:, t : t + 1], model.carry(h), cache)
            assert mx.allclose(h[0, 0], unrolled[s][0, t], atol=1e-4).item(), (t, s)
    # Later steps see their own chain: change step 1's token at index 3 and step 2 at index 3 moves, index 4 not.
    moved = model.unrolled([embs[0], embs[1].at[0, 3].add(1.0), *embs[2:]], model.project(feats))
    assert not mx.allclose(moved[2][0, 3], unrolled[2][0, 3], atol=1e-4).item()
    assert mx.allclose(moved[2][0, 4], unrolled[2][0, 4], atol=1e-6).item()


def test_shrunk_configs_keep_field_names() -> None:
    for name in (EAGLE, SPECFORGE, SPECULATORS):
        config = tiny.shrink_config(real(name), layer_ids=None if name != SPECULATORS else [1, 2, 4])
        assert set(config) == set(real(name))
        if name == SPECULATORS:
            assert set(config["transformer_layer_config"]) == set(real(name)["transformer_layer_config"])
            assert config["transformer_layer_config"]["sliding_window"] == 8
    forge = tiny.shrink_config(real(SPECFORGE), layer_ids=[0, 1, 3])
    assert set(forge) == set(real(SPECFORGE)) | {"eagle_config"}
    assert copy.deepcopy(forge)["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [0, 1, 3]}
