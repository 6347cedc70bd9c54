"""`mlx-spec` as a user runs it: generate (--json, plain), drafters, check, and one-line errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest

from mlx_speculative.testing import tiny_models as tm

pytestmark = pytest.mark.integration


def mlx_spec(*args: str, env: Dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, HF_HUB_OFFLINE="1", **(env or {}))
    for key in ("MLX_VLM_DRAFT_KIND", "MLX_VLM_DRAFT_MODEL", "MLX_VLM_DRAFT_BLOCK_SIZE"):
        if not env or key not in env:
            full_env.pop(key, None)
    return subprocess.run([sys.executable, "-m", "mlx_speculative.hooks.cli", *args], capture_output=True,
                          text=True, env=full_env, cwd=cwd, timeout=300)


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("mlx-spec: error:")]
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_generate_json_fields(llama_pair: Dict[str, Path]) -> None:
    proc = mlx_spec("generate", "--model", str(llama_pair["target"]), "--draft-model", str(llama_pair["drafter"]),
                    "--prompt", "red green blue one two", "--max-tokens", "24", "--json", "--ignore-chat-template")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out) >= {"text", "tokens", "prompt_tokens", "generation_tokens", "generation_tps", "speculative"}
    spec = out["speculative"]
    assert spec["kind"] == "draft_model"
    for key in ("rounds", "draft_tokens", "accepted_tokens", "mean_acceptance_length", "acceptance_rate",
                "accepted_per_position"):
        assert key in spec
    assert spec["mean_acceptance_length"] == pytest.approx(1 + spec["accepted_tokens"] / spec["rounds"], abs=1e-3)
    assert sum(spec["accepted_per_position"]) == spec["accepted_tokens"]
    assert out["generation_tokens"] == len(out["tokens"]) <= 24

    plain = json.loads(mlx_spec("generate", "--model", str(llama_pair["target"]), "--prompt", "red green blue one two",
                                "--max-tokens", "24", "--json", "--ignore-chat-template", "--no-speculative").stdout)
    assert plain["speculative"] is None
    assert plain["tokens"] == out["tokens"]


def test_generate_streams_text_and_one_stats_line(llama_pair: Dict[str, Path]) -> None:
    proc = mlx_spec("generate", "--model", str(llama_pair["target"]), "--draft-kind", "ngram", "--max-tokens", "16")
    assert proc.returncode == 0, proc.stderr
    stats = [line for line in proc.stderr.splitlines() if line.startswith("[mlx-spec] prompt")]
    assert len(stats) == 1 and "speculative ngram" in stats[0] and "tau" in stats[0]


def test_generate_demo_default() -> None:
    """No model: the embedded demo with its DFlash drafter, whose output equals the demo's plain decoding."""
    proc = mlx_spec("generate", "--max-tokens", "48", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["speculative"]["kind"] == "dflash" and out["speculative"]["rounds"] > 0
    plain = json.loads(mlx_spec("generate", "--max-tokens", "48", "--json", "--no-speculative").stdout)
    assert plain["tokens"] == out["tokens"]


def test_config_file_and_env_precedence(llama_pair: Dict[str, Path], tmp_path: Path) -> None:
    cfg = tmp_path / "host.yaml"
    cfg.write_text(f"model: {llama_pair['target']}\nspeculative:\n  kind: ngram\n  block_size: 3\n")
    out = json.loads(mlx_spec("generate", "--config", str(cfg), "--max-tokens", "12", "--json").stdout)
    assert out["speculative"]["kind"] == "ngram" and set(out["speculative"]["block_sizes"]) == {3}
    env = {"MLX_VLM_DRAFT_MODEL": str(llama_pair["drafter"]), "MLX_VLM_DRAFT_KIND": "draft_model",
           "MLX_VLM_DRAFT_BLOCK_SIZE": "5"}
    out = json.loads(mlx_spec("generate", "--config", str(cfg), "--max-tokens", "12", "--json", env=env).stdout)
    assert out["speculative"]["kind"] == "draft_model" and set(out["speculative"]["block_sizes"]) == {5}
    out = json.loads(mlx_spec("generate", "--config", str(cfg), "--max-tokens", "12", "--json",
                              "--draft-block-size", "2", env=env).stdout)
    assert set(out["speculative"]["block_sizes"]) == {2}


def test_drafters_lists_builtins() -> None:
    proc = mlx_spec("drafters", "--json")
    rows = {r["kind"]: r for r in json.loads(proc.stdout)}
    assert {"draft_model", "ngram"} <= set(rows)
    assert rows["ngram"]["distribution"] == "mlx-speculative"


def test_check_verdicts(llama_pair: Dict[str, Path], tmp_path: Path, tokenizer_dir: Path) -> None:
    ok = mlx_spec("check", "--model", str(llama_pair["target"]), "--draft-model", str(llama_pair["drafter"]))
    assert ok.returncode == 0 and "kind: draft_model" in ok.stdout and "verdict: compatible" in ok.stdout
    other = tm.make_checkpoint(tmp_path / "v512", tm.llama_config(vocab_size=512, num_hidden_layers=1),
                               tokenizer_dir=tokenizer_dir)
    bad = mlx_spec("check", "--model", str(llama_pair["target"]), "--draft-model", str(other), "--json")
    assert bad.returncode == 1
    report = json.loads(bad.stdout)
    assert report["compatible"] is False and any("512" in r and "384" in r for r in report["reasons"])


def _broken_checkpoints(root: Path, good: Path) -> Dict[str, Path]:
    corrupt = root / "corrupt"
    shutil.copytree(good, corrupt)
    data = (corrupt / "model.safetensors").read_bytes()
    (corrupt / "model.safetensors").write_bytes(data[: len(data) // 2])
    no_type = root / "no_type"
    shutil.copytree(good, no_type)
    cfg = json.loads((no_type / "config.json").read_text())
    del cfg["model_type"]
    (no_type / "config.json").write_text(json.dumps(cfg))
    return {"corrupt": corrupt, "no_type": no_type}


@pytest.mark.parametrize("role", ["--model", "--draft-model"])
def test_bad_checkpoints_get_one_line_errors(role: str, llama_pair: Dict[str, Path], tmp_path: Path) -> None:
    broken = _broken_checkpoints(tmp_path, llama_pair["drafter"])
    base: List[str] = ["generate", "--max-tokens", "4"]
    if role == "--draft-model":
        base += ["--model", str(llama_pair["target"])]
    cases = {
        "missing": (str(tmp_path / "does-not-exist"), "not found"),
        "corrupt": (str(broken["corrupt"]), "not a valid safetensors file"),
        "no_type": (str(broken["no_type"]), "has no 'model_type'"),
    }
    for name, (path, expected) in cases.items():
        line = one_line_error(mlx_spec(*base, role, path))
        assert expected in line, (name, line)


def test_vocab_mismatch_refused_naming_both_sizes(llama_pair: Dict[str, Path], tmp_path: Path, tokenizer_dir: Path) -> None:
    other = tm.make_checkpoint(tmp_path / "v400", tm.llama_config(vocab_size=400, num_hidden_layers=1),
                               tokenizer_dir=tokenizer_dir)
    line = one_line_error(mlx_spec("generate", "--model", str(llama_pair["target"]), "--draft-model", str(other)))
    assert "vocab_size" in line and "400" in line and "384" in line


@pytest.mark.parametrize("args, expected", [
    (["--draft-kind", "medusa"], "--draft-kind: got 'medusa'; allowed: auto,"),
    (["--draft-block-size", "1"], "--draft-block-size: got 1; allowed: 'auto' or an integer from 2"),
    (["--draft-block-size", "many"], "--draft-block-size: got 'many'"),
])
def test_bad_settings_name_key_value_and_allowed(args: List[str], expected: str, llama_pair: Dict[str, Path]) -> None:
    line = one_line_error(mlx_spec("generate", "--model", str(llama_pair["target"]), *args))
    assert expected in line


def test_bad_yaml_key(llama_pair: Dict[str, Path], tmp_path: Path) -> None:
    cfg = tmp_path / "host.yaml"
    cfg.write_text(f"model: {llama_pair['target']}\nspeculative:\n  draft_modle: x\n")
    line = one_line_error(mlx_spec("generate", "--config", str(cfg)))
    assert f"{cfg}:3: speculative.draft_modle: unknown key" in line and "allowed keys" in line
    cfg.write_text("generation: {}\nmodle: x\n")
    assert f"{cfg}:2: modle: unknown top-level key" in one_line_error(mlx_spec("generate", "--config", str(cfg)))
