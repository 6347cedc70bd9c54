"""A new user's first hour (issue 14): the demo pair by name, YAML-relative paths, the ngram
override, flags reaching the logits processors, `check` reading every header, --version, the
bench's argument checks, and the documented train-drafter commands naming what exists. Settings
validation: test_validate.py; the README's commands: test_readme_commands.py; a burst of clients:
test_server_burst.py."""

from __future__ import annotations

import json
import logging
import shutil
import struct
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Dict, List

import mlx.core as mx
import pytest

from mlx_speculative.drafters import registry
from mlx_speculative.drafters.dflash import tiny as dflash_tiny
from mlx_speculative.hooks import loading
from mlx_speculative.hooks.cli import main
from mlx_speculative.plugin import settings as spec_settings
from test_cli import mlx_spec

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
DFLASH_FIXTURE = ROOT / "tests" / "fixtures" / "dflash" / "z-lab__Qwen3-4B-DFlash-b16.config.json"


def run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("mlx-spec: error:")]
    assert len(lines) == 1, err
    return lines[0]


# -- 1. the demo pair by name -------------------------------------------------------------------

def test_demo_names_and_the_default(tmp_path: Path) -> None:
    proc = mlx_spec("generate", "--model", "demo", "--draft-model", "demo-drafter", "--max-tokens", "24", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["speculative"]["kind"] == "dflash" and out["speculative"]["rounds"] > 0
    assert "\n" in out["text"]  # the demo target writes Python, line by line
    # No model at all: the same pair, and the message names both.
    again = mlx_spec("generate", "--max-tokens", "24", "--json")
    assert "target 'demo', drafter 'demo-drafter'" in again.stderr
    assert json.loads(again.stdout)["tokens"] == out["tokens"]


def test_demo_names_resolve_in_one_place() -> None:
    from mlx_speculative import demo

    target, drafter = loading.demo_pair()
    assert loading.resolve_path("demo") == target == demo.target_dir()
    assert loading.resolve_path("demo-drafter", "draft model") == drafter == demo.drafter_dir("dflash")
    assert registry.resolve("demo-drafter").kind == "dflash"
    for name, kind in (("demo-eagle3", "eagle3"), ("demo-mtp", "mtp"), ("demo-draft-model", "draft_model")):
        assert loading.resolve_path(name, "draft model") == demo.drafter_dir(kind)
        assert registry.resolve(name).kind == kind


def test_yaml_and_check_take_the_demo_names(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cfg = tmp_path / "host.yaml"
    cfg.write_text("model: demo\nspeculative:\n  draft_model: demo-drafter\n")
    rc, out, err = run(capsys, "generate", "--config", str(cfg), "--max-tokens", "8", "--json")
    assert rc == 0, err
    assert json.loads(out)["speculative"]["kind"] == "dflash"
    for name in ("demo-drafter", "demo-eagle3", "demo-mtp", "demo-draft-model"):
        rc, out, err = run(capsys, "check", "--model", "demo", "--draft-model", name)
        assert rc == 0 and "verdict: compatible" in out, out + err


# -- 2. YAML paths relative to the YAML file -------------------------------------------------------

def test_yaml_paths_are_read_from_the_yaml_folder(llama_pair: Dict[str, Path], tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "target").symlink_to(llama_pair["target"])
    (tmp_path / "models" / "drafter").symlink_to(llama_pair["drafter"])
    (tmp_path / "conf").mkdir()
    cfg = tmp_path / "conf" / "host.yaml"
    cfg.write_text("model: ../models/target\nspeculative:\n  draft_model: ../models/drafter\n  block_size: 3\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    rc, out, err = run(capsys, "generate", "--config", str(cfg), "--max-tokens", "10", "--json",
                       "--ignore-chat-template")
    assert rc == 0, err
    spec = json.loads(out)["speculative"]
    assert spec["kind"] == "draft_model" and set(spec["block_sizes"]) == {3}
    # A relative path that is not there is reported where it was looked for.
    cfg.write_text("model: ./models/target\n")
    rc, _, err = run(capsys, "generate", "--config", str(cfg), "--max-tokens", "4")
    assert rc == 2 and str(tmp_path / "conf" / "models" / "target") in error_line(err)


def test_resolve_relative(tmp_path: Path) -> None:
    (tmp_path / "org" / "local").mkdir(parents=True)
    assert loading.resolve_relative("org/name", tmp_path) == "org/name"  # a repo id stays one
    assert loading.resolve_relative("org/local", tmp_path) == str(tmp_path / "org" / "local")  # a folder wins
    assert loading.resolve_relative("./org/name", tmp_path) == str(tmp_path / "org" / "name")
    assert loading.resolve_relative("weights", tmp_path) == str(tmp_path / "weights")  # no repo id without '/'
    for kept in ("demo", "demo-drafter", "/abs/path", "~/models/x"):
        assert loading.resolve_relative(kept, tmp_path) == kept


# -- 3. an explicit weightless kind wins over a configured draft model ----------------------------

def test_explicit_ngram_drops_the_draft_model(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="mlx_speculative"):
        s = spec_settings.resolve({"draft_model": "./drafter"}, environ={"MLX_VLM_DRAFT_KIND": "ngram"},
                                  kinds=["draft_model", "ngram"], weightless=["ngram"])
    assert (s.enabled, s.kind, s.draft_model) == (True, "ngram", None)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["draft kind 'ngram' (env) needs no drafter weights: ignoring the draft model './drafter' (yaml)"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mlx_speculative"):
        s = spec_settings.resolve({"draft_model": "./drafter", "kind": "draft_model"}, environ={},
                                  kinds=["draft_model", "ngram"], weightless=["ngram"])
    assert (s.kind, s.draft_model, caplog.records) == ("draft_model", "./drafter", [])


def test_registry_weightless_kind_wins_family_wins_otherwise(llama_pair: Dict[str, Path]) -> None:
    r = registry.resolve(str(llama_pair["drafter"]), "ngram")
    assert (r.kind, r.path) == ("ngram", None)
    assert r.warnings == [f"draft kind 'ngram' needs no drafter weights: ignoring the draft model "
                          f"{str(llama_pair['drafter'])!r}"]
    r = registry.resolve(str(llama_pair["drafter"]), "dflash")  # a weighted kind against the family
    assert r.kind == "draft_model"
    assert "'dflash' conflicts with the drafter's family 'draft_model'" in r.warnings[0]


def test_env_ngram_override_runs_ngram(llama_pair: Dict[str, Path], tmp_path: Path) -> None:
    cfg = tmp_path / "host.yaml"
    cfg.write_text(f"model: {llama_pair['target']}\nspeculative:\n  draft_model: {llama_pair['drafter']}\n")
    args = ["generate", "--config", str(cfg), "--max-tokens", "24", "--json", "--ignore-chat-template",
            "--prompt", "red green blue one two red green blue one two"]
    proc = mlx_spec(*args, env={"MLX_VLM_DRAFT_KIND": "ngram"})
    assert proc.returncode == 0, proc.stderr
    said = [line for line in proc.stderr.splitlines() if "ignoring the draft model" in line]
    assert len(said) == 1 and "'ngram' (env)" in said[0] and "(yaml)" in said[0]
    out = json.loads(proc.stdout)
    assert out["speculative"]["kind"] == "ngram"
    assert out["tokens"] == json.loads(mlx_spec(*args, "--no-speculative").stdout)["tokens"]


# -- flags that reach the logits processors ----------------------------------------------------

def test_generate_penalty_and_bias_flags_apply_and_stay_lossless(capsys: pytest.CaptureFixture) -> None:
    def tokens(*extra: str) -> List[int]:
        rc, out, err = run(capsys, "generate", "--model", "demo", "--max-tokens", "24", "--json", *extra)
        assert rc == 0, err
        return json.loads(out)["tokens"]

    plain = tokens("--no-speculative")
    penalised = tokens("--no-speculative", "--repetition-penalty", "3", "--repetition-context-size", "8")
    assert penalised != plain
    assert tokens("--draft-model", "demo-drafter", "--repetition-penalty", "3", "--repetition-context-size", "8") \
        == penalised
    assert set(tokens("--logit-bias", '{"300": 100}', "--no-speculative")) == {300}
    rc, _, err = run(capsys, "generate", "--model", "demo", "--logit-bias", '{"2048": 1}')
    assert rc == 2 and "--logit-bias: got '{\"2048\": 1}'; allowed: token ids from 0 to 2047" in error_line(err)


# -- 5. check reads every header ----------------------------------------------------------------

def test_safetensors_headers_read_without_loading(llama_pair: Dict[str, Path], tmp_path: Path) -> None:
    headers = loading.safetensors_headers(llama_pair["drafter"])
    weights = mx.load(str(llama_pair["drafter"] / "model.safetensors"))
    assert {k: h.shape for k, h in headers.items()} == {k: tuple(v.shape) for k, v in weights.items()}
    assert {h.dtype for h in headers.values()} == {"F32"}
    bad = tmp_path / "bad"
    shutil.copytree(llama_pair["drafter"], bad)
    f = bad / "model.safetensors"
    data = f.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8: 8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["shape"] = [d + 1 for d in header[name]["shape"]]  # the shape no longer fits its bytes
    text = json.dumps(header).encode().ljust(n)
    f.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n:])
    with pytest.raises(loading.CheckpointError, match=f"tensor '{name}'.*needs .* bytes"):
        loading.safetensors_headers(bad, "draft model")


def test_check_reports_a_truncated_drafter(llama_pair: Dict[str, Path], tmp_path: Path,
                                           capsys: pytest.CaptureFixture) -> None:
    corrupt = tmp_path / "corrupt"
    shutil.copytree(llama_pair["drafter"], corrupt)
    data = (corrupt / "model.safetensors").read_bytes()
    (corrupt / "model.safetensors").write_bytes(data[: len(data) - 100])
    rc, out, _ = run(capsys, "check", "--model", str(llama_pair["target"]), "--draft-model", str(corrupt), "--json")
    report = json.loads(out)
    assert rc == 1 and report["compatible"] is False
    assert any("not a valid safetensors file" in r and "ends at byte" in r for r in report["reasons"])


def test_check_reads_dflash_fc_shape_from_the_header(llama_pair: Dict[str, Path], tmp_path: Path,
                                                     capsys: pytest.CaptureFixture) -> None:
    config = dflash_tiny.shrink_config(json.loads(DFLASH_FIXTURE.read_text()), target_layer_ids=[0, 2],
                                       mask_token_id=383, num_target_layers=4)
    good = dflash_tiny.write_checkpoint(tmp_path / "good", config, seed=5)
    rc, out, _ = run(capsys, "check", "--model", str(llama_pair["target"]), "--draft-model", str(good))
    assert rc == 0 and "ok fc.weight: [64, 128] (from the safetensors header)" in out, out
    bad = dflash_tiny.write_checkpoint(tmp_path / "bad", config, seed=5)
    weights = mx.load(str(bad / "model.safetensors"))
    weights["fc.weight"] = mx.zeros((64, 3 * 64))
    mx.save_safetensors(str(bad / "model.safetensors"), weights)
    rc, out, _ = run(capsys, "check", "--model", str(llama_pair["target"]), "--draft-model", str(bad))
    assert rc == 1 and "NOT compatible" in out
    assert "x fc.weight has shape [64, 192]; expected [64, 128]" in out


# -- 6. --version, 7. the bench's arguments -------------------------------------------------------

def test_version(capsys: pytest.CaptureFixture) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith(f"mlx-spec {version('mlx-speculative')} (mlx ")
    # Without loading the plugins, mlx or mlx-lm: well under a second.
    code = "import sys; from mlx_speculative.hooks.cli import main; main(['-V']); print(sorted(m for m in sys.modules " \
           "if m.split('.')[0] in ('mlx', 'mlx_lm', 'pluggy', 'transformers')))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.splitlines()[-1] == "[]", done.stdout + done.stderr


@pytest.mark.parametrize("args, expected", [
    (["--oracle-acceptance", "6.5", "--block-sizes", "4,16"],
     "--oracle-acceptance: got tau 6.5; allowed: 1 to the block size (4; --block-sizes 4,16)"),
    (["--oracle-acceptance", "0.5"], "--oracle-acceptance: got tau 0.5; allowed: 1 to the block size (16"),
    (["--adaptive-at", "20"], "--adaptive-at: got tau 20; allowed: 1 to the block size (16"),
])
def test_bench_refuses_taus_before_loading(args: List[str], expected: str, tmp_path: Path,
                                           capsys: pytest.CaptureFixture) -> None:
    rc, _, err = run(capsys, "bench", "--model", str(tmp_path / "absent"), *args)
    assert rc == 2 and expected in error_line(err)


def test_bench_help_says_what_the_lists_mean(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(methods x bases - 1) x (max-tokens + 2 x largest block + 9) tokens longer than its base" in text
    assert "run every TAU at every block size" in text and "run only the first TAU" in text


def test_config_only_drafter_is_checked_by_config_and_refused_at_load(llama_pair: Dict[str, Path], tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture) -> None:
    only = tmp_path / "config-only"
    only.mkdir()
    shutil.copy(llama_pair["drafter"] / "config.json", only / "config.json")
    rc, out, _ = run(capsys, "check", "--model", str(llama_pair["target"]), "--draft-model", str(only))
    assert rc == 0 and "ok safetensors: no weight files (only config.json and the tokenizer files were checked)" in out
    assert "ok target safetensors: 39 tensor headers in 1 file(s)" in out
    rc, _, err = run(capsys, "generate", "--model", str(llama_pair["target"]), "--draft-model", str(only))
    assert rc == 2 and "has no *.safetensors weights" in error_line(err)


def test_the_documented_commands_name_a_target_and_data_that_exist() -> None:
    """The train-drafter commands of README.md and docs/training.md parse with today's flags and, run from the
    repository root, name a target and data that exist (not a `--target ./target` no reader has)."""
    import shlex

    from mlx_speculative.hooks.cli import build_parser
    from mlx_speculative.hooks.manager import make_plugin_manager
    from test_readme_commands import commands

    documented = [c for doc in (ROOT / "README.md", ROOT / "docs" / "training.md")
                  for c in commands(doc.read_text())[0] if c.startswith("mlx-spec train-drafter")]
    assert len(documented) >= 3, documented
    parser = build_parser(make_plugin_manager())
    for command in documented:
        args = parser.parse_args(shlex.split(command)[1:])
        assert loading.resolve_path(args.target).is_dir() and all((ROOT / d).exists() for d in args.data), command
