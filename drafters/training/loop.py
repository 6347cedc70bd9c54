"""The training loop: batches, the target's forward, the family's loss, AdamW with warmup + cosine,
gradient clipping, progress, held-out tau, checkpoints and exact resume.

Exact resume: the batch order and every random draw of step k derive from (seed, k) alone, and a
checkpoint holds the float32 weights, the optimiser state (its step counter included) and the
step; so a run interrupted and resumed ends with the same weights, bit for bit, as one that was not.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ...hooks.api import loading, taps
from ..compat import config_value
from .checks import STATE_DIR, check_options, check_out, run_options
from .data import Data, prepare, read_sources
from .spec import Batch, FamilyTrainer, TrainOptions, TrainTarget

MIN_LR_RATIO = 0.1  # the cosine ends at this fraction of --lr
FEATURE_CACHE_BYTES = 1 << 30  # the target's features of all training sequences are kept when they fit
FEATURE_CHUNK = 32  # sequences per target forward when filling that cache
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def load_target(spec: str) -> TrainTarget:
    from mlx_lm import load as mlx_load

    path = loading.resolve_path(spec, "target")
    config = loading.read_config(path, "target")
    loading.check_safetensors(path, "target")
    model, tokenizer = mlx_load(str(path))
    model.eval()
    weights = [v for k, v in tree_flatten(model.parameters()) if k.endswith(("weight", "scales"))]
    dtype = next((w.dtype for w in weights if mx.issubdtype(w.dtype, mx.floating)), mx.float32)
    return TrainTarget(model, tokenizer, path, config, len(taps.decoder_layers(model)), dtype)


def schedule(o: TrainOptions) -> Callable[[mx.array], mx.array]:
    warmup = warmup_steps(o)
    cosine = optim.cosine_decay(o.lr, max(1, o.steps - warmup), o.lr * MIN_LR_RATIO)
    if not warmup:
        return cosine
    return optim.join_schedules([optim.linear_schedule(o.lr / warmup, o.lr, warmup), cosine], [warmup])


def warmup_steps(o: TrainOptions) -> int:
    return o.warmup if o.warmup is not None else o.steps // 20


def batch_rows(step: int, n: int, size: int, seed: int) -> np.ndarray:
    """Rows of step ``step``: epochs over a fresh permutation each, from (seed, epoch) alone."""
    rows = []
    for s in range(step * size, (step + 1) * size):
        epoch, i = divmod(s, n)
        rows.append(np.random.default_rng([seed, 11, epoch]).permutation(n)[i])
    return np.array(rows)


def make_batch(trainer: FamilyTrainer, target: TrainTarget, tokens: np.ndarray, first: int) -> Batch:
    """The target's ordinary forward over the sequences, with the family's layers tapped."""
    batch = Batch(mx.array(tokens, dtype=mx.uint32), first)
    layers = trainer.capture_layers()
    if not layers and not trainer.needs_logits:
        return batch
    with taps.record(layers) as rec:
        logits = target.model(batch.tokens)  # [b, L, V]; left unevaluated unless the family reads it
    if layers:
        batch.features = trainer.features(target, {i: mx.concatenate(rec[i], axis=1) for i in layers})
    if trainer.needs_logits:
        batch.logits = logits
    mx.eval(*(x for x in (batch.features, batch.logits) if x is not None))
    return batch


def cached_targets(trainer: FamilyTrainer, target: TrainTarget, data: Data, o: TrainOptions) -> Optional[Batch]:
    """The target's features (and logits) of every training sequence, computed once, when they fit
    in FEATURE_CACHE_BYTES; else None (each step runs the target's forward on its own batch)."""
    if not trainer.capture_layers() and not trainer.needs_logits:
        return None
    probe = make_batch(trainer, target, data.train[:1], data.first)
    per_row = sum(x.nbytes for x in (probe.features, probe.logits) if x is not None)
    if per_row * len(data.train) > FEATURE_CACHE_BYTES:
        return None
    # A fixed chunk, not an option: a resumed run must compute the same features, bit for bit.
    parts = [make_batch(trainer, target, data.train[lo:lo + FEATURE_CHUNK], data.first)
             for lo in range(0, len(data.train), FEATURE_CHUNK)]
    join = lambda xs: mx.concatenate(xs, axis=0) if xs[0] is not None else None  # noqa: E731
    return Batch(mx.array(data.train, dtype=mx.uint32), data.first,
                 join([b.features for b in parts]), join([b.logits for b in parts]))


def evaluate(trainer: FamilyTrainer, model: nn.Module, target: TrainTarget, data: Data, o: TrainOptions) -> Dict[str, Any]:
    """Offline greedy tau on the held-out sequences (the target's greedy continuations).

    At each anchor p after the prompt, a round with the pending token at p accepts the length of the
    prefix of the drafter's block that matches the target's tokens p+1 .. p+B-1. ``tau`` follows the
    rounds greedy decoding makes (the first at the first generated token, each next one after the
    last accepted token): 1 + accepted / rounds, the mean acceptance length decoding measures at this
    fixed block size. ``tau_all_anchors`` averages over every anchor instead (higher: runs of easy
    tokens count once per position).
    """
    B = trainer.block_size
    L = data.heldout.shape[1]
    anchors = np.arange(data.first, L - B + 1)
    rows: List[np.ndarray] = []  # [b, len(anchors)] accepted per anchor
    losses: List[float] = []
    vocab = int(config_value(target.config, "vocab_size") or 1)
    for lo in range(0, len(data.heldout), o.batch_size):
        tokens = data.heldout[lo:lo + o.batch_size]
        batch = make_batch(trainer, target, tokens, data.first)
        step = trainer.anchors_per_forward(len(tokens), vocab)
        parts = []
        for a in range(0, len(anchors), step):
            parts.append(accepted_at(trainer, model, batch, tokens, anchors[a:a + step]))  # [b, n]
            losses.append(trainer.loss(model, batch).item())
        rows.append(np.concatenate(parts, axis=1))
    acc = np.concatenate(rows, axis=0)  # [H, len(anchors)]
    start = int(data.info.get("prompt_tokens", data.first + 1))  # the first generated token is pending
    walks = [greedy_rounds(row, data.first, start, L - B) for row in acc]
    rounds, accepted = sum(r for r, _ in walks), sum(n for _, n in walks)
    return {"tau": 1.0 + accepted / max(rounds, 1), "acceptance_rate": accepted / max(rounds * (B - 1), 1),
            "rounds": rounds, "tau_all_anchors": 1.0 + float(acc.mean()), "anchors": int(acc.size),
            "block_size": B, "loss": float(np.mean(losses))}


def accepted_at(trainer: FamilyTrainer, model: nn.Module, batch: Batch, tokens: np.ndarray,
                anchors: np.ndarray) -> np.ndarray:
    """[b, n]: per anchor p (set on ``batch``), the length of the prefix of the drafter's block that
    matches ``tokens``' p+1 .. p+B-1."""
    batch.anchors = np.broadcast_to(anchors, (len(tokens), len(anchors)))
    drafts = trainer.draft(model, batch)  # [b, n, B-1]
    labels = tokens[:, anchors[:, None] + np.arange(1, trainer.block_size)]  # [b, n, B-1]
    return np.cumprod(np.array(drafts) == labels, axis=-1).sum(-1)


def greedy_rounds(accepted: np.ndarray, first: int, start: int, end: int) -> Tuple[int, int]:
    """(rounds, accepted tokens) greedy decoding makes over one sequence, ``accepted[p - first]`` being what a
    round with the pending token at p accepts: the first round at ``start``, each next one after the last
    accepted token, while p <= ``end``."""
    rounds = total = 0
    p = start
    while p <= end:
        a = int(accepted[p - first])
        rounds, total, p = rounds + 1, total + a, p + a + 1
    return rounds, total


def _replace_file(src: Path, dst: Path) -> None:
    src.replace(dst)  # atomic on one file system: a reader sees the old file or the new one


def save(trainer: FamilyTrainer, model: nn.Module, opt: optim.Optimizer, target: TrainTarget, out: Path,
         step: int, resolved: Dict[str, Any], dtype: mx.Dtype, complete: bool, log: Callable[[str], None]) -> None:
    """The real-format checkpoint in ``out``, then the resumable state in ``out/training``."""
    tmp = out / ".checkpoint.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    names = trainer.save(model, tmp, target, dtype)
    for name in names:
        _replace_file(tmp / name, out / name)
    shutil.rmtree(tmp, ignore_errors=True)
    state_dir = out / STATE_DIR
    step_dir = state_dir / f"step-{step:07d}"
    shutil.rmtree(step_dir, ignore_errors=True)
    step_dir.mkdir(parents=True)
    mx.save_safetensors(str(step_dir / "weights.safetensors"), dict(tree_flatten(model.parameters())))
    mx.save_safetensors(str(step_dir / "optimizer.safetensors"), dict(tree_flatten(opt.state)))
    state = {"step": step, "complete": complete, "dir": step_dir.name, "options": resolved}
    (state_dir / "state.json.tmp").write_text(json.dumps(state, indent=1))
    _replace_file(state_dir / "state.json.tmp", state_dir / "state.json")
    for old in state_dir.glob("step-*"):
        if old != step_dir:
            shutil.rmtree(old, ignore_errors=True)
    log(f"checkpoint: step {step} -> {out} ({', '.join(names)})")


def _resolve(o: TrainOptions) -> Dict[str, Any]:
    """Run-defining options with paths made absolute (a resumed run may be started from elsewhere)."""
    resolved = run_options(o)
    absolute = lambda ps: [str(Path(p).expanduser().resolve()) for p in ps]  # noqa: E731
    resolved["data"], resolved["heldout"] = absolute(o.data), absolute(o.heldout)
    target = Path(o.target).expanduser()
    resolved["target"] = str(target.resolve()) if target.exists() else o.target
    if o.init is not None and Path(o.init).expanduser().exists():
        resolved["init"] = str(Path(o.init).expanduser().resolve())
    return resolved


def train(
    options: TrainOptions, *, log: Callable[[str], None] = print,
    on_step: Optional[Callable[[int, float], None]] = None,
    prompts: Optional[List[List[int]]] = None, heldout_prompts: Optional[List[List[int]]] = None,
) -> Dict[str, Any]:
    """Train (or resume) a drafter; returns {"step", "losses" (this process's, by step), "eval", "out", ...}.

    ``prompts`` / ``heldout_prompts``: token lists to use instead of windows of ``options.data``
    (tests and scripts). ``on_step(step, loss)`` runs after each completed step.
    """
    began = time.perf_counter()  # --max-time counts from here: loading and making the data included
    o = options
    cls = check_options(o, prompts is not None)
    resolved = _resolve(o)
    out = Path(o.out).expanduser()
    state = check_out(o, resolved)
    if state is not None and state.get("complete"):
        log(f"{out}: the run is complete (step {state['step']} of {o.steps}); nothing to resume")
        return {"step": state["step"], "losses": [], "eval": None, "out": str(out), "complete": True}
    # What depends on the arguments and the file system alone fails before anything loads.
    sources = read_sources(o, prompts is not None, heldout_prompts is not None)
    loading.read_config(loading.resolve_path(o.target, "target"), "target")
    if o.init is not None:
        loading.read_config(loading.resolve_path(o.init, "--init drafter"), "--init drafter")
    target = load_target(o.target)
    trainer = cls(o)
    mx.random.seed(o.seed)
    model = trainer.build(target)  # before the data: a drafter that cannot fit the target fails early
    data = prepare(target, o, out / STATE_DIR / "data.safetensors", log, sources, prompts, heldout_prompts)
    trainer.data_ready(data.train, data.first)
    taps.install_taps(target.model, trainer.capture_layers())
    opt = optim.AdamW(learning_rate=schedule(o), weight_decay=o.weight_decay)
    start = 0
    if state is not None:
        step_dir = out / STATE_DIR / state["dir"]
        model.load_weights(list(mx.load(str(step_dir / "weights.safetensors")).items()))
        opt.state = tree_unflatten(list(mx.load(str(step_dir / "optimizer.safetensors")).items()))
        start = int(state["step"])
        log(f"resume: step {start} of {o.steps} from {step_dir}")
        with (out / STATE_DIR / "log.jsonl").open("a") as journal:
            journal.write(json.dumps({"event": "resume", "step": start}) + "\n")  # later lines replace those past it
    mx.eval(model.parameters())
    dtype = DTYPES[o.dtype] if o.dtype else target.dtype
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    log(f"train: {trainer.describe()}, {n_params / 1e6:.2f}M parameters; {o.steps} steps of {o.batch_size} x "
        f"{o.seq_len} tokens, lr {o.lr:g} (warmup {warmup_steps(o)}, cosine)")
    return _loop(trainer, model, opt, target, data, o, resolved, out, start, dtype, log, on_step, began)


def _loop(trainer: FamilyTrainer, model: nn.Module, opt: optim.Optimizer, target: TrainTarget, data: Data,
          o: TrainOptions, resolved: Dict[str, Any], out: Path, start: int, dtype: mx.Dtype,
          log: Callable[[str], None], on_step: Optional[Callable[[int, float], None]], began: float) -> Dict[str, Any]:
    loss_and_grad = nn.value_and_grad(model, trainer.loss)
    journal = (out / STATE_DIR / "log.jsonl").open("a")

    def record(event: Dict[str, Any]) -> None:
        journal.write(json.dumps(event) + "\n")
        journal.flush()

    losses: List[float] = []
    last_eval: Optional[Dict[str, Any]] = None
    step, saved = start, start
    window_start = time.perf_counter()
    window_steps = 0
    L = data.train.shape[1]
    cache = cached_targets(trainer, target, data, o)
    try:
        while step < o.steps:
            rows = batch_rows(step, len(data.train), o.batch_size, o.seed)
            if cache is None:
                batch = make_batch(trainer, target, data.train[rows], data.first)
            else:
                idx = mx.array(rows)
                batch = Batch(cache.tokens[idx], data.first, *(None if x is None else x[idx] for x in (cache.features, cache.logits)))
            batch.anchors = trainer.sample_anchors(np.random.default_rng([o.seed, 13, step]), L, data.first, len(rows))
            loss, grads = loss_and_grad(model, batch)
            norm = None
            if o.grad_clip > 0:
                grads, norm = optim.clip_grad_norm(grads, o.grad_clip)
            opt.update(model, grads)
            mx.eval(model.parameters(), opt.state, loss, *([norm] if norm is not None else []))
            step += 1
            window_steps += 1
            losses.append(loss.item())
            if step % o.log_every == 0 or step == o.steps:
                now = time.perf_counter()
                rate = window_steps / max(now - window_start, 1e-9)
                eta = (o.steps - step) / rate
                lr = float(opt.state["learning_rate"])
                log(f"step {step}/{o.steps}  loss {losses[-1]:.4f}  lr {lr:.2e}"
                    + (f"  |grad| {float(norm):.2f}" if norm is not None else "")
                    + f"  {rate:.2f} steps/s  {rate * o.batch_size * L:.0f} tok/s  eta {eta:.0f}s")
                record({"event": "step", "step": step, "loss": losses[-1], "lr": lr, "steps_per_s": rate,
                        "tokens_per_s": rate * o.batch_size * L})
                window_start, window_steps = now, 0
            paused = time.perf_counter()  # evaluation and checkpoints stay out of the throughput
            if len(data.heldout) and ((o.eval_every and step % o.eval_every == 0) or step == o.steps):
                last_eval = evaluate(trainer, model, target, data, o)
                ev = last_eval
                log(f"eval step {step}: held-out tau {ev['tau']:.3f} at block {ev['block_size']} (offline greedy, "
                    f"{ev['rounds']} rounds; acceptance rate {ev['acceptance_rate']:.1%}; over all "
                    f"{ev['anchors']} anchors {ev['tau_all_anchors']:.3f}), loss {ev['loss']:.4f}")
                record({"event": "eval", "step": step, **last_eval})
            if (o.checkpoint_every and step % o.checkpoint_every == 0) or step == o.steps:
                save(trainer, model, opt, target, out, step, resolved, dtype, step == o.steps, log)
                saved = step
            window_start += time.perf_counter() - paused
            if on_step is not None:
                on_step(step, losses[-1])
            if o.max_time is not None and time.perf_counter() - began >= o.max_time and step < o.steps:
                if saved != step:
                    save(trainer, model, opt, target, out, step, resolved, dtype, False, log)
                log(f"stopped at step {step} of {o.steps} (--max-time {o.max_time:g} s); run again with --resume")
                break
    except KeyboardInterrupt:
        if step > saved:
            save(trainer, model, opt, target, out, step, resolved, dtype, False, log)
        log(f"interrupted at step {step} of {o.steps}; run again with --resume to continue")
        raise
    finally:
        journal.close()
    return {"step": step, "losses": losses, "eval": last_eval, "out": str(out), "complete": step == o.steps,
            "first_step": start}
