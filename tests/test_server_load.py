"""A bounded run of bench/server_load.py: concurrent streaming clients, zero errors, outputs equal
to the sequential greedy ones, memory stable. The full run (16 clients, 60 s) is in docs/server.md."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("openai")

pytestmark = pytest.mark.server

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "server_load.py"


@pytest.mark.slow
def test_load_interleaved_clients(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("server_load", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "load.json"
    assert module.main(["--clients", "8", "--duration", "8", "--max-tokens", "48", "--json", str(out)]) == 0
    (result,) = json.loads(out.read_text())
    assert result["errors"] == 0 and result["mismatches"] == 0 and result["requests"] >= 8
    assert result["rounds"] > 0 and result["tau"] > 1
    assert result["rss_growth_pct"] < 10, result
