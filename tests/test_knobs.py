"""The ``runtime:`` settings (hooks/knobs.py): each knob set in the YAML changes what a load uses, its variable wins
over the YAML, bad values are clear errors, nothing is read at import, ``mlx-spec config --show`` prints the resolved
tree and docs/configuration.md's table is the registry's."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest

from conftest import encode, greedy_reference, no_stop
from mlx_speculative.hooks import cli, knobs
from mlx_speculative.hooks.config import load_host_config
from mlx_speculative.hooks.host import Host
from mlx_speculative.hooks.manager import make_plugin_manager
from mlx_speculative.hooks.scheduler import Scheduler
from mlx_speculative.hooks.state import HostConfig
from mlx_speculative.hooks.validate import HostConfigError
from mlx_speculative.plugin import cuda, draft
from mlx_speculative.plugin.cuda import backend as cuda_backend

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
# Variables the library reads that are not runtime knobs: where each is set instead.
ELSEWHERE = {"MLX_VLM_DRAFT_MODEL": "speculative.draft_model", "MLX_VLM_DRAFT_KIND": "speculative.kind",
             "MLX_VLM_DRAFT_BLOCK_SIZE": "speculative.block_size", "MLX_SPEC_API_KEY": "server.api_key",
             # runtime.blas's re-execution: its own mark, and the user's preloads it keeps (not settings)
             "MLX_SPEC_BLAS_PRELOADED": None, "LD_PRELOAD": None}


@pytest.fixture(autouse=True)
def clean(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No knob variable set (the conftest sets two), and no YAML layer left installed by another test."""
    for k in knobs.KNOBS.values():
        monkeypatch.delenv(k.env, raising=False)
    knobs.install()
    yield
    knobs.install()


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "host.yaml"
    path.write_text(text)
    return str(path)


def test_precedence_cli_env_yaml_default(monkeypatch: pytest.MonkeyPatch) -> None:
    assert knobs.setting("padded_cache") == ("auto", "default", "MLX_SPEC_PADDED_CACHE")
    knobs.install({"padded_cache": False, "prewarm_tokens": 256, "lazy_drafts": "off"})  # YAML's unquoted off: False
    assert knobs.setting("padded_cache") == ("off", "yaml", "runtime.padded_cache")
    assert knobs.value("prewarm_tokens") == 256 and knobs.value("lazy_drafts") is False
    monkeypatch.setenv("MLX_SPEC_PADDED_CACHE", " ON ")  # read as the library always read it
    monkeypatch.setenv("MLX_SPEC_LAZY_DRAFTS", "1")
    assert knobs.setting("padded_cache") == ("on", "env", "MLX_SPEC_PADDED_CACHE") and knobs.value("lazy_drafts")
    monkeypatch.setenv("MLX_SPEC_PADDED_CACHE", "  ")  # blank: no value, the YAML's
    assert knobs.value("padded_cache") == "off"
    knobs.install({"padded_cache": "on"}, cli={"padded_cache": "off"})
    monkeypatch.setenv("MLX_SPEC_PADDED_CACHE", "on")
    assert knobs.setting("padded_cache") == ("off", "cli", "--padded-cache")
    # the functions that take a mode (the bench's flags) put it first; without one they ask the knob
    knobs.install({"padded_cache": "on", "draft_ahead": "verify"})
    monkeypatch.delenv("MLX_SPEC_PADDED_CACHE")
    assert cuda.padded_on() is True and cuda.padded_on("off") is False
    assert draft.ahead_mode() == "verify" and draft.ahead_mode("off") == "off"


def test_variables_read_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each variable's values mean what they meant when the modules read them themselves."""
    cases: Dict[str, Any] = {
        "MLX_SPEC_LAZY_DRAFTS": [("0", False), (" 0 ", False), ("1", True), ("off", True), ("", True)],
        "MLX_SPEC_COMPILED_BATCHES": [("off", False), (" OFF ", False), ("on", True), ("0", True)],
        "HF_HUB_OFFLINE": [("1", True), ("TRUE", True), ("yes", True), ("0", False), ("on", False)],
        "MLX_SPEC_ATTENTION_MIN_KEYS": [("512", 512), (" 0 ", 0), ("", None)],
        "MLX_SPEC_PREWARM_TOKENS": [("512", 512), ("0", 0)],
        "MLX_SPEC_DRAFT_AHEAD": [("VERIFY", "verify"), ("off", "off"), ("", "on")],
        "MLX_SPEC_CACHE": [("/x/y", "/x/y")],
    }
    by_env = {k.env: k.name for k in knobs.KNOBS.values()}
    for env, pairs in cases.items():
        for text, want in pairs:
            monkeypatch.setenv(env, text)
            assert knobs.value(by_env[env]) == want, (env, text)


def test_bad_values_say_expected_received_allowed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bad = write(tmp_path, "model: demo\nruntime:\n  padded_cache: sometimes\n")
    with pytest.raises(HostConfigError, match=r"host\.yaml:3: runtime\.padded_cache: got 'sometimes'; "
                                              r"allowed: auto, on, off$"):
        load_host_config(bad)
    with pytest.raises(HostConfigError, match=r"host\.yaml:2: runtime\.prewarm: unknown key \(value 3\); allowed keys: "
                                              r"padded_cache, prewarm_tokens,"):
        load_host_config(write(tmp_path, "runtime:\n  prewarm: 3\n"))
    with pytest.raises(HostConfigError, match=r"runtime\.prewarm_tokens: got -1; allowed: an integer >= 0"):
        load_host_config(write(tmp_path, "runtime:\n  prewarm_tokens: -1\n"))
    with pytest.raises(HostConfigError, match=r"runtime: got \[1\]; allowed: a mapping of padded_cache"):
        load_host_config(write(tmp_path, "runtime: [1]\n"))
    monkeypatch.setenv("MLX_SPEC_PREWARM_TOKENS", "many")
    with pytest.raises(ValueError, match=r"^MLX_SPEC_PREWARM_TOKENS: got 'many'; allowed: an integer >= 0"):
        knobs.value("prewarm_tokens")
    monkeypatch.setenv("MLX_SPEC_DRAFT_AHEAD", "Fast")
    with pytest.raises(ValueError, match=r"^MLX_SPEC_DRAFT_AHEAD: got 'fast'; allowed: on, verify, off$"):
        draft.ahead_mode()
    # a YAML value the device cannot honour names the YAML key and its line
    monkeypatch.delenv("MLX_SPEC_DRAFT_AHEAD")
    config = load_host_config(write(tmp_path, "model: demo\nruntime: {attention_kernel: on}\n"))
    knobs.install(config.sections["runtime"], where=config.where)
    with pytest.raises(ValueError, match=r"host\.yaml:2: runtime\.attention_kernel on: the attention kernel needs MLX "
                                         r"built with CUDA.*allowed here: auto, off"):
        cuda_backend.policy_for()


def test_a_load_resolves_the_yaml(llama_pair: Dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The YAML's knobs reach the plugin through the host's load; the variable wins over them; the tokens stay
    those of plain greedy decoding."""
    runtime = {"padded_cache": True, "prewarm_tokens": 256, "lazy_drafts": False, "draft_ahead": "off"}
    sections = {"speculative": {"draft_model": str(llama_pair["drafter"])}, "runtime": runtime}
    host = Host(HostConfig(sections=sections), pm=make_plugin_manager())
    target = host.load(str(llama_pair["target"]))
    att = target.attachments["speculative"]
    assert isinstance(target.cache_policy, cuda_backend.ShapeStablePolicy) and target.cache_policy.prewarm_tokens == 256
    assert att.lazy_drafts is False and att.ahead_mode == "off"
    prompt = encode(target, "the model token draft verify")
    got = host.generate(target, prompt, no_stop(12)).tokens
    assert got == greedy_reference(target.model, prompt, 12)
    monkeypatch.setenv("MLX_SPEC_PADDED_CACHE", "off")
    monkeypatch.setenv("MLX_SPEC_LAZY_DRAFTS", "1")
    again = host.load(str(llama_pair["target"]))
    assert again.cache_policy.name == "mlx-lm" and again.attachments["speculative"].lazy_drafts is True
    # the next load with no runtime: section installs none: the defaults (CPU: no policy)
    monkeypatch.delenv("MLX_SPEC_PADDED_CACHE")
    plain = Host(HostConfig(sections={"speculative": sections["speculative"]}),
                 pm=make_plugin_manager()).load(str(llama_pair["target"]))
    assert plain.cache_policy.name == "mlx-lm" and knobs.setting("padded_cache").source == "default"


def test_speculation_off_decodes_plainly_on_the_backend(llama_pair: Dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """With speculation off, plain decoding takes the backend where it is on (CUDA by default; here forced with
    padded_cache), warmed for plain steps only, and its tokens are mlx-lm's; off, mlx-lm's caches."""
    monkeypatch.setenv("MLX_SPEC_PADDED_CACHE", "on")
    sections = {"speculative": {"enabled": False}, "runtime": {"prewarm_tokens": 64}}
    host = Host(HostConfig(sections=sections), pm=make_plugin_manager())
    target = host.load(str(llama_pair["target"]))
    policy = target.cache_policy
    assert isinstance(policy, cuda_backend.ShapeStablePolicy) and target.attachments["speculative"].drafter is None
    assert policy.block_size == 1 and tuple(policy.capture_layers) == ()
    prompts = [encode(target, "the model token draft verify"), encode(target, "a longer prompt of other words here")]
    scheduler = Scheduler(host, target)  # one batch of rows at their own lengths
    requests = [scheduler.submit(p, no_stop(12)) for p in prompts]
    got: Dict[int, List[int]] = {r.id: [] for r in requests}
    while scheduler.busy:
        for request, event in scheduler.step():
            got[request.id].append(event.token)
    assert [got[r.id] for r in requests] == [greedy_reference(target.model, p, 12) for p in prompts]
    monkeypatch.setenv("MLX_SPEC_PADDED_CACHE", "off")
    assert host.load(str(llama_pair["target"])).cache_policy.name == "mlx-lm"


def test_cache_dir_from_the_yaml_is_read_from_its_folder(tmp_path: Path) -> None:
    config = load_host_config(write(tmp_path, "runtime:\n  cache_dir: cache\n  offline: true\n"))
    knobs.install(config.sections["runtime"], where=config.where)
    assert knobs.cache_root() == str(tmp_path / "cache") and knobs.value("offline") is True
    from mlx_speculative.hooks import gguf_convert

    assert gguf_convert.cache_root() == tmp_path / "cache" / "gguf"


def test_config_show(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    path = write(tmp_path, "model: demo\nserver: {port: 9000, api_key: secret}\nspeculative: {kind: ngram}\n"
                           "runtime:\n  padded_cache: on\n  draft_ahead: verify\n")
    monkeypatch.setenv("MLX_SPEC_DRAFT_AHEAD", "off")
    assert cli.main(["config", "--show", "--config", path, "--draft-block-size", "4"]) == 0
    lines = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()}
    assert lines["model"] == ["demo", "yaml"] and lines["server.port"] == ["9000", "yaml"]
    assert lines["server.api_key"] == ["***", "yaml"]  # never printed
    assert lines["speculative.kind"] == ["ngram", "yaml"] and lines["speculative.block_size"] == ["4", "cli"]
    assert lines["speculative.enabled"] == ["true", "yaml"] and lines["generation.temp"] == ["0.0", "default"]
    assert lines["runtime.padded_cache"] == ["on", "yaml"]
    assert lines["runtime.draft_ahead"] == ["off", "env", "(MLX_SPEC_DRAFT_AHEAD)"]
    assert lines["runtime.prewarm_tokens"] == ["4096", "default"]
    assert {k for k in lines if k.startswith("runtime.")} == {f"runtime.{k}" for k in knobs.KNOBS}
    assert cli.main(["config", "--json", "--config", path]) == 0
    tree = json.loads(capsys.readouterr().out)
    assert tree["runtime.padded_cache"] == {"value": "on", "source": "yaml"}
    assert knobs.setting("padded_cache").source == "default"  # showing installs nothing
    monkeypatch.setenv("MLX_SPEC_PADDED_CACHE", "sometimes")
    assert cli.main(["config", "--config", path]) == 2
    assert "MLX_SPEC_PADDED_CACHE: got 'sometimes'; allowed: auto, on, off" in capsys.readouterr().err


def test_the_docs_table_is_the_registry(capsys: pytest.CaptureFixture) -> None:
    text = (ROOT / "docs" / "configuration.md").read_text()
    begin, end = text.index("<!-- knobs:begin"), text.index("<!-- knobs:end -->")
    documented = text[text.index("\n", begin) + 1:end]
    assert documented == knobs.table_markdown(), "docs/configuration.md's runtime table is stale: paste " \
                                                 "`mlx-spec config --markdown` between its knobs markers"
    assert cli.main(["config", "--markdown"]) == 0
    assert capsys.readouterr().out == knobs.table_markdown()


def test_every_variable_is_a_knob_or_set_elsewhere() -> None:
    from test_docs import library_environment

    names = library_environment()
    knob_vars = {k.env for k in knobs.KNOBS.values()}
    stray = sorted(names - knob_vars - set(ELSEWHERE))
    assert not stray, f"variables read by the library that no YAML key sets (add a knob to hooks/knobs.py): {stray}"


def _module_level_reads(tree: ast.AST) -> Iterator[int]:
    """Lines of os.environ / getenv uses outside any function (run at import)."""
    def walk(node: ast.AST, in_function: bool) -> Iterator[int]:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if not inside and ((isinstance(child, ast.Attribute) and child.attr in ("environ", "getenv"))
                               or (isinstance(child, ast.Name) and child.id == "getenv")):
                yield child.lineno
            yield from walk(child, inside)

    return walk(tree, False)


def test_nothing_reads_the_environment_at_import() -> None:
    found = [f"{p.relative_to(ROOT)}:{n}" for package in ("hooks", "plugin", "drafters", "benchmarks", "testing")
             for p in sorted((ROOT / package).rglob("*.py")) for n in _module_level_reads(ast.parse(p.read_text()))]
    assert not found, f"environment read at import (read it at load, through hooks/knobs.py): {', '.join(found)}"


def test_blas_from_the_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """runtime.blas is read from the --config file before MLX loads (hooks/blas.py re-executes the process)."""
    from mlx_speculative.hooks import blas

    path = write(tmp_path, "runtime:\n  blas: off\n")  # YAML's unquoted off: false
    assert blas.config_path(["generate", "--config", path]) == path == blas.config_path([f"--config={path}"])
    assert blas.mode() == "" and blas.mode(path) == "off" and blas.hint(path) is None
    monkeypatch.setenv("MLX_SPEC_BLAS", "auto")
    assert blas.mode(path) == "auto"  # the variable wins
    monkeypatch.delenv("MLX_SPEC_BLAS")
    path = write(tmp_path, "runtime:\n  blas: /no/such/libblas.so\n")
    with pytest.raises(ValueError, match=r"host\.yaml: runtime\.blas: got '/no/such/libblas\.so' \(no such file\); "
                                         r"allowed: auto"):
        blas.mode(path)
    assert blas.mode(str(tmp_path / "missing.yaml")) == ""  # the configuration's own load reports that
