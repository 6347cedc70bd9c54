"""bench/mtp_synthetic.py (the prepared H200 command) runs on tiny shapes: every run equals plain
decoding token for token and the MTP rounds reach the oracle's acceptance."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("shape", ["tiny-qwen3_5", "tiny-gemma4"])
def test_bench_runs_and_stays_exact(shape: str, tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("mtp_synthetic", ROOT / "bench" / "mtp_synthetic.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "report.json"
    assert bench.main(["--shape", shape, "--cpu", "--prompt-lengths", "40", "--max-tokens", "24",
                       "--json", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["method"] for r in runs] == ["mlx_lm.generate_step", "host plain", "plugin mtp b4 tau3.5"]
    assert all(r["identical"] for r in runs)
    assert runs[-1]["tau"] > 2.5
