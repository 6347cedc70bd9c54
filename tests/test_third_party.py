"""The example third-party drafter package is installed, discovered through its entry point and used.

The package is installed from a copy (a build writes build/ and *.egg-info next to its sources) into
a temporary folder; the tests hold whether or not it is also installed in the environment (CI
installs it first, as its README says).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path
from typing import Dict

import mlx.core as mx
import pytest

from conftest import make_host
from test_cli import mlx_spec

pytestmark = pytest.mark.integration

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "third_party_drafter"


def _installed_in_environment() -> bool:
    try:
        distribution("spec-bigram")
    except PackageNotFoundError:
        return False
    return True


def _tree(root: Path) -> set:
    return {str(p.relative_to(root)) for p in root.rglob("*") if "__pycache__" not in p.parts}


EXAMPLE_BEFORE = _tree(EXAMPLE)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    source = tmp_path_factory.mktemp("src") / "third_party_drafter"
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    site = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(site), str(source)], check=True, capture_output=True, timeout=300)
    return site


def test_install_writes_nothing_into_the_example(installed: Path) -> None:
    assert (installed / "spec_bigram" / "make.py").is_file()
    assert _tree(EXAMPLE) == EXAMPLE_BEFORE  # no build/ or *.egg-info from the install above


def test_make_writes_the_target_bigram_table(installed: Path, llama_pair: Dict[str, Path], tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(installed), os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "bigram"
    done = subprocess.run([sys.executable, "-m", "spec_bigram.make", "--target", str(llama_pair["target"]),
                           "--out", str(out)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    target = make_host(None, plugins=False).load(str(llama_pair["target"]))
    table = mx.load(str(out / "model.safetensors"))["bigram.weight"]
    vocab = target.model_config["vocab_size"]
    assert table.shape == (vocab, vocab)
    for t in (0, 5, vocab - 1):  # row t: the target's logits after the one-token prompt [t]
        assert mx.allclose(table[t], target.model(mx.array([[t]]))[0, -1], atol=1e-5).item()
    assert json.loads((out / "config.json").read_text()) == {"model_type": "bigram_drafter", "vocab_size": vocab}
    bad = subprocess.run([sys.executable, "-m", "spec_bigram.make", "--target", str(tmp_path / "nope"),
                          "--out", str(tmp_path / "x")], capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode == 2 and "not found" in bad.stderr


def test_example_family_is_discovered_and_used(installed: Path, llama_pair: Dict[str, Path], tmp_path: Path) -> None:
    env = {"PYTHONPATH": os.pathsep.join([str(installed), os.environ.get("PYTHONPATH", "")])}
    rows = {r["kind"]: r for r in json.loads(mlx_spec("drafters", "--json", env=env).stdout)}
    assert rows["bigram"]["distribution"] == "spec-bigram"
    without = {r["kind"] for r in json.loads(mlx_spec("drafters", "--json").stdout)}
    assert ("bigram" in without) == _installed_in_environment()

    ckpt = tmp_path / "bigram"
    done = subprocess.run([sys.executable, "-m", "spec_bigram.make", "--target", str(llama_pair["target"]),
                           "--out", str(ckpt)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, **env))
    assert done.returncode == 0, done.stderr
    args = ["generate", "--model", str(llama_pair["target"]), "--prompt", "one two three four", "--max-tokens", "40",
            "--json", "--ignore-chat-template"]
    spec = mlx_spec(*args, "--draft-model", str(ckpt), env=env)
    assert spec.returncode == 0, spec.stderr
    out = json.loads(spec.stdout)
    plain = json.loads(mlx_spec(*args, "--no-speculative").stdout)
    assert out["speculative"]["kind"] == "bigram"
    assert out["speculative"]["accepted_tokens"] > 0
    assert out["tokens"] == plain["tokens"]
