"""A tiny EAGLE-3 drafter trained with the training core (``mlx-spec train-drafter --kind eagle3``)
on its target's own greedy text: at chain depth 7 it reaches a mean acceptance length above 2 on
16 held-out prompts x 64 new tokens, decoding stays exact, the offline tau of training is the
decoding tau round for round, and the layer convention travels with the layout."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

import mlx.core as mx
import numpy as np
import pytest

from conftest import greedy_reference, make_host, no_stop
from mlx_speculative.drafters import registry
from mlx_speculative.drafters.base import DraftTarget
from mlx_speculative.drafters.eagle3 import tiny
from mlx_speculative.testing import tiny_models as tm
from mlx_speculative.hooks.cli import main
from mlx_speculative.testing.tiny_models import corpus

pytestmark = pytest.mark.integration

BLOCK = 8  # chain depth 7
NEW_TOKENS = 64
TRAIN_SEQUENCES = 64


def prompt_of(tokenizer: Any, text: str) -> List[int]:
    return (tokenizer.encode(text, add_special_tokens=False) * 8)[:8]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Dict[str, Any]:
    root = tmp_path_factory.mktemp("eagle3_trained")
    # Quiet layers (output projections x0.1): the target's text follows its tokens mostly, its context some.
    target = tm.make_checkpoint(root / "target", tm.llama_config(num_hidden_layers=4), seed=41, tokenizer_dir=tokenizer_dir,
                                logit_scale=3.0, quiet_layers_from=0, quiet_scale=0.1)
    losses = tiny.train(None, target, root / "drafter", steps=70, sequences=TRAIN_SEQUENCES, length=48, block=BLOCK,
                        lr=4e-3, draft_vocab_size=256)
    assert losses["last_loss"] < losses["first_loss"] / 4, losses
    return {"target": target, "drafter": root / "drafter", "root": root}


def test_checkpoint_is_specforge_layout_with_a_frequency_draft_vocabulary(trained: Dict[str, Any]) -> None:
    config = json.loads((trained["drafter"] / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 256
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 3]  # output of layer i, spread
    weights = mx.load(str(trained["drafter"] / "model.safetensors"))
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "midlayer.hidden_norm.weight",
            "midlayer.self_attn.q_proj.weight"} <= set(weights) and "embed_tokens.weight" not in weights
    assert weights["midlayer.self_attn.q_proj.weight"].shape == (64, 128)  # q over [embedding || hidden]
    ids = np.arange(256) + np.array(weights["d2t"])
    assert np.nonzero(np.array(weights["t2d"]))[0].tolist() == ids.tolist() and ids.max() > 300
    assert registry.resolve(str(trained["drafter"])).kind == "eagle3"
    assert main(["check", "--model", str(trained["target"]), "--draft-model", str(trained["drafter"])]) == 0


def test_tau_above_two_at_depth_seven_on_held_out_text(trained: Dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy, exact, tau > 2 on prompts it was not trained on; and the training core's offline
    evaluation of the same sequences makes the same rounds (features, positions and chain alike)."""
    from mlx_speculative.drafters.eagle3.train import Eagle3Trainer
    from mlx_speculative.drafters.training import TrainOptions
    from mlx_speculative.drafters.training.data import Data
    from mlx_speculative.drafters.training.loop import evaluate, load_target
    from mlx_speculative.hooks import taps
    from mlx_speculative.plugin.metrics import SpecStats

    held = corpus(16, seed=1000)
    assert not set(held) & set(corpus(TRAIN_SEQUENCES, seed=1))
    host = make_host({"draft_model": str(trained["drafter"]), "block_size": BLOCK, "adaptive": False})
    target = host.load(str(trained["target"]))
    outcomes: List[List[int]] = []
    record = SpecStats.record
    monkeypatch.setattr(SpecStats, "record", lambda self, o: (outcomes[-1].append(o.accepted), record(self, o))[1])
    totals = {"zero": 0, "partial": 0, "full": 0}
    rounds = accepted = 0
    sequences = []
    for text in held:
        prompt = prompt_of(target.tokenizer, text)
        outcomes.append([])
        result = host.generate(target, prompt, no_stop(NEW_TOKENS))
        assert result.tokens == greedy_reference(target.model, prompt, NEW_TOKENS), text
        stats = result.report["speculative"]
        rounds, accepted = rounds + stats.rounds, accepted + stats.accepted_tokens
        for k, v in stats.rounds_by_acceptance.items():
            totals[k] += v
        sequences.append(prompt + result.tokens)
    tau = 1 + accepted / rounds
    print(f"\nheld-out tau at chain depth {BLOCK - 1}: {tau:.3f} ({rounds} rounds, {accepted} accepted, {totals})")
    assert tau > 2.0 and all(v > 0 for v in totals.values()), (tau, totals)

    options = TrainOptions(target=str(trained["target"]), kind="eagle3", out=str(trained["root"] / "eval"),
                           init=str(trained["drafter"]), batch_size=8, block_size=BLOCK)
    loaded = load_target(options.target)
    trainer = Eagle3Trainer(options)
    model = trainer.build(loaded)
    taps.install_taps(loaded.model, trainer.capture_layers())
    # Without the last token: rounds at p <= L - 8 then have a whole block of 7 drafts when decoding
    # (closer to the end the round loop drafts fewer, to stop at 64 tokens; the offline walk does not).
    seqs = np.array(sequences, dtype=np.int32)[:, :-1]  # [16, 8 + 63]
    offline = evaluate(trainer, model, loaded, Data(seqs, seqs, 7, {"prompt_tokens": 8}), options)
    L, made, kept = seqs.shape[1], 0, 0
    for row in outcomes:  # the decoding rounds that start inside the sequence with a whole block
        p = 8
        for a in row:
            if p > L - BLOCK:
                break
            made, kept, p = made + 1, kept + a, p + a + 1
    assert (made, kept) == (offline["rounds"], round((offline["tau"] - 1) * offline["rounds"])), offline


def _as_speculators(src: Path, out: Path, ids: List[int]) -> Path:
    """The trained SpecForge checkpoint rewritten in the speculators layout with layer ids ``ids``."""
    config = json.loads((src / "config.json").read_text())
    layer = {k: config[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                    "head_dim", "rms_norm_eps", "rope_theta", "vocab_size", "max_position_embeddings")}
    spec = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "draft_vocab_size": 256,
            "eagle_aux_hidden_state_layer_ids": ids, "norm_before_residual": False, "target_hidden_size": None,
            "speculators_config": {"algorithm": "eagle3", "proposal_methods": [{"speculative_tokens": BLOCK - 1}]},
            "transformer_layer_config": {**layer, "model_type": "llama", "num_hidden_layers": 1}}
    weights = {k.replace("midlayer.", "layers.0."): v for k, v in mx.load(str(src / "model.safetensors")).items()}
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    (out / "config.json").write_text(json.dumps(spec))
    return out


def test_the_layer_convention_moves_with_the_layout(trained: Dict[str, Any]) -> None:
    """SpecForge's ids name layer outputs, speculators' the input of layer i: the same drafter in the
    speculators layout needs every id plus one, then decodes round for round the same; the ids
    copied as they are would name the embedding output, which check refuses by name."""
    shifted = _as_speculators(trained["drafter"], trained["root"] / "speculators", [1, 3, 4])
    runs = []
    for path in (trained["drafter"], shifted):
        host = make_host({"draft_model": str(path), "block_size": BLOCK, "adaptive": False})
        target = host.load(str(trained["target"]))
        assert target.attachments["speculative"].drafter.capture_layers() == [0, 2, 3]
        out = []
        for text in corpus(3, seed=1000):
            result = host.generate(target, prompt_of(target.tokenizer, text), no_stop(32))
            out.append((result.tokens, result.report["speculative"].accepted_per_position))
        runs.append(out)
    assert runs[0] == runs[1] and sum(sum(p) for _, p in runs[0]) > 0
    verbatim = _as_speculators(trained["drafter"], trained["root"] / "verbatim", [0, 2, 3])
    verdict = registry.check(registry.resolve(str(verbatim)), DraftTarget(config=tm.llama_config(), num_layers=4))
    assert not verdict.ok and "names layer(s) [0] (hidden_states[0] is the embedding output" in verdict.reasons[0]


def test_train_drafter_cli_init_keeps_the_speculators_layout(trained: Dict[str, Any]) -> None:
    from test_train_drafter import cli

    root = trained["root"]
    (root / "text.txt").write_text("\n".join(corpus(60, seed=5)))
    real = json.loads((Path(__file__).parent / "fixtures" / "eagle3" / "speculators-issue-1065__eagle3-qwen3moe.config.json").read_text())
    init = tiny.write_checkpoint(root / "init", tiny.shrink_config(real, layer_ids=[1, 3, 4], norm_output=False), seed=9)
    out = root / "cli"
    rc, stdout, stderr = cli("train-drafter", "--target", str(trained["target"]), "--kind", "eagle3", "--init", str(init),
                             "--data", str(root / "text.txt"), "--out", str(out), "--steps", "4", "--batch-size", "4",
                             "--seq-len", "24", "--prompt-tokens", "8", "--heldout-sequences", "4", "--eval-every", "0",
                             "--log-every", "2", "--cpu")
    assert rc == 0, stderr
    assert "eagle3 drafter (speculators layout), 1 layer(s), chain depth 7" in stdout and "held-out tau" in stderr
    config = json.loads((out / "config.json").read_text())
    assert set(config) == set(json.loads((init / "config.json").read_text()))
    weights, before = mx.load(str(out / "model.safetensors")), mx.load(str(init / "model.safetensors"))
    assert set(weights) == set(before) and mx.array_equal(weights["d2t"], before["d2t"]).item()
    assert not mx.array_equal(weights["layers.0.self_attn.q_proj.weight"], before["layers.0.self_attn.q_proj.weight"]).item()
    assert main(["check", "--model", str(trained["target"]), "--draft-model", str(out)]) == 0


@pytest.mark.parametrize("extra, message", [
    (["--draft-vocab-size", "0"], r"--draft-vocab-size: got 0; allowed: 1 or more"),
    (["--num-layers", "2"], r"--num-layers: got 2; eagle3 drafters written here have one decoder layer"),
    (["--draft-vocab-size", "999"], r"--draft-vocab-size: got 999; allowed: 1 to the target's vocab_size 384"),
    (["--target-layers", "0,2,9"], r"the EAGLE-3 drafter would not fit the target: eagle_config.eagle_aux_hidden_state_layer_ids: "
                                   r"\[0, 2, 9\] \(from the checkpoint\) names layer\(s\) \[9\]"),
    (["--anchors", "3"], r"--anchors does not apply to --kind eagle3"),
])
def test_train_drafter_cli_bad_input_is_one_line(trained: Dict[str, Any], extra: List[str], message: str) -> None:
    import re

    from test_train_drafter import cli

    (trained["root"] / "text.txt").write_text("\n".join(corpus(60, seed=5)))
    rc, _, err = cli("train-drafter", "--target", str(trained["target"]), "--kind", "eagle3", "--data",
                     str(trained["root"] / "text.txt"), "--out", str(trained["root"] / "never"), "--steps", "2",
                     "--seq-len", "24", "--prompt-tokens", "8", "--cpu", *extra)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and re.search(message, err), err
