"""DFlash checkpoint formats: the real config.json files parse, resolve to kind dflash, and are
checked against targets field by field; tiny checkpoints in each format load."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Dict

import mlx.core as mx
import pytest

from conftest import make_host
from mlx_speculative.drafters import registry
from mlx_speculative.drafters.base import DrafterError, DraftTarget
from mlx_speculative.drafters.dflash import check, detect
from mlx_speculative.drafters.dflash import tiny
from mlx_speculative.drafters.dflash.model import ModelArgs
from mlx_speculative.testing import tiny_models as tm
from mlx_speculative.hooks.cli import main

pytestmark = pytest.mark.integration

FIXTURES = Path(__file__).parent / "fixtures" / "dflash"


def real(name: str) -> Dict[str, Any]:
    return json.loads((FIXTURES / f"{name}.config.json").read_text())


B16_4B = "z-lab__Qwen3-4B-DFlash-b16"
B16_8B = "z-lab__Qwen3-8B-DFlash-b16"
NESTED = "z-lab__Qwen3.5-4B-DFlash"
MUSE = "meta-models__Muse-Glimmer-30B-assistant"
SPECULATORS = "speculators-issue-613__dflash-qwen3.6-35b-a3b"
DFLASH2 = "z-lab__Qwen3.8-27B-DFlash2"
QWEN3_8B = "Qwen__Qwen3-8B"


# -- real configs ---------------------------------------------------------------------------

def test_flat_b16_config() -> None:
    args = ModelArgs.from_dict(real(B16_8B))
    assert args.layout == "dflash_config" and args.block_size == 16
    assert args.mask_token_id == 151669 and args.target_layer_ids == [1, 9, 17, 25, 33]
    assert args.capture_layers == [1, 9, 17, 25, 33]  # output of decoder layer id
    assert (args.hidden_size, args.num_hidden_layers, args.num_target_layers) == (4096, 5, 36)
    assert args.rope_theta == 1000000 and args.sliding_window is None and args.tie_word_embeddings is False


def test_nested_config_block_size_and_rope_parameters() -> None:
    config = real(NESTED)
    assert "block_size" not in config  # only inside dflash_config in this format
    args = ModelArgs.from_dict(config)
    assert args.block_size == 16 and args.mask_token_id == 248077 and len(args.target_layer_ids) == 8
    assert args.num_hidden_layers == 6 and args.rope_theta == 10000000
    assert args.sliding_window == 4096 and args.layer_types[:5] == ["sliding_attention"] * 5


def test_dflash_config_wins_over_top_level() -> None:
    config = real(B16_4B)
    config["dflash_config"]["block_size"] = 8
    assert config["block_size"] == 16 and ModelArgs.from_dict(config).block_size == 8


def test_default_target_layer_ids_follow_z_lab() -> None:
    config = real(B16_8B)
    del config["dflash_config"]["target_layer_ids"]
    assert ModelArgs.from_dict(config).target_layer_ids == [1, 9, 17, 25, 33]


def test_muse_assistant_flat_layout() -> None:
    args = ModelArgs.from_dict(real(MUSE))
    assert args.layout == "flat" and args.block_size == 16 and args.mask_token_id == 201818
    # Raw hidden_states indices (exllamav3's tap_shift 0): id i is the output of layer i - 1.
    assert args.capture_layers == [0, 12, 24, 36, 48]
    assert args.rope_theta == 500000.0 and args.sliding_window == 2048 and args.vocab_size is None


def test_speculators_layout() -> None:
    config = real(SPECULATORS)
    assert "model_type" not in config
    args = ModelArgs.from_dict(config)
    assert args.layout == "speculators" and args.model_type == "llama"
    assert (args.hidden_size, args.head_dim, args.num_attention_heads, args.num_key_value_heads) == (2048, 256, 16, 2)
    assert args.target_layer_ids == [1, 10, 19, 28, 37] and args.mask_token_id == 248077
    assert args.partial_rotary_factor == 0.25 and args.block_size == 16 and args.vocab_size == 248320


@pytest.mark.parametrize("name", [B16_4B, B16_8B, NESTED, MUSE, SPECULATORS, DFLASH2])
def test_real_configs_detected_as_dflash(name: str) -> None:
    config = real(name)
    assert detect(config)
    family = registry.detect_family(config)
    assert family is not None and family.kind == "dflash"


def test_target_config_is_not_dflash() -> None:
    assert not detect(real(QWEN3_8B))
    assert registry.detect_family(real(QWEN3_8B)).kind == "draft_model"


# -- validation -----------------------------------------------------------------------------

def _target(config: Dict[str, Any]) -> DraftTarget:
    return DraftTarget(config=config, num_layers=config["num_hidden_layers"])


def test_real_pair_is_compatible() -> None:
    verdict = check(None, real(B16_8B), _target(real(QWEN3_8B)))
    assert verdict.ok, verdict.reasons
    assert any("dflash_config.target_layer_ids" in n for n in verdict.notes)
    assert any("mask_token_id" in n for n in verdict.notes)


def test_refusals_name_field_value_and_target_value() -> None:
    target = real(QWEN3_8B)
    target.update(num_hidden_layers=30, vocab_size=151000)
    verdict = check(None, real(B16_4B), _target(target))
    assert not verdict.ok
    reasons = "\n".join(verdict.reasons)
    assert "dflash_config.target_layer_ids" in reasons and "[33]" in reasons and "30 decoder layers" in reasons
    assert "hidden_size: the drafter has 2560, the target's hidden_size is 4096" in reasons
    assert "dflash_config.mask_token_id: 151669" in reasons and "vocab_size 151000" in reasons
    assert "vocab_size: the drafter has 151936, the target has 151000" in reasons


def test_dflash2_refused_by_name() -> None:
    verdict = check(None, real(DFLASH2), _target(real(QWEN3_8B)))
    assert not verdict.ok and "DFlash2DraftModel" in verdict.reasons[0] and "not supported" in verdict.reasons[0]


def test_reduced_draft_vocabulary_refused() -> None:
    config = real(SPECULATORS)
    config["draft_vocab_size"] = 32000
    target = dict(real(QWEN3_8B), hidden_size=2048, vocab_size=248320, num_hidden_layers=40)
    verdict = check(None, config, _target(target))
    assert not verdict.ok and any(r.startswith("draft_vocab_size: 32000") for r in verdict.reasons)


def _config_dir(path: Path, config: Dict[str, Any]) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_cli_check_explains_mismatch_field_by_field(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    target = real(QWEN3_8B)
    target.update(num_hidden_layers=30, vocab_size=151000)
    t = _config_dir(tmp_path / "target", target)
    d = _config_dir(tmp_path / "drafter", real(B16_4B))
    assert main(["check", "--model", str(t), "--draft-model", str(d)]) == 1
    out = capsys.readouterr().out
    assert "kind: dflash" in out and "NOT compatible" in out
    lines = [line for line in out.splitlines() if line.strip().startswith("x ")]
    assert len(lines) == 4, out  # target_layer_ids, hidden_size, mask_token_id, vocab_size
    good = _config_dir(tmp_path / "good", real(B16_8B))
    assert main(["check", "--model", str(_config_dir(tmp_path / "t8b", real(QWEN3_8B))), "--draft-model", str(good),
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["kind"] == "dflash" and report["compatible"] and report["reasons"] == []


# -- tiny checkpoints in each format ---------------------------------------------------------

FORMATS = {
    "b16_flat": (B16_4B, [0, 2], ""),
    "b16_flat_model_prefix": (B16_8B, [1, 3], "model."),
    "nested": (NESTED, [0, 1, 2], ""),
    "muse_assistant": (MUSE, [1, 3], ""),
    "speculators": (SPECULATORS, [1, 2], ""),
}


@pytest.fixture(scope="module")
def llama_target(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return tm.make_checkpoint(tmp_path_factory.mktemp("dflash_fmt") / "target", tm.llama_config(num_hidden_layers=4),
                              seed=11, tokenizer_dir=tokenizer_dir)


def _drafter(root: Path, fmt: str, **over: Any) -> Path:
    name, ids, prefix = FORMATS[fmt]
    config = tiny.shrink_config(real(name), target_layer_ids=ids, mask_token_id=383, num_target_layers=4, **over)
    return tiny.write_checkpoint(root / fmt, config, seed=5, prefix=prefix)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_tiny_checkpoint_loads_with_auto(fmt: str, llama_target: Path, tmp_path: Path) -> None:
    drafter = _drafter(tmp_path, fmt)
    header = mx.load(str(drafter / "model.safetensors"))
    if fmt == "muse_assistant":
        assert "encoder.fc.weight" in header and "encoder.output_norm_enc.weight" in header
    elif fmt.endswith("prefix"):
        assert "model.fc.weight" in header
    else:
        assert "fc.weight" in header and "hidden_norm.weight" in header
    host = make_host({"draft_model": str(drafter), "kind": "auto"})
    target = host.load(str(llama_target))
    att = target.attachments["speculative"]
    assert att.drafter.kind == "dflash" and att.block_size == 16
    ids = FORMATS[fmt][1]
    expected = [i - 1 for i in ids] if fmt == "muse_assistant" else ids
    assert att.drafter.capture_layers() == expected


def test_bad_fc_shape_refused(llama_target: Path, tmp_path: Path) -> None:
    drafter = _drafter(tmp_path, "b16_flat")
    weights = mx.load(str(drafter / "model.safetensors"))
    weights["fc.weight"] = mx.zeros((64, 3 * 64))
    mx.save_safetensors(str(drafter / "model.safetensors"), weights)
    with pytest.raises(DrafterError, match=r"fc.weight has shape \[64, 192\]; expected \[64, 128\]"):
        make_host({"draft_model": str(drafter)}).load(str(llama_target))


def test_unknown_tensor_refused(llama_target: Path, tmp_path: Path) -> None:
    drafter = _drafter(tmp_path, "nested")
    weights = mx.load(str(drafter / "model.safetensors"))
    weights["layers.0.attention_conv.base_kernel"] = mx.zeros((2, 2, 64))
    mx.save_safetensors(str(drafter / "model.safetensors"), weights)
    with pytest.raises(DrafterError, match="attention_conv"):
        make_host({"draft_model": str(drafter)}).load(str(llama_target))


def test_layer_beyond_tiny_target_refused(llama_target: Path, tmp_path: Path) -> None:
    name, _, _ = FORMATS["nested"]
    config = tiny.shrink_config(real(name), target_layer_ids=[1, 4], mask_token_id=383, num_target_layers=4)
    drafter = tiny.write_checkpoint(tmp_path / "beyond", config)
    with pytest.raises(DrafterError, match=r"dflash_config.target_layer_ids: \[1, 4\] names layer\(s\) \[4\].*4 decoder layers"):
        make_host({"draft_model": str(drafter)}).load(str(llama_target))


def test_mask_token_outside_tiny_vocab_refused(llama_target: Path, tmp_path: Path) -> None:
    config = tiny.shrink_config(real(B16_4B), target_layer_ids=[0, 2], mask_token_id=384, num_target_layers=4)
    drafter = tiny.write_checkpoint(tmp_path / "mask", config)
    with pytest.raises(DrafterError, match=r"dflash_config.mask_token_id: 384 is outside .*vocab_size 384"):
        make_host({"draft_model": str(drafter)}).load(str(llama_target))


def test_shrunk_configs_keep_field_names() -> None:
    for name, ids, _ in FORMATS.values():
        original = real(name)
        shrunk = tiny.shrink_config(copy.deepcopy(original), target_layer_ids=ids, mask_token_id=383, num_target_layers=4)
        assert set(shrunk) <= set(original) | {"dtype"}, name
        if "dflash_config" in original:
            assert set(shrunk["dflash_config"]) == set(original["dflash_config"])


def _param_shapes(config: Dict[str, Any]) -> Dict[str, list]:
    from mlx.utils import tree_flatten

    from mlx_speculative.drafters.dflash.model import Model

    return {k: list(v.shape) for k, v in tree_flatten(Model(ModelArgs.from_dict(config)).parameters())}  # lazy: no memory


def test_parameters_match_the_real_muse_assistant_header() -> None:
    config = real(MUSE)
    renames = tiny.tensor_names("flat", config)
    ours = {}
    for name, shape in _param_shapes(config).items():
        for old, new in renames.items():
            if name.startswith(old):
                name = new + name[len(old):]
        ours[name] = shape
    header = {}
    for line in (FIXTURES / f"{MUSE}.tensors.txt").read_text().splitlines():
        name, shape, _ = line.split()
        header[name] = json.loads(shape)
    assert ours == header


@pytest.mark.parametrize("name, count", [(B16_8B, 58), (NESTED, 69), (SPECULATORS, None),
                                         ("z-lab__Qwen3.6-35B-A3B-DFlash", None)])
def test_real_sizes_build(name: str, count: Any) -> None:
    shapes = _param_shapes(real(name))
    if count is not None:  # tensor counts pinned for the published checkpoints (docs/drafters.md)
        assert len(shapes) == count
    args = ModelArgs.from_dict(real(name))
    assert shapes["fc.weight"] == [args.hidden_size, len(args.target_layer_ids) * args.hidden_size]
