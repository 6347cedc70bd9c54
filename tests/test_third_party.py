"""The example third-party drafter package is installed, discovered through its entry point and used."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict

import mlx.core as mx
import pytest

from conftest import make_host
from test_cli import mlx_spec

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "third_party_drafter"


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    site = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(site), str(EXAMPLE)], check=True, capture_output=True, timeout=300)
    return site


def _bigram_checkpoint(target_dir: Path, out: Path) -> Path:
    """A [V, V] table of the target's greedy next token after each single token."""
    target = make_host(None, plugins=False).load(str(target_dir))
    vocab = target.model_config["vocab_size"]
    logits = target.model(mx.arange(vocab)[:, None])[:, 0, :]  # [V, V]
    out.mkdir()
    mx.save_safetensors(str(out / "model.safetensors"), {"bigram.weight": logits})
    (out / "config.json").write_text(json.dumps({"model_type": "bigram_drafter", "vocab_size": vocab}))
    return out


def test_example_family_is_discovered_and_used(installed: Path, llama_pair: Dict[str, Path], tmp_path: Path) -> None:
    env = {"PYTHONPATH": os.pathsep.join([str(installed), os.environ.get("PYTHONPATH", "")])}
    rows = {r["kind"]: r for r in json.loads(mlx_spec("drafters", "--json", env=env).stdout)}
    assert rows["bigram"]["distribution"] == "spec-bigram"
    assert "bigram" not in {r["kind"] for r in json.loads(mlx_spec("drafters", "--json").stdout)}

    ckpt = _bigram_checkpoint(llama_pair["target"], tmp_path / "bigram")
    args = ["generate", "--model", str(llama_pair["target"]), "--prompt", "one two three four", "--max-tokens", "40",
            "--json", "--ignore-chat-template"]
    spec = mlx_spec(*args, "--draft-model", str(ckpt), env=env)
    assert spec.returncode == 0, spec.stderr
    out = json.loads(spec.stdout)
    plain = json.loads(mlx_spec(*args, "--no-speculative").stdout)
    assert out["speculative"]["kind"] == "bigram"
    assert out["speculative"]["accepted_tokens"] > 0
    assert out["tokens"] == plain["tokens"]
