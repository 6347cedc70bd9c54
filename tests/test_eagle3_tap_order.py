"""EAGLE-3 taps listed out of order are concatenated in ascending layer order (vLLM's and mlx-vlm's rule).

One tiny SpecForge-layout drafter (fc trained, as every published one is, on the taps in ascending
order) is saved twice: with its ids ascending and listed as [3, 0, 2]. Both capture the same layers in
the same order and draft the same tokens round by round; a copy whose fc blocks are swapped (fc trained
on another order) drafts differently, so the comparison can tell orders apart.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Dict, List

import mlx.core as mx
import pytest

from conftest import PROMPTS, encode, greedy_reference, make_host, no_stop
from mlx_speculative.drafters.eagle3 import tiny
from mlx_speculative.drafters.eagle3.batch import Eagle3Batch
from mlx_speculative.testing import tiny_models as tm
from mlx_speculative.hooks.cli import main

pytestmark = pytest.mark.integration

SPECFORGE = Path(__file__).parent / "fixtures" / "eagle3" / "sgl-project__SpecForge__llama3-8B-eagle3.config.json"
ASCENDING, LISTED = [0, 2, 3], [3, 0, 2]
PROPOSE = Eagle3Batch.propose  # unwrapped, whichever drafter a test wraps first


def _with_ids(src: Path, out: Path, ids: List[int]) -> Path:
    shutil.copytree(src, out)
    config = json.loads((out / "config.json").read_text())
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = ids
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Dict[str, Path]:
    root = tmp_path_factory.mktemp("eagle3_taps")
    target = tm.make_checkpoint(root / "target", tm.llama_config(num_hidden_layers=4), seed=8, tokenizer_dir=tokenizer_dir)
    config = tiny.shrink_config(json.loads(SPECFORGE.read_text()), layer_ids=ASCENDING)
    ascending = tiny.write_checkpoint(root / "ascending", config, seed=5, scale=3.0)
    swapped = _with_ids(ascending, root / "swapped", ASCENDING)
    weights = dict(mx.load(str(swapped / "model.safetensors")))
    width = weights["fc.weight"].shape[1] // 3
    blocks = [weights["fc.weight"][:, i * width:(i + 1) * width] for i in (2, 0, 1)]  # fc trained on layers 3, 0, 2
    weights["fc.weight"] = mx.concatenate(blocks, axis=1)
    mx.save_safetensors(str(swapped / "model.safetensors"), weights, metadata={"format": "pt"})
    return {"target": target, "ascending": ascending, "listed": _with_ids(ascending, root / "listed", LISTED),
            "swapped": swapped}


def _drafts(models: Dict[str, Path], drafter: str, monkeypatch: pytest.MonkeyPatch) -> Dict[str, Any]:
    """Every round's draft tokens and the output, the drafter's own proposals verified as usual."""
    host = make_host({"draft_model": str(models[drafter]), "block_size": 4, "adaptive": False})
    target = host.load(str(models["target"]))
    seen: List[List[int]] = []

    def propose(self: Eagle3Batch, rows: List[Any], max_drafts: List[int]) -> List[Any]:
        out = PROPOSE(self, rows, max_drafts)
        seen.extend([int(t) for t in mx.array(p.tokens).tolist()] for p in out)
        return out

    monkeypatch.setattr(Eagle3Batch, "propose", propose)
    prompt = encode(target, PROMPTS[4])
    tokens = host.generate(target, prompt, no_stop(24)).tokens
    assert tokens == greedy_reference(target.model, prompt, 24)
    return {"capture": target.attachments["speculative"].drafter.capture_layers(), "drafts": seen}


def test_taps_listed_out_of_order_draft_as_ascending(models: Dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    ascending = _drafts(models, "ascending", monkeypatch)
    listed = _drafts(models, "listed", monkeypatch)
    assert ascending["capture"] == listed["capture"] == [0, 2, 3]  # specforge ids name layer outputs
    assert len(ascending["drafts"]) >= 4 and listed["drafts"] == ascending["drafts"]
    assert _drafts(models, "swapped", monkeypatch)["drafts"] != ascending["drafts"]


def test_check_says_the_order_it_reads(models: Dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    assert main(["check", "--model", str(models["target"]), "--draft-model", str(models["listed"])]) == 0
    out = capsys.readouterr().out
    assert "[0, 2, 3] (from the checkpoint, listed as [3, 0, 2]: fc reads the taps in ascending layer order)" in out
