"""Qwen3.5-style MTP heads for plain attention targets (mlx-lm's llama and qwen3): family qwen3_5_mtp,
mlx-vlm's standalone layout, plus ``target_model_type`` naming the target they were made for.

Random heads (``tiny.write_plain_head``, the config ``mlx-spec train-drafter --kind mtp`` writes) on
the tiny llama and qwen3 targets of conftest: ``check`` says compatible, kind auto resolves to mtp,
rounds forced to zero, partial and full acceptance equal plain decoding token for token (the head's
KV cache and last output compared with a from-scratch recomputation after every round), and a batch
of eight rows accepts different counts in the same step. A head made for another target type is
refused by name. Real Llama 3.1 / Qwen3 configs give a head of their sizes and RoPE. One short
training run on a tiny llama target (its later blocks quiet, so that its greedy text is learnable)
reaches tau > 1.5 at depth 3 on held-out prompts, offline and online.
"""

from __future__ import annotations

import io
import json
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any, Dict, List

import pytest

from conftest import PROMPTS, encode, greedy_reference, make_host, no_stop
from mlx_speculative.drafters import registry
from mlx_speculative.drafters.base import DraftTarget
from mlx_speculative.drafters.mtp import qwen, tiny
from mlx_speculative.drafters.mtp.qwen3_5_mtp import Model as Head
from mlx_speculative.drafters.mtp.qwen3_5_mtp import ModelArgs as HeadArgs
from mlx_speculative.drafters.training import TrainOptions, train
from mlx_speculative.testing import tiny_models as tm
from mlx_speculative.hooks.cli import main
from test_mtp_qwen import batch_of_eight_is_exact, forced_rounds_are_exact
from test_mtp_trained import prompts

pytestmark = pytest.mark.integration

FIXTURES = Path(__file__).parent / "fixtures"
BLOCK = 4  # 3 draft tokens per round: the head applied recursively beyond its depth of 1
ARCHS = ["llama", "qwen3"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, llama_pair: Dict[str, Path],
           qwen3_pair: Dict[str, Path]) -> Dict[str, Path]:
    root = tmp_path_factory.mktemp("mtp_plain")
    out = {"llama": llama_pair["target"], "qwen3": qwen3_pair["target"]}
    for i, arch in enumerate(ARCHS):
        out[arch + ":head"] = tiny.write_plain_head(out[arch], root / f"{arch}-head", seed=71 + i, block_size=BLOCK)
    return out


def cli(args: List[str]) -> tuple:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(args)
    return rc, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("arch", ARCHS)
def test_check_says_compatible_and_kind_auto_resolves_to_mtp(arch: str, models: Dict[str, Path]) -> None:
    head = models[arch + ":head"]
    config = json.loads((head / "config.json").read_text())
    assert (config["model_type"], config["target_model_type"]) == ("qwen3_5_mtp", arch)
    assert config["text_config"]["model_type"] == "qwen3_5_text" and config["block_size"] == BLOCK
    resolution = registry.resolve(str(head), "auto")
    assert (resolution.kind, resolution.family.name) == ("mtp", "qwen3_5_mtp")
    rc, out, err = cli(["check", "--model", str(models[arch]), "--draft-model", str(head)])
    assert rc == 0, out + err
    assert "kind: mtp (family qwen3_5_mtp)" in out and "verdict: compatible" in out
    assert f"target_model_type: '{arch}', the target's model_type" in out
    target = make_host({"draft_model": str(head), "kind": "auto"}).load(str(models[arch]))
    drafter = target.attachments["speculative"].drafter
    assert (drafter.kind, drafter.family, drafter.default_block_size) == ("mtp", "qwen3_5_mtp", BLOCK)


def test_a_head_for_another_target_type_is_refused(models: Dict[str, Path]) -> None:
    # The llama head has the qwen3 target's sizes exactly: only target_model_type tells them apart.
    rc, out, _ = cli(["check", "--model", str(models["qwen3"]), "--draft-model", str(models["llama:head"])])
    assert rc == 1 and "verdict: NOT compatible" in out
    assert ("target model_type: 'qwen3'; this head was trained for a 'llama' target (target_model_type: 'llama'); "
            "allowed: llama") in out
    host = make_host({"draft_model": str(models["llama:head"])})
    with pytest.raises(Exception, match=r"target model_type: 'qwen3'; this head was trained for a 'llama' target"):
        host.load(str(models["qwen3"]))
    # Without the field (a real Qwen release's split head) only qwen3_5 targets are allowed.
    config = json.loads((models["llama:head"] / "config.json").read_text())
    del config["target_model_type"]
    target = json.loads((models["llama"] / "config.json").read_text())
    verdict = qwen.check(None, config, DraftTarget(config=target, path=None))
    assert not verdict.ok and any(r.startswith("target model_type: 'llama'; a qwen3_5 MTP head needs a target of type "
                                               "qwen3_5, qwen3_5_text") for r in verdict.reasons), verdict.reasons


@pytest.mark.parametrize("name", ["eagle3/meta-llama__Llama-3.1-8B-Instruct", "dflash/Qwen__Qwen3-8B"])
def test_real_target_configs_give_a_head_with_their_sizes_and_rope(name: str) -> None:
    real = json.loads((FIXTURES / f"{name}.config.json").read_text())
    config = qwen.plain_head_config(real, BLOCK)
    text = config["text_config"]
    assert config["target_model_type"] == real["model_type"] and text["model_type"] == "qwen3_5_text"
    for field in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
                  "rms_norm_eps", "tie_word_embeddings"):
        assert text[field] == real[field], field
    assert text["head_dim"] == real.get("head_dim", 128) and text["rope_parameters"]["rope_theta"] == real["rope_theta"]
    assert qwen.check(None, config, DraftTarget(config=real, path=None)).ok
    # The head's layer at a tiny width, with the real RoPE settings (Llama 3.1: llama3 scaling).
    small = dict(text, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    rope = Head(HeadArgs.from_dict(dict(config, text_config=small))).layers[0].self_attn.rope
    kind = (real.get("rope_scaling") or {}).get("rope_type", "default")
    assert type(rope).__name__ == {"llama3": "Llama3RoPE", "default": "RoPE"}[kind]


@pytest.mark.parametrize("arch", ARCHS)
def test_forced_acceptance_is_exact_and_the_head_cache_is_recomputed(
    arch: str, models: Dict[str, Path], monkeypatch: pytest.MonkeyPatch,
) -> None:
    host = make_host({"draft_model": str(models[arch + ":head"]), "block_size": BLOCK})
    target = host.load(str(models[arch]))
    forced_rounds_are_exact(host, target, encode(target, PROMPTS[5]), monkeypatch)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_batch_of_eight_accepts_different_counts_in_one_step(arch: str, models: Dict[str, Path]) -> None:
    batch_of_eight_is_exact(str(models[arch]), str(models[arch + ":head"]))


HELD, TOKENS, SEQUENCES = 8, 64, 32


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Dict[str, Any]:
    root = tmp_path_factory.mktemp("mtp_plain_trained")
    target = tm.make_checkpoint(root / "llama", tm.llama_config(num_hidden_layers=4), seed=91,
                                tokenizer_dir=tokenizer_dir, logit_scale=3.0, quiet_layers_from=0)
    options = TrainOptions(target=str(target), kind="mtp", out=str(root / "head"), steps=60, batch_size=8,
                           seq_len=8 + TOKENS, prompt_tokens=8, sequences=SEQUENCES, heldout_sequences=HELD, lr=3e-3, warmup=0,
                           weight_decay=0.0, block_size=BLOCK, eval_every=0, checkpoint_every=0, log_every=50, seed=0)
    result = train(options, log=lambda line: None, prompts=prompts(target, SEQUENCES, 1),
                   heldout_prompts=prompts(target, HELD, 99))
    return {"target": target, **result}


def test_a_trained_head_for_a_llama_target_accepts_on_held_out_prompts(trained: Dict[str, Any]) -> None:
    run_dir, target_dir = Path(trained["out"]), trained["target"]
    config = json.loads((run_dir / "config.json").read_text())
    assert (config["model_type"], config["target_model_type"], config["block_size"]) == ("qwen3_5_mtp", "llama", BLOCK)
    ev = trained["eval"]
    print(f"llama: offline held-out tau {ev['tau']:.3f} at block {ev['block_size']} ({ev['rounds']} rounds)")
    assert ev["block_size"] == BLOCK and ev["tau"] > 1.5, ev
    resolution = registry.resolve(str(run_dir), "auto")
    assert (resolution.kind, resolution.family.name) == ("mtp", "qwen3_5_mtp")
    host = make_host({"draft_model": str(run_dir), "block_size": BLOCK})
    target = host.load(str(target_dir))
    rounds = accepted = 0
    for prompt in prompts(target_dir, HELD, 99):
        result = host.generate(target, prompt, no_stop(TOKENS))
        assert result.tokens == greedy_reference(target.model, prompt, TOKENS)
        rounds += result.report["speculative"].rounds
        accepted += result.report["speculative"].accepted_tokens
    tau = 1 + accepted / rounds
    print(f"llama: online held-out tau {tau:.3f} at block {BLOCK} over {rounds} rounds")
    assert tau > 1.5


def test_the_command_trains_a_head_for_a_qwen3_target(models: Dict[str, Path], tmp_path: Path) -> None:
    (tmp_path / "text.txt").write_text("\n".join(tm.corpus(40, seed=5)))
    args = ["train-drafter", "--target", str(models["qwen3"]), "--kind", "mtp", "--data", str(tmp_path / "text.txt"),
            "--out", str(tmp_path / "run"), "--steps", "2", "--batch-size", "4", "--seq-len", "20", "--prompt-tokens", "8",
            "--heldout-sequences", "2", "--log-every", "1", "--cpu"]
    rc, _, err = cli(args)
    assert rc == 0, err
    assert "mtp drafter in" in err
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert (config["model_type"], config["target_model_type"]) == ("qwen3_5_mtp", "qwen3")
    rc, out, _ = cli(["check", "--model", str(models["qwen3"]), "--draft-model", str(tmp_path / "run")])
    assert rc == 0 and "verdict: compatible" in out
    rc, _, err = cli(["train-drafter", "--target", str(models["qwen3"]), "--kind", "mtp", "--hidden-size", "32",
                      "--data", str(tmp_path / "text.txt"), "--out", str(tmp_path / "bad"), "--steps", "2", "--cpu"])
    assert rc == 2 and "--hidden-size / --num-layers: a Qwen MTP head has the target's width and one layer" in err
