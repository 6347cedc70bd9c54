"""bench/server_batching.py's real-model mode (bench/served_real.py): a tiny real checkpoint served to 1 and 2
concurrent clients, plain against a draft LM and the n-gram drafter, each attached by the plugin from the
server's ``speculative:`` section; raw and chat prompts; every output identical to the request answered alone."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Dict

import mlx.core as mx
import pytest

from conftest import PROMPTS

pytestmark = pytest.mark.server

BENCH = Path(__file__).resolve().parents[1] / "bench"


def server_batching() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_server_batching", BENCH / "server_batching.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_served_real_modes(tmp_path: Path, llama_pair: Dict[str, Path]) -> None:
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"prompts": [{"prompt": PROMPTS[0], "chat": True}, {"prompt": PROMPTS[1]},
                                               {"prompt": PROMPTS[2], "chat": False}]}))
    out = tmp_path / "served.json"
    argv = ["--model", str(llama_pair["target"]), "--drafter", f"{llama_pair['drafter']}@3", "--kind", "ngram",
            "--prompts-file", str(prompts), "--clients", "1,2", "--duration", "2", "--max-tokens", "16",
            "--warmup-tokens", "64", "--cpu", "--json", str(out)]
    device = mx.default_device()
    try:
        assert server_batching().main(argv) == 0
    finally:
        mx.set_default_device(device)
    report = json.loads(out.read_text())
    assert report["model"] == str(llama_pair["target"]) and report["prompts_file"] == str(prompts)
    assert report["prompts"] == {"count": 3, "chat": 1}
    assert report["drafters"]["draft_model"]["path"] == str(llama_pair["drafter"])
    assert report["drafters"]["draft_model"]["block"] == 3 and report["drafters"]["ngram"]["kind"] == "ngram"
    assert list(report["results"]) == ["plain", "draft_model", "ngram"]
    for mode, result in report["results"].items():
        assert set(result["by_clients"]) == {"1", "2"}
        for row in result["by_clients"].values():
            assert row["requests"] > 0 and row["errors"] == 0 and row["mismatches"] == 0, (mode, row)
            assert (row["rounds"] > 0) == (mode != "plain"), (mode, row)  # speculation ran where asked, only there
    assert report["results"]["draft_model"]["attached"]["block_size"] == 3
    assert report["results"]["plain"]["attached"] == {"speculative": "off"}


def test_served_real_refuses_mixed_targets(llama_pair: Dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    module = server_batching()
    with pytest.raises(SystemExit):
        module.main(["--model", str(llama_pair["target"]), "--synthetic-target", "tiny"])
    assert "expected one target" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        module.main(["--synthetic-target", "tiny", "--drafter", str(llama_pair["drafter"])])
    assert "--drafter: only with --model PATH" in capsys.readouterr().err


def test_served_real_quantized_copy(tmp_path: Path, llama_pair: Dict[str, Path]) -> None:
    """--quantize-target 4 with --model: a 4-bit checkpoint folder the host loads as any quantized checkpoint."""
    import mlx.nn as nn

    server_batching()  # puts bench/ on the path
    import served_real
    from mlx_speculative.hooks import loading

    out = served_real.quantized_copy(str(llama_pair["target"]), 4, tmp_path)
    config = loading.read_config(out, "model")
    assert config["quantization"]["group_size"] == 64 and config["quantization"]["bits"] == 4
    model, tokenizer = loading.load_target(out, config)
    assert any(isinstance(m, nn.QuantizedLinear) for m in model.modules())
    assert tokenizer.chat_template is not None  # the chat prompts still get the template
