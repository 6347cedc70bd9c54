"""bench/demo_acceptance.py on a fake demo dir (a tiny random target, a draft LM cut from it, prompts
cut from this Python's standard library): its JSON has every field and greedy speculative output
equals plain decoding; its parse rule and exactness check on hand-made cases."""

from __future__ import annotations

import importlib.util
import json
import sys
import sysconfig
from pathlib import Path
from types import ModuleType
from typing import Any, Dict

import pytest

import mlx.core as mx

from mlx_speculative.testing import tiny_models as tm

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "demo_acceptance.py"


def script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_demo_acceptance", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def fake_demo(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """DIR/target, DIR/draft_model, DIR/prompts.json (no dflash/eagle3/mtp: the script skips them)."""
    root = tmp_path_factory.mktemp("demo")
    target = tm.make_checkpoint(root / "target", tm.llama_config(num_hidden_layers=4), seed=3,
                                tokenizer_dir=tokenizer_dir, logit_scale=3.0, quiet_layers_from=2)
    tm.make_truncated_drafter(target, root / "draft_model", num_layers=2)
    lib = Path(sysconfig.get_paths()["stdlib"])
    prompts = []
    for name in ("bisect.py", "fnmatch.py"):
        text = (lib / name).read_text()
        cut = text.index("\n", 60) + 1  # a short prompt ending at a line boundary
        prompts.append({"file": f"Lib/{name}", "line": text[:cut].count("\n") + 1, "prompt": text[:cut],
                        "reference": text[cut:cut + 120]})
    meta = {"python": sys.version.split()[0], "rule": "test", "prompts": prompts}
    (root / "prompts.json").write_text(json.dumps(meta))
    return root


def test_demo_acceptance_json(fake_demo: Path, tmp_path: Path) -> None:
    out = tmp_path / "d.json"
    device = mx.default_device()  # --cpu sets the default device: the other tests keep theirs
    try:
        assert script().main(["--demo-dir", str(fake_demo), "--prompts", "2", "--max-tokens", "16", "--kinds",
                              "dflash,draft_model,ngram", "--sampled-prompts", "2", "--cpu", "--json", str(out)]) == 0
    finally:
        mx.set_default_device(device)
    r: Dict[str, Any] = json.loads(out.read_text())
    assert set(r) >= {"settings", "plain", "kinds", "notes", "bits_per_byte", "parse", "machine", "wall_seconds"}
    assert set(r["kinds"]) == {"draft_model", "ngram"} and any("dflash" in n for n in r["notes"])
    for kind, e in r["kinds"].items():
        assert e["exact"] == {"identical": 2, "of": 2, "mismatches": []}, kind
        assert e["greedy"]["rounds"] > 0 and e["greedy"]["tau"] >= 1.0
        assert 0.0 <= e["greedy"]["acceptance_rate"] <= 1.0
        assert e["sampled"]["prompts"] == 2 and e["sampled"]["temperature"] == 0.7 and e["sampled"]["rounds"] > 0
        assert set(e["vs_ngram"]) == {"tau_minus_ngram", "tau_over_ngram"}
    assert r["kinds"]["draft_model"]["block"] == 4 and r["kinds"]["ngram"]["block"] == 8
    assert r["kinds"]["ngram"]["vs_ngram"]["tau_minus_ngram"] == 0.0
    # a 4-layer target whose first 2 layers decide most tokens: its 2-layer cut is accepted often
    assert r["kinds"]["draft_model"]["greedy"]["accepted_tokens"] > 0
    bpb = r["bits_per_byte"]
    assert bpb["bits_per_byte"] > 0 and bpb["bytes"] >= 2 * 120 and bpb["tokens_scored"] > 0
    assert 0.0 <= r["parse"]["share"] <= 1.0 and r["parse"]["rule"]
    assert {"platform", "mlx", "device"} <= set(r["machine"])


def test_parse_rule_and_exactness_check() -> None:
    m = script()
    assert m.parses("def f():\n", "    return 1\n\ndef g(") == (None, None)  # cut after the last newline
    # the prompt's open docstring is its context: the completion closing it parses, alone it does not
    joint, alone = m.parses('def f():\n    """Doc\n', '    more.\n    """\n    return 1\n')
    assert joint is None and alone is not None
    assert m.parses("x = [\n", "1, 2,\n")[0] is None  # cut inside a bracket: a prefix of Python
    assert m.parses("x = [\n", "1, 2)\n")[0] == "unmatched ')' at line 2"
    assert m.parses("x = 1\n", "y = 2)\n")[0] == "unmatched ')' at line 2"
    assert m.parses("if a:\n    if b:\n        c\n", "      d\n")[0].startswith("IndentationError")
    # without a preamble, a prompt cut from inside two blocks: dedenting to those blocks' levels is fine
    assert m.parses("        x = 1\n", "    y = 2\nz = 3\n")[0] is None
    assert m.parses("        x = 1\n", "      y = 2\n")[0].startswith("IndentationError")
    assert m.parses("x = 1\n", "no newline")[0] == "no complete line"
    # the preamble carries the file's state: a prompt starting inside a call and a docstring
    assert m.parses("    b)\n", "c = 1\n", preamble="_ = (\n")[0] is None
    assert m.parses("    b)\n", "c = 1\n")[0] == "unmatched ')' at line 1"
    assert m.parses('    end of doc.\n    """\n', "    x = 1\n", preamble='if 1:\n    _ = """\n')[0] is None
    runs = [([1, 2, 3], None), ([1, 2, 4], None), ([1, 2], None)]
    assert m.compare(runs, [[1, 2, 3]] * 3) == {"identical": 1, "of": 3, "mismatches": [
        {"prompt": 1, "first_differing_position": 2}, {"prompt": 2, "first_differing_position": 2}]}


def test_the_parse_rule_passes_python_cut_anywhere() -> None:
    """The rule's reach: real source cut at any line boundary, read after corpus.preamble of the text
    before the cut, is judged a Python prefix (the references of the demo's prompts rely on it)."""
    from mlx_speculative.demo import corpus

    m = script()
    lib = Path(sysconfig.get_paths()["stdlib"])
    cuts = 0
    for name in ("textwrap.py", "dataclasses.py", "json/decoder.py", "argparse.py"):
        text = (lib / name).read_text()
        starts = [i + 1 for i, c in enumerate(text) if c == "\n"][:-1]
        for start in starts[:: max(1, len(starts) // 40)]:
            end = text.rfind("\n", start, start + 800) + 1
            if end > start:
                assert m.parses(text[start:end], "\n", corpus.preamble(text[:start]))[0] is None, (name, start)
                cuts += 1
    assert cuts > 100
    # and the rule can fail: a stray dedent and a mismatched bracket after the same preambles
    text = (lib / "textwrap.py").read_text()
    start = text.index("    def _munge_whitespace")
    line = text[start:text.index("\n", start) + 1]
    assert m.parses(line, "        x = (]\n", corpus.preamble(text[:start]))[0] == "unmatched ']' at line 2"
    assert m.parses(line, "  y\n", corpus.preamble(text[:start]))[0].startswith("IndentationError")

