"""`mlx-spec bench` with a real target checkpoint, real drafter checkpoints (--drafter) and text prompts
(--prompts-file): real proposals, tau measured, greedy output identical to plain decoding (fp32, CPU)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict

import pytest
from mlx_lm.utils import load_tokenizer

from conftest import PROMPTS
from mlx_speculative.drafters.dflash import tiny
from mlx_speculative.drafters.eagle3 import tiny as eagle3_tiny
from mlx_speculative.hooks.api import encode_prompt
from mlx_speculative.hooks.cli import main
from mlx_speculative.benchmarks import real

pytestmark = pytest.mark.integration

FIXTURES = Path(__file__).parent / "fixtures" / "dflash"


@pytest.fixture(scope="module")
def dflash(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random DFlash checkpoint (z-lab format) for the 4-layer llama target: it accepts nothing."""
    config = json.loads((FIXTURES / "z-lab__Qwen3-4B-DFlash-b16.config.json").read_text())
    config = tiny.shrink_config(config, target_layer_ids=[0, 2], mask_token_id=383, num_target_layers=4)
    return tiny.write_checkpoint(tmp_path_factory.mktemp("bench_real") / "dflash", config, seed=66)


@pytest.fixture(scope="module")
def eagle3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random EAGLE-3 checkpoint (SpecForge format) capturing layers 0, 1, 3 of the llama target."""
    config = json.loads((FIXTURES.parent / "eagle3" / "sgl-project__SpecForge__llama3-8B-eagle3.config.json").read_text())
    return eagle3_tiny.write_checkpoint(tmp_path_factory.mktemp("bench_real") / "eagle3",
                                        eagle3_tiny.shrink_config(config, layer_ids=[0, 1, 3]), seed=5)


def _demo_prompts(path: Path) -> Path:
    """The demo's prompts.json format."""
    items = [{"file": "x.py", "line": i, "prompt": p, "reference": ""} for i, p in enumerate(PROMPTS[:3])]
    path.write_text(json.dumps({"prompts": items}))
    return path


def test_bench_real_drafters(tmp_path: Path, llama_pair: Dict[str, Path], dflash: Path,
                             eagle3: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out.json"
    prompts = _demo_prompts(tmp_path / "prompts.json")
    items = json.loads(prompts.read_text())
    items["prompts"][0]["chat"] = True  # one prompt through the chat template
    prompts.write_text(json.dumps(items))
    rc = main(["bench", "--model", str(llama_pair["target"]), "--drafter", f"{dflash}@4", "--drafter", f"{eagle3}@3", "--drafter",
               str(llama_pair["drafter"]), "--kind", "ngram", "--prompts-file", str(prompts), "--max-tokens", "16",
               "--cpu", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "fresh: first pass over the prompts" in printed and "prompts: 3 from" in printed
    report = json.loads(out.read_text())
    ckpts = report["drafter_checkpoints"]
    assert ckpts["dflash"]["kind"] == "dflash" and ckpts["dflash"]["blocks"] == [4]
    assert ckpts["draft_model"]["path"] == str(llama_pair["drafter"])
    assert ckpts["draft_model"]["blocks"] == [ckpts["draft_model"]["default_block"]]  # no --block-sizes: its own
    assert report["prompts"]["count"] == 3 and report["prompts"]["fresh_rule_holds"] is False
    assert report["prompt_lengths"]["bases"] == report["prompts"]["token_lengths"]
    tokenizer = load_tokenizer(llama_pair["target"])
    assert report["prompts"]["chat"] == 1 and report["prompts"]["token_lengths"][:2] == [
        len(encode_prompt(tokenizer, PROMPTS[0], chat=True)), len(encode_prompt(tokenizer, PROMPTS[1], chat=False))]
    b = ckpts["draft_model"]["default_block"]
    assert ckpts["eagle3"]["kind"] == "eagle3" and ckpts["eagle3"]["blocks"] == [3]
    spec = {"plugin dflash b4 real drafts", "plugin eagle3 b3 real drafts", f"plugin draft_model b{b} real drafts",
            f"plugin ngram b{ckpts['ngram']['blocks'][0]} real drafts", f"mlx_lm.speculative_generate_step b{b}"}
    for regime in ("fresh", "warm"):
        rows = report["results"][regime]
        assert set(rows) == {"mlx_lm.generate_step", "host plain (KVCache)"} | spec
        for name in spec:
            row = rows[name]
            assert row["identical_share"] == 1.0, (name, row["divergence"])  # lossless, fp32 on the CPU
            assert row["rounds"] > 0 and row["tau"] >= 1.0 and len(row["prompt_lens"]) == 3
            assert row["oracle_tau"] is None
        for name in spec - {f"mlx_lm.speculative_generate_step b{b}"}:
            assert rows[name]["proposals"] == "real"
        # real acceptance: the random DFlash and EAGLE-3 drafters accept nothing, the truncated draft model most
        assert rows["plugin dflash b4 real drafts"]["tau"] == rows["plugin eagle3 b3 real drafts"]["tau"] == 1.0
        assert rows[f"plugin draft_model b{b} real drafts"]["tau"] > 1.5


def test_bench_ngram_on_a_real_target(tmp_path: Path, llama_pair: Dict[str, Path]) -> None:
    """No drafter weights: --kind ngram with a real target and a plain-text prompts file (no --draft-model:
    mlx-lm's speculative loop is skipped)."""
    out = tmp_path / "out.json"
    text = tmp_path / "prompts.txt"
    text.write_text("\n\n".join(PROMPTS[:4]) + "\n")
    rc = main(["bench", "--model", str(llama_pair["target"]), "--kind", "ngram", "--block-sizes", "4",
               "--prompts-file", str(text), "--max-prompts", "2", "--max-tokens", "12", "--cpu", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["prompts"]["count"] == 2
    for regime in ("fresh", "warm"):
        rows = report["results"][regime]
        assert set(rows) == {"mlx_lm.generate_step", "host plain (KVCache)", "plugin ngram b4 real drafts"}
        assert rows["plugin ngram b4 real drafts"]["identical_share"] == 1.0


def test_bench_real_refusals(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    prompts = _demo_prompts(tmp_path / "prompts.json")
    cases = [
        (["--synthetic-target", "tiny", "--drafter", "some/drafter"], "--drafter: real drafter checkpoints need a real target"),
        (["--synthetic-target", "tiny", "--prompts-file", str(prompts)], "--prompts-file: text prompts need the target's tokenizer"),
        (["--model", "m", "--drafter", "d", "--kind", "dflash"], "--kind dflash with --drafter: allowed: auto"),
        (["--model", "m", "--drafter", "d", "--draft-model", "x"], "give the draft LM as one more --drafter"),
        (["--model", "m", "--prompts-file", str(prompts), "--prompt-lengths", "64"], "--prompt-lengths: not used with"),
        (["--model", "m", "--drafter", "d@1"], "expected PATH or PATH@B with B from 2 to 128"),
    ]
    for argv, message in cases:
        capsys.readouterr()
        assert main(["bench", "--cpu", *argv]) != 0, argv
        assert message in capsys.readouterr().err, argv


def test_read_prompts(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text(json.dumps(["one", "two"]))
    assert real.read_prompts(str(tmp_path / "a.json")) == [("one", False), ("two", False)]
    (tmp_path / "b.txt").write_text("first\nline two\n\n\nsecond\n")
    assert real.read_prompts(str(tmp_path / "b.txt")) == [("first\nline two", False), ("second", False)]
    (tmp_path / "e.json").write_text(json.dumps({"prompts": [{"prompt": "hi", "chat": True}, "raw"]}))
    assert real.read_prompts(str(tmp_path / "e.json")) == [("hi", True), ("raw", False)]
    (tmp_path / "f.json").write_text(json.dumps({"prompts": [{"prompt": "hi", "chat": "yes"}]}))
    with pytest.raises(ValueError, match="expected true or false"):
        real.read_prompts(str(tmp_path / "f.json"))
    (tmp_path / "c.json").write_text(json.dumps({"prompts": [{"file": "x"}]}))
    with pytest.raises(ValueError, match="prompt 0 is dict"):
        real.read_prompts(str(tmp_path / "c.json"))
    (tmp_path / "d.json").write_text(json.dumps({"items": []}))
    with pytest.raises(ValueError, match='without a "prompts" list'):
        real.read_prompts(str(tmp_path / "d.json"))
    assert real.parse_drafter("ckpt/dflash@16") == real.DrafterSpec("ckpt/dflash", 16)
    assert real.parse_drafter("org/name@main") == real.DrafterSpec("org/name@main")
