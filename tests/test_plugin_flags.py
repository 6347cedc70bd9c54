"""The host owns no speculative flag or variable: the plugin adds ``--draft-*`` to ``generate`` and ``serve``
(``host_add_arguments``), reads them back (``host_overrides``) and pairs the demo drafter with the demo target
(``host_demo``). Without the plugin those flags are unknown and generate decodes plainly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

import pytest

from conftest import greedy_reference
from mlx_speculative.hooks.cli import build_parser
from mlx_speculative.hooks.config import load_host_config, model_or_demo, plugin_overrides
from mlx_speculative.hooks.manager import make_plugin_manager
from mlx_speculative.hooks.state import HostConfig

pytestmark = pytest.mark.integration

FLAGS = ["--draft-model", "--draft-kind", "--draft-block-size", "--num-draft-tokens", "--no-speculative"]


def _unknown(parser: Any, command: str) -> List[str]:
    """The flags of ``FLAGS`` that ``command`` does not know."""
    unknown: List[str] = []
    for flag in FLAGS:
        unknown += parser.parse_known_args([command, flag] + ([] if flag == "--no-speculative" else ["1"]))[1][:1]
    return unknown


def test_the_plugin_adds_its_flags_to_generate_and_serve() -> None:
    with_plugin, without = build_parser(make_plugin_manager()), build_parser(make_plugin_manager(False))
    for command in ("generate", "serve"):
        assert _unknown(with_plugin, command) == [] and _unknown(without, command) == FLAGS
    args = with_plugin.parse_args(["serve", "--num-draft-tokens", "3", "--draft-kind", "ngram"])
    assert plugin_overrides(make_plugin_manager(), args, "serve") == {"speculative": {"kind": "ngram", "block_size": 4}}
    assert plugin_overrides(make_plugin_manager(False), args, "serve") == {}


def test_without_the_plugin_draft_flags_are_unknown_and_generate_is_plain(llama_pair: Dict[str, Path],
                                                                         capsys: pytest.CaptureFixture) -> None:
    pm = make_plugin_manager(False)
    parser = build_parser(pm)
    for command in ("generate", "serve"):
        with pytest.raises(SystemExit):
            parser.parse_args([command, "--draft-model", "x"])
        assert "unrecognized arguments: --draft-model x" in capsys.readouterr().err
    args = parser.parse_args(["generate", "--model", str(llama_pair["target"]), "--prompt", "the model token",
                              "--ignore-chat-template", "--max-tokens", "8", "--json"])
    args.pm = pm
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    from mlx_lm import load

    model, tokenizer = load(str(llama_pair["target"]))
    ref = greedy_reference(model, tokenizer.encode("the model token", add_special_tokens=False), 8)
    assert out["speculative"] is None and out["tokens"] and out["tokens"] == ref[: len(out["tokens"])]


def test_the_demo_drafter_comes_from_the_plugin(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    for k in ("MLX_VLM_DRAFT_KIND", "MLX_VLM_DRAFT_MODEL", "MLX_VLM_DRAFT_BLOCK_SIZE"):
        monkeypatch.delenv(k, raising=False)
    config = HostConfig()
    assert model_or_demo(None, config, make_plugin_manager()) == "demo"
    assert config.overrides == {"speculative": {"draft_model": "demo-drafter"}}
    assert "no model given: target 'demo', drafter 'demo-drafter' (the embedded demo pair)" in capsys.readouterr().err
    for config, pm in [(HostConfig(), make_plugin_manager(False)), (HostConfig(sections={"speculative": {}}), None),
                       (HostConfig(overrides={"speculative": {"enabled": False}}), None)]:
        assert model_or_demo(None, config, pm or make_plugin_manager()) == "demo"
        assert "draft_model" not in config.overrides.get("speculative", {})
        assert "no model given: target 'demo' (the embedded demo pair)" in capsys.readouterr().err
    monkeypatch.setenv("MLX_VLM_DRAFT_KIND", "ngram")
    config = HostConfig()
    model_or_demo(None, config, make_plugin_manager())
    assert config.overrides == {} and "drafter" not in capsys.readouterr().err
    assert model_or_demo("elsewhere", HostConfig(), make_plugin_manager()) == "elsewhere"


def test_why_generate_decoded_plainly_is_the_plugins(tmp_path: Path) -> None:
    """``host_plain_reason``: the plugin names the setting that turned speculation off; without it, or with none
    given, nothing (the host then says the plugins drafted nothing)."""

    def reason(argv: List[str], path: Any = None, pm: Any = None) -> Any:
        pm = pm or make_plugin_manager()
        args = build_parser(pm).parse_args(["generate", *argv])
        config = load_host_config(path, plugin_overrides(pm, args, "generate"))
        return pm.hook.host_plain_reason(args=args, config=config)

    assert reason(["--no-speculative"]) == "--no-speculative"
    assert reason(["--num-draft-tokens", "0"]) == "--num-draft-tokens 0"
    assert reason([]) == "no --draft-model or --draft-kind given"
    assert reason(["--draft-kind", "ngram"]) is None
    off = tmp_path / "off.yaml"
    off.write_text("speculative:\n  enabled: false\n")
    assert reason([], off) == f"{off}:2: speculative.enabled: false"
    assert reason([], None, make_plugin_manager(False)) is None
