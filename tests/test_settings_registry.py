"""Settings precedence and validation; drafter kind resolution and compatibility."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict

import pytest

from mlx_speculative.drafters import registry
from mlx_speculative.drafters.base import DrafterError, DraftTarget
from mlx_speculative.drafters.ngram import lookup
from mlx_speculative.plugin.settings import ConfigError, resolve

pytestmark = pytest.mark.unit

KINDS = ["draft_model", "ngram"]


def test_precedence_cli_over_env_over_yaml() -> None:
    yaml = {"draft_model": "y", "block_size": 4, "kind": "draft_model"}
    env = {"MLX_VLM_DRAFT_MODEL": "e", "MLX_VLM_DRAFT_BLOCK_SIZE": "6"}
    s = resolve(yaml, cli={"block_size": "8"}, environ=env, kinds=KINDS)
    assert (s.enabled, s.draft_model, s.block_size, s.kind) == (True, "e", 8, "draft_model")
    assert s.sources == {"draft_model": "env", "block_size": "cli", "kind": "yaml"}
    assert resolve(yaml, environ={}, kinds=KINDS).block_size == 4


def test_enabled_by_any_layer_and_disabled_by_cli() -> None:
    assert resolve(None, environ={}, kinds=KINDS).enabled is False
    assert resolve({}, environ={}, kinds=KINDS).enabled is True
    assert resolve(None, environ={"MLX_VLM_DRAFT_KIND": "ngram"}, kinds=KINDS).enabled is True
    assert resolve({"kind": "ngram"}, cli={"enabled": False}, environ={}, kinds=KINDS).enabled is False
    assert resolve({"block_size": "auto"}, environ={}, kinds=KINDS).block_size is None


@pytest.mark.parametrize("section, message", [
    ({"blocksize": 4}, "speculative.blocksize: unknown key (value 4); allowed keys: enabled, draft_model"),
    ({"block_size": 0}, "speculative.block_size: got 0; allowed: 'auto' or an integer from 2 to 128"),
    ({"block_size": 2.5}, "speculative.block_size: got 2.5"),
    ({"adaptive": "maybe"}, "speculative.adaptive: got 'maybe'; allowed: true or false"),
    ({"acceptance": "greedy"}, "speculative.acceptance: got 'greedy'; allowed: rejection, exact"),
    ({"kind": "medusa"}, "speculative.kind: got 'medusa'; allowed: auto, draft_model, ngram"),
    ({"ngram_n": 0}, "speculative.ngram_n: got 0; allowed: an integer from 1 to 32"),
    ({"draft_model": ""}, "speculative.draft_model: got ''"),
])
def test_bad_values(section: Dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        resolve(section, environ={}, kinds=KINDS)
    assert message in str(e.value)


def test_bad_value_names_the_variable_or_flag() -> None:
    with pytest.raises(ConfigError, match="^MLX_VLM_DRAFT_BLOCK_SIZE: got 'x'"):
        resolve(None, environ={"MLX_VLM_DRAFT_BLOCK_SIZE": "x"}, kinds=KINDS)
    with pytest.raises(ConfigError, match="^--draft-kind: got 'bogus'; allowed: auto, draft_model, ngram"):
        resolve(None, cli={"kind": "bogus"}, environ={}, kinds=KINDS)
    with pytest.raises(ConfigError, match="^host.yaml:7: speculative.kind: got 'bogus'"):
        resolve({"kind": "bogus"}, environ={}, kinds=KINDS, where=lambda key: "host.yaml:7: ")


def test_builtins_come_from_entry_points() -> None:
    fams = registry.families(reload=True)
    assert fams["draft_model"].distribution == "mlx-speculative"
    assert fams["ngram"].needs_weights is False


def test_resolution_from_config_and_conflict_warning(llama_pair: Dict[str, Path]) -> None:
    r = registry.resolve(str(llama_pair["drafter"]), "auto")
    assert (r.kind, r.family.name, r.warnings) == ("draft_model", "draft_model", [])
    r = registry.resolve(str(llama_pair["drafter"]), "dflash")
    assert r.kind == "draft_model"
    assert "'dflash' conflicts with the drafter's family 'draft_model'" in r.warnings[0]
    # An explicit kind that needs no weights wins instead (tests/test_first_hour.py).
    assert registry.resolve(str(llama_pair["drafter"]), "ngram").kind == "ngram"
    assert registry.resolve(None, "auto").kind == "ngram"
    with pytest.raises(DrafterError, match="needs a draft model"):
        registry.resolve(None, "draft_model")


def test_unknown_family_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no_such_arch", "vocab_size": 384}))
    with pytest.raises(DrafterError, match="no registered drafter family recognises"):
        registry.resolve(str(tmp_path))


def test_compatibility_from_config_fields(llama_pair: Dict[str, Path], tmp_path: Path) -> None:
    target_cfg = json.loads((llama_pair["target"] / "config.json").read_text())
    r = registry.resolve(str(llama_pair["drafter"]))
    ok = registry.check(r, DraftTarget(config=target_cfg, path=llama_pair["target"]))
    assert ok.ok and any("tokenizer: same vocabulary" in n for n in ok.notes)
    # Same vocab size, different tokenizer vocabulary: refused by content, not by name.
    other = tmp_path / "retok"
    other.mkdir()
    for f in llama_pair["drafter"].iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[10:12]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    bad = registry.check(registry.resolve(str(other)), DraftTarget(config=target_cfg, path=llama_pair["target"]))
    assert not bad.ok and "tokenizer" in bad.reasons[0]


def test_ngram_lookup() -> None:
    assert lookup([1, 2, 3, 9, 1, 2, 3], 3, 3) == [9, 1, 2]
    assert lookup([5, 6, 7, 5, 6], 3, 2) == [7, 5]  # longest suffix (5, 6) matches
    assert lookup([4, 4, 4], 2, 4) == [4, 4, 4, 4]  # periodic continuation fills the block
    assert lookup([1, 2, 3], 3, 4) == []
    assert lookup([8, 1, 2, 8, 3, 4, 8], 1, 2) == [3, 4]  # most recent occurrence wins
