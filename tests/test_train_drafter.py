"""``mlx-spec train-drafter`` end to end on a tiny llama target and a small text file: both kinds
train (the loss falls, the held-out tau is reported), write checkpoints in the real formats that
load through the registry and that ``mlx-spec check`` accepts, decode exactly; an interrupted and
resumed run ends with the same weights as an uninterrupted one; bad input fails in one line."""

from __future__ import annotations

import io
import json
import re
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any, Dict, List, Tuple

import mlx.core as mx
import pytest

from conftest import greedy_reference, make_host, no_stop
from mlx_speculative.drafters import registry
from mlx_speculative.drafters.training import TrainOptions, loop, train
from mlx_speculative.testing import tiny_models as tm
from mlx_speculative.hooks.cli import main

pytestmark = pytest.mark.integration

FIXTURES = Path(__file__).parent / "fixtures" / "dflash"
COMMON = ["--seq-len", "40", "--prompt-tokens", "8", "--batch-size", "8", "--heldout-sequences", "8",
          "--log-every", "1", "--cpu"]
# 16 training sequences seen 40 times: the drafter learns them (high acceptance on them, see
# test_offline_tau_is_the_decoding_tau), while the held-out tau stays low.
DFLASH = ["--kind", "dflash", "--steps", "80", "--sequences", "16", "--lr", "3e-3", "--block-size", "8",
          "--num-layers", "2", "--anchors", "4", "--eval-every", "40", "--checkpoint-every", "40"]
DRAFT_MODEL = ["--kind", "draft_model", "--steps", "40", "--lr", "1e-3", "--num-layers", "1", "--kl-weight", "0.5",
               "--eval-every", "20", "--checkpoint-every", "20"]


def cli(*argv: str) -> Tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="session")
def setup(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Dict[str, Path]:
    root = tmp_path_factory.mktemp("train_drafter")
    target = tm.make_checkpoint(root / "target", tm.llama_config(num_hidden_layers=4), seed=41,
                                tokenizer_dir=tokenizer_dir, logit_scale=3.0, quiet_layers_from=2)
    (root / "train.txt").write_text("\n".join(tm.corpus(300, seed=3)))
    (root / "held.txt").write_text("\n".join(tm.corpus(40, seed=4)))
    return {"root": root, "target": target, "data": root / "train.txt", "held": root / "held.txt"}


def _args(setup: Dict[str, Path], out: Path, kind_args: List[str]) -> List[str]:
    return ["train-drafter", "--target", str(setup["target"]), "--data", str(setup["data"]),
            "--heldout", str(setup["held"]), "--out", str(out), *kind_args, *COMMON]


def _run(setup: Dict[str, Path], name: str, kind_args: List[str]) -> Dict[str, Any]:
    out = setup["root"] / name
    rc, stdout, stderr = cli(*_args(setup, out, kind_args))
    assert rc == 0, stderr
    log = [json.loads(line) for line in (out / "training" / "log.jsonl").read_text().splitlines()]
    return {"out": out, "stdout": stdout, "stderr": stderr, "log": log}


@pytest.fixture(scope="session")
def dflash_run(setup: Dict[str, Path]) -> Dict[str, Any]:
    return _run(setup, "dflash", DFLASH)


@pytest.fixture(scope="session")
def draft_model_run(setup: Dict[str, Path]) -> Dict[str, Any]:
    return _run(setup, "draft_model", DRAFT_MODEL)


def _trained(run: Dict[str, Any], steps: int) -> None:
    losses = [e["loss"] for e in run["log"] if e["event"] == "step"]
    assert len(losses) == steps
    assert sum(losses[-5:]) < 0.85 * sum(losses[:5]), losses
    evals = [e for e in run["log"] if e["event"] == "eval"]
    assert [e["step"] for e in evals] == [steps // 2, steps]
    assert evals[-1]["tau"] > 1.0 and evals[-1]["tau_all_anchors"] > 1.0, evals
    assert re.search(rf"eval step {steps}: held-out tau \d\.\d{{3}} at block \d+", run["stdout"])
    assert re.search(rf"step {steps}/{steps}  loss [\d.]+ .* steps/s  \d+ tok/s", run["stdout"])
    assert "held-out tau" in run["stderr"]  # the closing summary


def _check(setup: Dict[str, Path], out: Path, kind: str) -> None:
    assert registry.resolve(str(out)).family.name == kind
    rc, stdout, _ = cli("check", "--model", str(setup["target"]), "--draft-model", str(out))
    assert rc == 0 and f"kind: {kind}" in stdout and "verdict: compatible" in stdout, stdout


def _decodes_exactly(setup: Dict[str, Path], out: Path, block: int) -> None:
    host = make_host({"draft_model": str(out), "block_size": block})
    target = host.load(str(setup["target"]))
    accepted = 0
    for text in tm.corpus(4, seed=4):
        prompt = target.tokenizer.encode(text, add_special_tokens=False)[:8]
        result = host.generate(target, prompt, no_stop(24))
        assert result.tokens == greedy_reference(target.model, prompt, 24), text
        accepted += result.report["speculative"].accepted_tokens
    assert accepted > 0


def test_dflash_trains_and_reports_tau(dflash_run: Dict[str, Any]) -> None:
    _trained(dflash_run, 80)


def test_dflash_checkpoint_has_the_real_layout(setup: Dict[str, Path], dflash_run: Dict[str, Any]) -> None:
    out = dflash_run["out"]
    config = json.loads((out / "config.json").read_text())
    real = json.loads((FIXTURES / "z-lab__Qwen3-8B-DFlash-b16.config.json").read_text())
    # No remote code and no transformers here: z-lab's auto_map and transformers_version are left out.
    assert set(config) == set(real) - {"auto_map", "transformers_version"}
    assert set(config["dflash_config"]) == set(real["dflash_config"])
    assert config["block_size"] == 8 and config["num_hidden_layers"] == 2 and config["num_target_layers"] == 4
    assert config["dflash_config"]["target_layer_ids"] == [0, 3]  # the last layer: read after the final norm
    weights = mx.load(str(out / "model.safetensors"))
    per_layer = {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                 "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                 "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight"}
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {f"layers.{i}.{n}" for i in range(2) for n in per_layer}
    assert set(weights) == expected  # 11 per layer + 3: 58 for z-lab's 5-layer Qwen3-8B drafter
    assert weights["fc.weight"].shape == (64, 2 * 64) and weights["fc.weight"].dtype == mx.float32
    _check(setup, out, "dflash")


def test_dflash_trained_decodes_exactly(setup: Dict[str, Path], dflash_run: Dict[str, Any]) -> None:
    _decodes_exactly(setup, dflash_run["out"], 8)


def test_offline_tau_is_the_decoding_tau(setup: Dict[str, Path], dflash_run: Dict[str, Any],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The evaluation's rounds are the ones greedy decoding makes, round for round: the same
    features, blocks and positions. On the training sequences, which the drafter learnt (a feature
    mismatch between training and decoding would lose that acceptance)."""
    import numpy as np

    from mlx_speculative.drafters.dflash.train import DFlashTrainer
    from mlx_speculative.drafters.training.data import Data
    from mlx_speculative.drafters.training.loop import evaluate, load_target
    from mlx_speculative.hooks import taps
    from mlx_speculative.plugin.metrics import SpecStats

    out = dflash_run["out"]
    options = TrainOptions(target=str(setup["target"]), kind="dflash", out=str(out), init=str(out), batch_size=8)
    target = load_target(options.target)
    trainer = DFlashTrainer(options)
    model = trainer.build(target)
    taps.install_taps(target.model, trainer.capture_layers())
    sequences = np.array(mx.load(str(out / "training" / "data.safetensors"))["train"])[:8]  # [8, L]
    P, L, B = 8, sequences.shape[1], trainer.block_size
    offline = evaluate(trainer, model, target, Data(sequences, sequences, P - 1, {"prompt_tokens": P}), options)
    assert offline["tau"] > 2.5, offline

    outcomes: List[int] = []
    record = SpecStats.record
    monkeypatch.setattr(SpecStats, "record", lambda self, o: (outcomes.append(o.accepted), record(self, o))[1])
    host = make_host({"draft_model": str(out), "block_size": B, "adaptive": False})
    loaded = host.load(str(setup["target"]))
    rounds = accepted = 0
    for row in sequences:
        outcomes.clear()
        # B tokens more than the sequence: every round that starts inside it has a whole block.
        result = host.generate(loaded, [int(t) for t in row[:P]], no_stop(L - P + B))
        assert result.tokens[:L - P] == [int(t) for t in row[P:]]
        p = P  # the pending token's position: the first generated token, then after each round's accepted
        for a in outcomes:
            if p > L - B:
                break
            rounds, accepted, p = rounds + 1, accepted + a, p + a + 1
    assert (rounds, accepted) == (offline["rounds"], round((offline["tau"] - 1) * offline["rounds"])), offline


def test_dflash_init_keeps_the_nested_layout(setup: Dict[str, Path]) -> None:
    from mlx_speculative.drafters.dflash import tiny

    real = json.loads((FIXTURES / "z-lab__Qwen3.5-4B-DFlash.config.json").read_text())
    init = tiny.write_checkpoint(setup["root"] / "nested_init", tiny.shrink_config(
        real, target_layer_ids=[1, 2], mask_token_id=383, num_target_layers=4, sliding_window=8), seed=3)
    out = setup["root"] / "nested"
    rc, _, err = cli("train-drafter", "--target", str(setup["target"]), "--data", str(setup["data"]), "--out", str(out),
                     "--kind", "dflash", "--init", str(init), "--block-size", "4", "--steps", "2", "--anchors", "2",
                     "--seq-len", "20", "--prompt-tokens", "8", "--batch-size", "2", "--heldout-sequences", "0", "--cpu")
    assert rc == 0, err
    config = json.loads((out / "config.json").read_text())
    assert set(config) == set(json.loads((init / "config.json").read_text()))
    assert config["dflash_config"]["block_size"] == 4 and "block_size" not in config
    assert set(mx.load(str(out / "model.safetensors"))) == set(mx.load(str(init / "model.safetensors")))
    _check(setup, out, "dflash")


def test_draft_model_trains_loads_and_decodes(setup: Dict[str, Path], draft_model_run: Dict[str, Any]) -> None:
    from mlx_lm import load

    _trained(draft_model_run, 40)
    evals = [e for e in draft_model_run["log"] if e["event"] == "eval"]
    assert evals[-1]["loss"] < evals[0]["loss"], evals
    out = draft_model_run["out"]
    config = json.loads((out / "config.json").read_text())
    target_config = json.loads((setup["target"] / "config.json").read_text())
    assert set(config) == set(target_config) and config["num_hidden_layers"] == 1
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    model, _ = load(str(out))  # mlx-lm's own loader, strict
    assert len(model.model.layers) == 1
    _check(setup, out, "draft_model")
    _decodes_exactly(setup, out, 4)


def _options(setup: Dict[str, Path], out: Path, **over: Any) -> TrainOptions:
    base = dict(target=str(setup["target"]), kind="dflash", out=str(out), data=[str(setup["data"])], steps=10,
                batch_size=4, seq_len=24, prompt_tokens=8, sequences=16, heldout_sequences=0, block_size=4,
                num_layers=1, anchors=3, lr=3e-3, checkpoint_every=4, eval_every=0, log_every=10)
    return TrainOptions(**{**base, **over})


def _final_weights(out: Path) -> Dict[str, mx.array]:
    state = json.loads((out / "training" / "state.json").read_text())
    assert state["step"] == 10 and state["complete"]
    return mx.load(str(out / "model.safetensors"))


def _stop(at: int, error: type) -> Any:
    def on_step(step: int, loss: float) -> None:
        if step == at:
            raise error("stopped by the test")
    return on_step


@pytest.mark.parametrize("kind", ["dflash", "draft_model", "eagle3"])
def test_interrupted_and_resumed_equals_uninterrupted(setup: Dict[str, Path], kind: str) -> None:
    root = setup["root"] / f"resume_{kind}"
    over = {"dflash": {}, "draft_model": {"kind": kind, "block_size": None, "anchors": None, "kl_weight": 0.5},
            # eagle3: the draft vocabulary is chosen from the sequences, the head starts as the target's rows
            "eagle3": {"kind": kind, "anchors": None, "num_layers": None, "draft_vocab_size": 200}}[kind]
    quiet = lambda line: None  # noqa: E731
    train(_options(setup, root / "straight", **over), log=quiet)
    # A crash (no checkpoint at the crash: the run restarts from step 8), then Ctrl-C (saved at step 7).
    for name, at, error, saved in (("crash", 9, RuntimeError, 8), ("interrupt", 7, KeyboardInterrupt, 7)):
        with pytest.raises(error):
            train(_options(setup, root / name, **over), log=quiet, on_step=_stop(at, error))
        assert json.loads((root / name / "training" / "state.json").read_text())["step"] == saved
        result = train(_options(setup, root / name, resume=True, **over), log=quiet)
        assert result["first_step"] == saved and len(result["losses"]) == 10 - saved
    straight = _final_weights(root / "straight")
    for name in ("crash", "interrupt"):
        resumed = _final_weights(root / name)
        assert set(resumed) == set(straight)
        assert all(mx.array_equal(resumed[k], straight[k]).item() for k in straight), name
    # The weights did move: equality is not that of untrained copies.
    first = train(_options(setup, root / "one_step", steps=1, **over), log=quiet)
    assert first["step"] == 1
    one = mx.load(str(root / "one_step" / "model.safetensors"))
    assert not all(mx.array_equal(one[k], straight[k]).item() for k in straight)


def test_max_time_stops_and_resume_finishes(setup: Dict[str, Path]) -> None:
    out = setup["root"] / "max_time"
    args = ["train-drafter", "--target", str(setup["target"]), "--data", str(setup["data"]), "--out", str(out),
            "--kind", "draft_model", "--steps", "3", "--seq-len", "16", "--prompt-tokens", "8", "--batch-size", "2",
            "--heldout-sequences", "0", "--num-layers", "1", "--cpu"]
    rc, stdout, _ = cli(*args, "--max-time", "0")
    assert rc == 0 and "stopped at step 1 of 3" in stdout, stdout
    rc, stdout, err = cli(*args, "--max-time", "0")
    assert rc == 2 and "pass --resume" in err
    rc, stdout, _ = cli(*args, "--resume")
    assert rc == 0 and "resume: step 1 of 3" in stdout and "checkpoint: step 3" in stdout, stdout
    rc, stdout, _ = cli(*args, "--resume")
    assert rc == 0 and "the run is complete" in stdout


def test_help_names_only_trainable_kinds() -> None:
    out = io.StringIO()
    with redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        main(["train-drafter", "--help"])
    assert exit_info.value.code == 0
    text = out.getvalue()
    from mlx_speculative.drafters.training import trainable_kinds

    assert f"drafter kind: {'|'.join(sorted(trainable_kinds()))}" in text and "draft_model" in text and "eagle3" in text, text
    assert not re.search(r"ngram", text), text
    rc, stdout, _ = cli("drafters")
    assert "ngram" in stdout  # registered, but has nothing to train


BAD = [
    (["--kind", "ngram"], r"--kind: 'ngram' cannot be trained here"),
    (["--data", "/nonexistent/text.txt"], r"--data: '/nonexistent/text.txt' does not exist"),
    (["--target", "/nonexistent/target"], r"target '/nonexistent/target' not found"),
    (["--steps", "0"], r"--steps: got 0; allowed: 1 or more"),
    (["--block-size", "1"], r"--block-size: got 1; allowed: 2 to 128"),
    (["--warmup", "90"], r"--warmup: got 90 steps; allowed: fewer than --steps \(80\)"),
    (["--kl-weight", "0.5"], r"--kl-weight does not apply to --kind dflash"),
    (["--anchors", "0"], r"--anchors: got 0"),
    (["--seq-len", "12"], r"--seq-len: got 12; allowed: at least"),
    (["--lr", "0"], r"--lr: got 0.0"),
    (["--dtype", "int8"], r"--dtype: got 'int8'; allowed: float32, bfloat16, float16"),
    (["--init", "/nonexistent/init"], r"--init: the drafter's size comes from its config.json"),
    (["--temperature", "-1"], r"--temperature: got -1.0; allowed: 0 or more"),
]


@pytest.mark.parametrize("extra, message", BAD)
def test_bad_input_is_one_line_before_loading(setup: Dict[str, Path], monkeypatch: pytest.MonkeyPatch,
                                               extra: List[str], message: str) -> None:
    monkeypatch.setattr(loop, "load_target", lambda spec: pytest.fail("the target was loaded"))
    args = _args(setup, setup["root"] / "never", DFLASH)
    for i in range(0, len(extra), 2):  # the later value of an option wins in argparse
        args += extra[i:i + 2]
    rc, _, err = cli(*args)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and err.startswith("mlx-spec: error: "), err
    assert re.search(message, err), err
    assert not (setup["root"] / "never").exists()


@pytest.mark.parametrize("extra, message", [
    (["--target-layers", "0,9"], r"the DFlash drafter would not fit the target: dflash_config.target_layer_ids: "
                                 r"\[0, 9\] names layer\(s\) \[9\] .* 4 decoder layers \(0..3\)"),
    (["--mask-token-id", "384"], r"dflash_config.mask_token_id: 384 is outside the target's vocabulary"),
    (["--kind", "draft_model", "--kl-weight", "0.1", "--anchors", None, "--hidden-size", "40"],
     r"--hidden-size: got 40; allowed: a multiple of the target's head_dim 16"),
])
def test_bad_input_for_this_target_is_one_line(setup: Dict[str, Path], extra: List[Any], message: str) -> None:
    args = _args(setup, setup["root"] / "never_fits", DFLASH)
    for i in range(0, len(extra), 2):
        name, value = extra[i:i + 2]
        if value is None:  # drop an option of the other kind
            at = args.index(name)
            del args[at:at + 2]
        else:
            args += [name, value]
    rc, _, err = cli(*args)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and err.startswith("mlx-spec: error: "), err
    assert re.search(message, err), err
    assert not (setup["root"] / "never_fits" / "training" / "data.safetensors").exists()  # failed before generating


def test_out_dir_checks(setup: Dict[str, Path], dflash_run: Dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loop, "load_target", lambda spec: pytest.fail("the target was loaded"))
    out = dflash_run["out"]
    rc, _, err = cli(*_args(setup, out, DFLASH))
    assert rc == 2 and "holds a training run at step 80 of 80; pass --resume" in err, err
    rc, _, err = cli(*_args(setup, out, DFLASH), "--resume", "--lr", "1e-3")
    assert rc == 2 and "--resume: --lr was 0.003 in the run" in err and len(err.splitlines()) == 1, err
    rc, stdout, _ = cli(*_args(setup, out, DFLASH), "--resume")
    assert rc == 0 and "the run is complete" in stdout
    busy = setup["root"] / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("x")
    rc, _, err = cli(*_args(setup, busy, DFLASH))
    assert rc == 2 and "is not empty and holds no training run" in err


@pytest.mark.parametrize("arch", ["qwen3", "gpt_oss"])  # tied embeddings; per-layer layer_types and experts
def test_both_kinds_on_other_architectures(setup: Dict[str, Path], tokenizer_dir: Path, arch: str) -> None:
    root = setup["root"] / arch
    target = tm.make_checkpoint(root / "target", tm.ARCH_CONFIGS[arch](num_hidden_layers=4), seed=5, tokenizer_dir=tokenizer_dir)
    for kind, extra in (("dflash", ["--block-size", "4", "--anchors", "2"]), ("draft_model", [])):
        out = root / kind
        rc, _, err = cli("train-drafter", "--target", str(target), "--data", str(setup["data"]), "--out", str(out),
                         "--kind", kind, "--steps", "2", "--seq-len", "16", "--prompt-tokens", "8", "--batch-size", "2",
                         "--heldout-sequences", "2", "--num-layers", "2", *extra, "--cpu")
        assert rc == 0, err
        rc, stdout, _ = cli("check", "--model", str(target), "--draft-model", str(out))
        assert rc == 0 and "verdict: compatible" in stdout, stdout
        config = json.loads((out / "config.json").read_text())
        if kind == "draft_model" and "layer_types" in config:  # per-layer lists cut with the layers
            assert config["layer_types"] == ["sliding_attention", "full_attention"]
    # A draft LM from an existing one (--init): mlx-lm's loader, same layout.
    init = tm.make_truncated_drafter(target, root / "init", num_layers=2)
    out = root / "from_init"
    rc, _, err = cli("train-drafter", "--target", str(target), "--data", str(setup["data"]), "--out", str(out),
                     "--kind", "draft_model", "--init", str(init), "--steps", "2", "--seq-len", "16", "--prompt-tokens", "8",
                     "--batch-size", "2", "--heldout-sequences", "0", "--cpu")
    assert rc == 0, err
    assert set(json.loads((out / "config.json").read_text())) == set(json.loads((init / "config.json").read_text()))
    assert set(mx.load(str(out / "model.safetensors"))) == set(mx.load(str(init / "model.safetensors")))


def test_draft_lm_keeps_every_layer_type() -> None:
    from mlx_speculative.drafters.draft_model.train import kept_layers

    pattern = {"num_hidden_layers": 6, "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}
    assert kept_layers(pattern, 2) == [0, 5] and kept_layers(pattern, 3) == [0, 1, 5]
    assert kept_layers({"num_hidden_layers": 6}, 2) == [0, 1]
    with pytest.raises(ValueError, match=r"--num-layers: got 1; allowed: at least 2 for this target"):
        kept_layers(pattern, 1)
