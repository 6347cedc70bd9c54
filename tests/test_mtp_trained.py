"""Trained MTP drafters (the training core of ``mlx-spec train-drafter --kind mtp``) accept on held-out text.

A new Qwen3.5-style head for a tiny qwen3_5 target, and a tiny Gemma 4 assistant (from a random
E2B-shaped one: the sparse head) for a tiny gemma4_text target, each trained once per session on its
target's own greedy text. The targets' later blocks add little (``quiet_from=0``): their greedy text
is then a walk a small drafter can learn from a few thousand tokens; a fully random target's text is
chaotic. Measured at depth 3 (block 4) on 16 held-out prompts x 64 tokens, greedy: offline by the
training core, and online by the host's round loop, whose tokens equal plain decoding's.
"""

from __future__ import annotations

import io
import json
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any, Dict, List

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from conftest import greedy_reference, make_host, no_stop
from mlx_speculative.drafters import registry
from mlx_speculative.drafters.mtp import tiny
from mlx_speculative.drafters.training import TrainOptions, train
from mlx_speculative.hooks.cli import main
from mlx_speculative.testing.tiny_models import corpus

pytestmark = pytest.mark.integration

REAL = json.loads((Path(__file__).parent / "fixtures" / "mtp" / "google__gemma-4-E2B-it-assistant.config.json").read_text())
HELD, TOKENS, BLOCK = 16, 64, 4


def prompts(target: Path, n: int, seed: int) -> List[List[int]]:
    tokenizer = load_tokenizer(target)
    return [(tokenizer.encode(t, add_special_tokens=False) * 8)[:8] for t in corpus(n, seed=seed)]


def run(target: Path, out: Path, init: Any = None) -> Dict[str, Any]:
    options = TrainOptions(target=str(target), kind="mtp", out=str(out), init=init, steps=100, batch_size=8,
                           seq_len=8 + TOKENS, prompt_tokens=8, sequences=48, heldout_sequences=HELD, lr=3e-3, warmup=0,
                           weight_decay=0.0, block_size=BLOCK, eval_every=0, checkpoint_every=0, log_every=50, seed=0)
    return train(options, log=lambda line: None, prompts=prompts(target, 48, 1), heldout_prompts=prompts(target, HELD, 99))


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Dict[str, Dict[str, Any]]:
    root = tmp_path_factory.mktemp("mtp_trained")
    q = tiny.write_qwen_target(root / "qwen3_5", tiny.qwen3_5_config(), seed=81, tokenizer_dir=tokenizer_dir, quiet_from=0)
    config = tiny.gemma4_text_config(tie_word_embeddings=False)
    g = tiny.write_gemma_target(root / "gemma4", config, seed=82, tokenizer_dir=tokenizer_dir, quiet_from=0)
    init = tiny.write_assistant(root / "init", tiny.assistant_config(REAL, config), seed=83, tokenizer_dir=tokenizer_dir)
    return {"qwen3_5": {"target": q, **run(q, root / "head")}, "gemma4": {"target": g, **run(g, root / "assistant", str(init))}}


@pytest.mark.parametrize("name", ["qwen3_5", "gemma4"])
def test_offline_tau_on_held_out_text(trained: Dict[str, Dict[str, Any]], name: str) -> None:
    ev = trained[name]["eval"]
    print(f"{name}: offline held-out tau {ev['tau']:.3f} at block {ev['block_size']} ({ev['rounds']} rounds)")
    assert ev["block_size"] == BLOCK and ev["tau"] > 1.8, ev
    losses = trained[name]["losses"]
    assert sum(losses[-10:]) < 0.5 * sum(losses[:10])


@pytest.mark.parametrize("name", ["qwen3_5", "gemma4"])
def test_trained_drafter_decodes_held_out_prompts_exactly(trained: Dict[str, Dict[str, Any]], name: str) -> None:
    run_dir, target_dir = Path(trained[name]["out"]), trained[name]["target"]
    resolution = registry.resolve(str(run_dir), "auto")
    assert (resolution.kind, resolution.family.name) == ("mtp", "qwen3_5_mtp" if name == "qwen3_5" else "gemma4_assistant")
    host = make_host({"draft_model": str(run_dir), "block_size": BLOCK})
    target = host.load(str(target_dir))
    totals = {"rounds": 0, "accepted": 0, "zero": 0, "partial": 0, "full": 0}
    for prompt in prompts(target_dir, HELD, 99):
        result = host.generate(target, prompt, no_stop(TOKENS))
        assert result.tokens == greedy_reference(target.model, prompt, TOKENS)
        stats = result.report["speculative"]
        totals["rounds"] += stats.rounds
        totals["accepted"] += stats.accepted_tokens
        for k, v in stats.rounds_by_acceptance.items():
            totals[k] += v
    tau = 1 + totals["accepted"] / totals["rounds"]
    print(f"{name}: online held-out tau {tau:.3f} at block {BLOCK} over {totals['rounds']} rounds; {totals}")
    assert tau > 1.8 and totals["zero"] > 0 and totals["partial"] > 0 and totals["full"] > 0, totals


def test_the_command_trains_and_checks(trained: Dict[str, Dict[str, Any]], tmp_path: Path) -> None:
    target = trained["qwen3_5"]["target"]
    (tmp_path / "text.txt").write_text("\n".join(corpus(40, seed=5)))
    out, err = io.StringIO(), io.StringIO()
    args = ["train-drafter", "--target", str(target), "--kind", "mtp", "--data", str(tmp_path / "text.txt"),
            "--out", str(tmp_path / "run"), "--steps", "2", "--batch-size", "4", "--seq-len", "20", "--prompt-tokens", "8",
            "--heldout-sequences", "2", "--log-every", "1", "--cpu"]
    with redirect_stdout(out), redirect_stderr(err):
        assert main(args) == 0, err.getvalue()
        assert main(["check", "--model", str(target), "--draft-model", str(tmp_path / "run")]) == 0
    assert "mtp drafter in" in err.getvalue() and "qwen3_5_mtp" in out.getvalue()
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_mtp" and config["block_size"] == 4
