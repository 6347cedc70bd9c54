"""Which BLAS MLX's CPU matmuls call, the start-up hint, and ``MLX_SPEC_BLAS``'s one re-execution.

Real processes: ``mlx-spec generate`` on a tiny target, once with nothing set (the hint), with
``MLX_SPEC_BLAS=off`` (none), with a library that is no BLAS preloaded (the process re-executes
itself exactly once, then says the preload did not take), and where OpenBLAS is installed with
``MLX_SPEC_BLAS=auto`` (MLX then calls OpenBLAS).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest

from mlx_speculative.hooks import blas
from mlx_speculative.testing import tiny_models as tm

pytestmark = pytest.mark.integration

LINUX_REFERENCE = sys.platform.startswith("linux") and blas.bundled_blas() is not None
NOTE = "[mlx-spec] note: MLX's CPU matmuls use the reference BLAS"


def test_classify_names_the_library_not_the_link() -> None:
    assert blas.classify("/venv/lib/python3.11/site-packages/mlx_cpu.libs/libblas-bd8a282c.so.3.10.0") == "reference"
    assert blas.classify("/usr/lib/x86_64-linux-gnu/blas/libblas.so.3") == "reference"
    assert blas.classify("/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3") == "openblas"
    assert blas.classify("/opt/x/cmeel.prefix/lib/libopenblas.so.0") == "openblas"
    assert blas.classify("/opt/intel/lib/libmkl_rt.so.2") == "mkl"
    assert blas.classify("/usr/lib/libz.so.1") == "other"


def test_bad_values_are_one_line_errors(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for value, said in (("fast", "got 'fast'"), ("/no/such/libopenblas.so.0", "(no such file)")):
        monkeypatch.setenv(blas.ENV, value)
        with pytest.raises(ValueError, match=r"^MLX_SPEC_BLAS: .*; allowed: auto .*openblas .*off .*path") as err:
            blas.mode()
        assert said in str(err.value) and "\n" not in str(err.value)
    monkeypatch.setenv(blas.ENV, " Auto ")
    assert blas.mode() == "auto"
    lib = tmp_path / "libmine.so"
    lib.write_bytes(b"")
    monkeypatch.setenv(blas.ENV, str(lib))
    assert blas.mode() == str(lib)


def test_reexec_sets_ld_preload_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls: List[Dict[str, object]] = []
    monkeypatch.setattr(blas.os, "execve", lambda exe, argv, env: calls.append({"exe": exe, "argv": argv, "env": env}))
    monkeypatch.setattr(blas, "in_use", lambda: blas.BlasInUse("reference", "/x/libblas.so.3"))
    lib = tmp_path / "libopenblas.so.0"
    lib.write_bytes(b"")
    for value in ("", "off"):
        monkeypatch.setenv(blas.ENV, value)
        blas.reexec_if_asked()
    assert calls == []
    monkeypatch.setenv(blas.ENV, str(lib))
    monkeypatch.setenv("LD_PRELOAD", "/their/libfoo.so")
    blas.reexec_if_asked()
    (call,) = calls
    assert call["exe"] == sys.executable and call["argv"] == [sys.executable, *sys.orig_argv[1:]]
    assert call["env"]["LD_PRELOAD"] == f"{lib}:/their/libfoo.so" and call["env"][blas.MARK] == str(lib)
    monkeypatch.setenv(blas.MARK, str(lib))  # the re-executed process: never again
    blas.reexec_if_asked()
    assert len(calls) == 1
    monkeypatch.delenv(blas.MARK)
    monkeypatch.setattr(blas, "in_use", lambda: blas.BlasInUse("openblas", "/usr/lib/libopenblas.so.0"))
    blas.reexec_if_asked()  # already optimised (the user's own LD_PRELOAD)
    assert len(calls) == 1
    monkeypatch.setattr(blas, "in_use", lambda: blas.BlasInUse("reference", "/x/libblas.so.3"))
    monkeypatch.setattr(blas, "find_openblas", lambda: None)
    monkeypatch.setenv(blas.ENV, "auto")
    blas.reexec_if_asked()  # none installed: the hint says what to do
    monkeypatch.setenv(blas.ENV, "openblas")
    with pytest.raises(ValueError, match="no OpenBLAS found .*apt-get install libopenblas0-pthread"):
        blas.reexec_if_asked()
    assert len(calls) == 1


# -- real processes ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return tm.make_checkpoint(tmp_path_factory.mktemp("blas") / "t", tm.llama_config(), seed=3, tokenizer_dir=tokenizer_dir)


def generate(target: Path, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in (blas.ENV, blas.MARK, "LD_PRELOAD")}
    full.update(HF_HUB_OFFLINE="1", **env)
    return subprocess.run([sys.executable, "-m", "mlx_speculative.hooks.cli", "-v", "generate", "--model", str(target),
                           "--max-tokens", "2", "--no-speculative", "--json"], capture_output=True, text=True, env=full,
                          timeout=120)


def _lines(proc: subprocess.CompletedProcess, start: str) -> List[str]:
    assert proc.returncode == 0, proc.stderr
    return [line for line in proc.stderr.splitlines() if line.startswith(start)]


@pytest.mark.skipif(not LINUX_REFERENCE, reason="MLX's Linux CPU wheel (mlx-cpu) bundles the reference BLAS")
def test_the_hint_on_the_reference_blas_and_off(target: Path) -> None:
    (note,) = _lines(generate(target), NOTE)
    assert "MLX_SPEC_BLAS=auto" in note and "MLX_SPEC_BLAS=off hides this line" in note
    quiet = generate(target, MLX_SPEC_BLAS="off")
    assert _lines(quiet, "[mlx-spec] note") == [] and "BLAS of MLX's CPU matmuls: reference" in quiet.stderr


@pytest.mark.skipif(not LINUX_REFERENCE or not os.path.exists("/proc/self/maps"), reason="Linux, mlx-cpu")
def test_a_preload_that_does_not_take_reexecutes_once_and_says_so(target: Path) -> None:
    import zlib  # noqa: F401 - maps libz.so, a shared library that is no BLAS

    with open("/proc/self/maps") as f:
        libz = sorted({line.split()[-1] for line in f if "/libz.so" in line})
    if not libz:
        pytest.skip("no shared libz mapped")
    proc = generate(target, MLX_SPEC_BLAS=libz[0])
    (note,) = _lines(proc, "[mlx-spec] note")  # one process printed it: re-executed once, not in a loop
    assert f"MLX_SPEC_BLAS preloaded {libz[0]}, but MLX still calls the reference BLAS" in note


@pytest.mark.skipif(not LINUX_REFERENCE or blas.find_openblas() is None, reason="needs an installed OpenBLAS")
def test_auto_runs_on_openblas(target: Path) -> None:
    plain = generate(target)
    proc = generate(target, MLX_SPEC_BLAS="auto")
    assert _lines(proc, "[mlx-spec] note") == []
    assert "BLAS of MLX's CPU matmuls: openblas" in proc.stderr and "preloaded by MLX_SPEC_BLAS" in proc.stderr
    assert json.loads(proc.stdout)["tokens"] == json.loads(plain.stdout)["tokens"]
