"""The embedded demo as shipped (demo/): its checkpoints have the real layouts (the field and tensor
names of the published checkpoints in tests/fixtures), load through the normal registry, fit the size
bound, and every drafter decodes held-out prompts exactly as plain decoding does."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest

from mlx_speculative import demo
from mlx_speculative.demo import build
from mlx_speculative.drafters import registry
from mlx_speculative.drafters.mtp.qwen import expected_names
from mlx_speculative.drafters.mtp.qwen3_5_mtp import ModelArgs as HeadArgs
from mlx_speculative.hooks.cli import main
from test_bench_scripts import script  # bench/ scripts, loaded by path

pytestmark = pytest.mark.integration

FIXTURES = Path(__file__).parent / "fixtures"


def _config(kind: str) -> dict:
    return json.loads((demo.drafter_dir(kind) / "config.json").read_text())


def _names(kind: str) -> set:
    return set(mx.load(str(demo.drafter_dir(kind) / "model.safetensors")))


def test_the_demo_is_complete_and_within_its_size_bound() -> None:
    manifest = json.loads((demo.HERE / "manifest.json").read_text())
    files = [f for d in ("target", *demo.KINDS) for f in (demo.HERE / d).glob("*.safetensors")]
    assert len(files) == 5 and sum(f.stat().st_size for f in files) <= build.MAX_BYTES
    assert manifest["corpus"]["python"].startswith(demo.corpus.PYTHON + ".") and manifest["corpus"]["hash"]
    assert len(json.loads((demo.HERE / "prompts.json").read_text())["prompts"]) == build.PROMPTS
    held = {f for f, _ in manifest["corpus"]["heldout"]}
    assert held and not held & {f for f, _ in manifest["corpus"]["train"]}
    assert {p["file"] for p in json.loads((demo.HERE / "prompts.json").read_text())["prompts"]} <= held


def test_dflash_has_z_labs_layout() -> None:
    config, real = _config("dflash"), json.loads((FIXTURES / "dflash" / "z-lab__Qwen3-8B-DFlash-b16.config.json").read_text())
    assert set(config) == set(real) - {"auto_map", "transformers_version"}
    assert set(config["dflash_config"]) == set(real["dflash_config"]) and config["block_size"] == 16
    per_layer = {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                 "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                 "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight"}
    n = config["num_hidden_layers"]
    assert _names("dflash") == {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
        f"layers.{i}.{p}" for i in range(n) for p in per_layer}


def test_eagle3_has_specforges_layout() -> None:
    config = _config("eagle3")
    real = json.loads((FIXTURES / "eagle3" / "sgl-project__SpecForge__llama3-8B-eagle3.config.json").read_text())
    assert config["architectures"] == real["architectures"] == ["LlamaForCausalLMEagle3"]
    # Beyond SpecForge's file: LlamaConfig fields it leaves at their defaults, and its eagle_config (layer ids).
    assert set(config) - set(real) <= {"eagle_config", "head_dim", "attention_bias", "rope_scaling", "rope_theta"}
    assert set(real) - set(config) <= {"initializer_range", "pad_token_id", "transformers_version", "use_cache"}
    names = _names("eagle3")
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "midlayer.hidden_norm.weight",
            "midlayer.self_attn.q_proj.weight"} <= names and "embed_tokens.weight" not in names


def test_mtp_has_the_split_head_layout() -> None:
    config = _config("mtp")
    assert config["model_type"] == "qwen3_5_mtp" and config["target_model_type"] == "llama"
    assert _names("mtp") == set(expected_names(HeadArgs(config["text_config"])))


@pytest.mark.parametrize("name,kind", [("demo-drafter", "dflash"), ("demo-eagle3", "eagle3"), ("demo-mtp", "mtp"),
                                       ("demo-draft-model", "draft_model")])
def test_every_drafter_resolves_and_is_compatible(name: str, kind: str, capsys: pytest.CaptureFixture) -> None:
    assert registry.resolve(name).kind == kind
    assert main(["check", "--model", "demo", "--draft-model", name]) == 0
    assert "verdict: compatible" in capsys.readouterr().out


def test_every_drafter_decodes_held_out_prompts_exactly(tmp_path: Path) -> None:
    acceptance = script("demo_acceptance")
    out = tmp_path / "acceptance.json"
    assert acceptance.main(["--demo-dir", str(demo.HERE), "--prompts", "2", "--max-tokens", "24", "--sampled-prompts", "1",
                        "--cpu", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    kinds = report["kinds"]
    assert set(kinds) == {"dflash", "eagle3", "mtp", "draft_model", "ngram"}, report["notes"]
    for kind, r in kinds.items():
        assert r["exact"]["identical"] == r["exact"]["of"] == 2, (kind, r["exact"])
        assert r["greedy"]["rounds"] > 0
    assert {kind: r["block"] for kind, r in kinds.items() if kind != "ngram"} == {
        "dflash": 16, "eagle3": 8, "mtp": 4, "draft_model": 4}


def test_target_confidence_script(tmp_path: Path) -> None:
    """bench/demo_confidence.py: the greedy path's top-1 probability, checked against the target directly."""
    confidence = script("demo_confidence")
    out = tmp_path / "confidence.json"
    assert confidence.main(["--demo-dir", str(demo.HERE), "--prompts", "1", "--max-tokens", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["greedy_steps"] == 1
    # one step: the top-1 probability of the prompt's last position, which greedy decoding takes
    target = confidence.da.load_target(demo.HERE, "float32")
    prompt = json.loads((demo.HERE / "prompts.json").read_text())["prompts"][0]["prompt"]
    ids = confidence.encode_prompt(target.tokenizer, prompt, chat=False)
    probs = mx.softmax(target.model(mx.array([ids]))[0, -1].astype(mx.float32), axis=-1)
    assert report["mean_top1_probability"] == pytest.approx(float(probs.max()), abs=1e-4)
    top2 = mx.sort(probs)[-2:]
    assert report["share_top2_within_0.1"] == float(top2[1] - top2[0] < 0.1)


def test_the_prompts_references_pass_the_parse_rule() -> None:
    """prompts.json carries each prompt's preamble (its file's open blocks, brackets and strings at the
    prompt's first line), so the file's own continuation passes the parse rule at every cut length."""
    acceptance = script("demo_acceptance")
    items = json.loads((demo.HERE / "prompts.json").read_text())["prompts"]
    assert len(items) == build.PROMPTS and all("preamble" in it for it in items)
    for it in items:
        for n in (80, 200, 400, 1000):
            assert acceptance.parses(it["prompt"], it["reference"][:n], it["preamble"])[0] in (None, "no complete line"), (it["file"], n)
    # without the preambles the same references fail where a prompt starts inside a bracket or a docstring
    assert sum(acceptance.parses(it["prompt"], it["reference"][:400])[0] is not None for it in items) >= 3


def test_parity_script(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """bench/demo_parity.py: decoding from the training core's held-out prompts gives its sequences back."""
    parity = script("demo_parity")
    out = tmp_path / "parity.json"
    assert parity.main(["--demo-dir", str(demo.HERE), "--prompts", "1", "--seq-len", "96", "--kinds", "dflash,mtp",
                        "--heldout-tokens", "24", "--work", str(tmp_path / "work"), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["kinds"]) == {"dflash", "mtp"}
    for r in report["kinds"].values():
        assert r["same"] == r["of"] == 1
        assert r["offline"]["rounds"] > 0 and r["decoding"]["rounds"] > 0
        # a short sequence: the tails differ (offline stops a block before the end), the rates agree
        assert abs(r["offline"]["acceptance_rate"] - r["decoding"]["acceptance_rate"]) < 0.1, r
        h = r["heldout_offline"]  # the held-out prompt itself, whole and cut to its last 64 tokens
        assert h["prompts"] == 1 and h["rounds"] > 0 and 1 <= h["tau"] <= r["block"], h
        assert 1 <= h["tau_all_anchors_context_cut_to_64"] <= r["block"] and 0 <= h["first_draft_token_accepted_all_anchors"] <= 1
    assert report["heldout_prompt_tokens"]["prompts"] == build.PROMPTS
    with pytest.raises(SystemExit):
        parity.main(["--demo-dir", str(demo.HERE), "--heldout-tokens", "-1"])
    assert "--heldout-tokens: got -1; allowed: 0 (off) or a positive number" in capsys.readouterr().err
