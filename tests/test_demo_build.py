"""The demo's build script (demo/build.py): the target's pretraining resumes bit for bit, the corpus
is pinned, and a tiny build end to end makes every drafter through `mlx-spec train-drafter`."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_speculative.demo import build, corpus, pretrain

pytestmark = pytest.mark.integration

TINY = replace(build.TINY_TARGET, steps=12, checkpoint_every=5)


def _weights(model) -> dict:
    return {k: np.array(v) for k, v in tree_flatten(model.parameters())}


def test_pretraining_interrupted_and_resumed_ends_with_the_same_weights(tmp_path: Path) -> None:
    mx.set_default_device(mx.cpu)
    stream = np.random.default_rng(0).integers(0, TINY.vocab_size, 5000).astype(np.int32)
    whole = pretrain.train(TINY, stream, tmp_path / "whole", log=lambda m: None)
    assert pretrain.train(TINY, stream, tmp_path / "parts", until=7, log=lambda m: None) is None
    assert json.loads((tmp_path / "parts" / "state.json").read_text())["step"] == 7
    resumed = pretrain.train(TINY, stream, tmp_path / "parts", log=lambda m: None)
    a, b = _weights(whole), _weights(resumed)
    assert a.keys() == b.keys()
    assert all(np.array_equal(a[k], b[k]) for k in a)
    # and the run did train: the weights moved from the seed's initialisation
    fresh = pretrain.train(replace(TINY, steps=1), stream, tmp_path / "one", log=lambda m: None)
    assert any(not np.array_equal(a[k], _weights(fresh)[k]) for k in a)


def test_a_resumed_run_with_other_options_is_refused(tmp_path: Path) -> None:
    stream = np.random.default_rng(0).integers(0, TINY.vocab_size, 5000).astype(np.int32)
    pretrain.train(TINY, stream, tmp_path, until=2, log=lambda m: None)
    with pytest.raises(SystemExit, match="other options"):
        pretrain.train(replace(TINY, lr=1e-2), stream, tmp_path, log=lambda m: None)


def test_the_corpus_is_pinned(tmp_path: Path) -> None:
    lib = tmp_path / "lib"
    for name, text in {"a.py": "x = 1\n", "b.py": "y = 2\n", "test/t.py": "z = 3\n"}.items():
        (lib / name).parent.mkdir(parents=True, exist_ok=True)
        (lib / name).write_text(text)
    found = corpus.collect(lib)
    assert [f for f, _ in found["train"]] == ["a.py", "b.py", "test/t.py"]
    corpus.check_pin(found, found)
    (lib / "b.py").write_text("y = 3\n")
    with pytest.raises(SystemExit, match=r"differs in 1 files, e\.g\. b\.py"):
        corpus.check_pin(corpus.collect(lib), found)


@pytest.mark.slow
def test_a_tiny_build_makes_every_drafter_with_train_drafter(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    cmd = [sys.executable, "-m", "mlx_speculative.demo.build", "--work", str(tmp_path / "work"), "--out", str(out),
           "--tiny", "--cpu"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert set(manifest["drafters"]) == set(build.KINDS)
    assert len(json.loads((out / "prompts.json").read_text())["prompts"]) == build.PROMPTS
    for kind in build.KINDS:
        assert not (out / kind / "training").exists()
        check = subprocess.run([sys.executable, "-m", "mlx_speculative.hooks.cli", "check", "--model", str(out / "target"),
                                "--draft-model", str(out / kind)], capture_output=True, text=True, timeout=300)
        assert check.returncode == 0, check.stdout + check.stderr
        resolved = "draft_model" if kind == "draft_model" else kind
        assert resolved in check.stdout, check.stdout
    # a second run finds every stage done and only installs again
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "train-drafter" not in again.stdout, again.stdout[-2000:]
