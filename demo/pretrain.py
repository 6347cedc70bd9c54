"""The demo target: a byte-level BPE tokenizer (``tokenizers``) and a small mlx-lm llama trained from
scratch on the corpus (next-token cross-entropy, AdamW, warmup + cosine), resumable bit for bit.

Exact resume: step k's batch derives from (seed, k) alone, and a checkpoint holds the float32 weights,
the optimiser state and the step, so an interrupted run resumed ends with the same weights as one that
was not (tests/test_demo_build.py).
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

SPECIAL = ["<s>", "</s>", "<unk>"]
# A base model: a chat request's messages are joined as they are (the server and chat clients still work).
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


@dataclass
class TargetOptions:
    vocab_size: int = 2048
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 512
    seq_len: int = 256
    batch_size: int = 64
    steps: int = 1400  # 9 epochs: the best validation bits per byte of the 4 x 256 sweep (longer memorises)
    lr: float = 2e-3
    warmup: int = 200
    weight_decay: float = 0.1
    seed: int = 0
    checkpoint_every: int = 500


def train_tokenizer(texts: List[str], vocab_size: int, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": False, "clean_up_tokenization_spaces": False, "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE}, indent=1))
    (out / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))


def encode(tokenizer_dir: Path, texts: List[str]) -> np.ndarray:
    """One stream: each file's tokens followed by </s>."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eos = tok.token_to_id("</s>")
    ids: List[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos)
    return np.array(ids, dtype=np.int32)


def config(o: TargetOptions) -> Dict[str, Any]:
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": o.vocab_size,
            "hidden_size": o.hidden_size, "num_hidden_layers": o.num_hidden_layers,
            "num_attention_heads": o.num_attention_heads, "num_key_value_heads": o.num_key_value_heads,
            "head_dim": o.hidden_size // o.num_attention_heads, "intermediate_size": o.intermediate_size,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 4096,
            "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16"}


def _model(o: TargetOptions) -> nn.Module:
    from mlx_lm.models import llama

    return llama.Model(llama.ModelArgs.from_dict(config(o)))


def _schedule(o: TargetOptions) -> Callable[[mx.array], mx.array]:
    cosine = optim.cosine_decay(o.lr, max(1, o.steps - o.warmup), o.lr * 0.1)
    if not o.warmup:
        return cosine
    return optim.join_schedules([optim.linear_schedule(o.lr / o.warmup, o.lr, o.warmup), cosine], [o.warmup])


def _batch(stream: np.ndarray, o: TargetOptions, step: int) -> np.ndarray:
    starts = np.random.default_rng([o.seed, 3, step]).integers(0, len(stream) - o.seq_len - 1, o.batch_size)
    return np.stack([stream[s:s + o.seq_len + 1] for s in starts])  # [b, L+1]


def _loss(model: nn.Module, tokens: mx.array) -> mx.array:
    logits = model(tokens[:, :-1])  # [b, L, V]
    return nn.losses.cross_entropy(logits.astype(mx.float32), tokens[:, 1:], reduction="mean")


def bits_per_byte(model: nn.Module, stream: np.ndarray, n_bytes: int, seq_len: int, batch: int = 16) -> float:
    """Held-out bits per byte: the summed next-token loss over ``stream`` (non-overlapping windows; each
    window's first token is not scored) divided by ln 2 and the text's bytes, scaled to the whole stream."""
    n = (len(stream) - 1) // seq_len
    total, scored = 0.0, 0
    for lo in range(0, n, batch):
        rows = np.stack([stream[i * seq_len:(i + 1) * seq_len + 1] for i in range(lo, min(n, lo + batch))])
        t = mx.array(rows)
        losses = nn.losses.cross_entropy(model(t[:, :-1]).astype(mx.float32), t[:, 1:], reduction="sum")
        total += float(losses)
        scored += rows.shape[0] * seq_len
    return total / math.log(2) / (n_bytes * scored / max(len(stream) - 1, 1))


def train(o: TargetOptions, stream: np.ndarray, work: Path, deadline: Optional[float] = None,
          until: Optional[int] = None, log: Callable[[str], None] = print) -> Optional[nn.Module]:
    """Train (or resume) the target in ``work``; returns the model when all ``o.steps`` are done, else
    None (stopped at ``deadline`` (perf_counter) or after step ``until``, with a checkpoint)."""
    state_file = work / "state.json"
    mx.random.seed(o.seed)
    model = _model(o)
    model.set_dtype(mx.float32)
    opt = optim.AdamW(learning_rate=_schedule(o), weight_decay=o.weight_decay)
    step = 0
    if state_file.exists():
        state = json.loads(state_file.read_text())
        if state["options"] != asdict(o):
            raise SystemExit(f"{work}: a target run with other options is there ({state['options']}); remove it to start over")
        model.load_weights(list(mx.load(str(work / "weights.safetensors")).items()))
        opt.state = tree_unflatten(list(mx.load(str(work / "optimizer.safetensors")).items()))
        step = int(state["step"])
        log(f"target: resume at step {step} of {o.steps}")
    opt.init(model.trainable_parameters())  # the whole state tree before compiling (a resumed one is kept)
    mx.eval(model.parameters(), opt.state)
    params = sum(v.size for _, v in tree_flatten(model.parameters()))
    log(f"target: llama {o.num_hidden_layers} x {o.hidden_size}, {params / 1e6:.2f}M parameters, {len(stream):,} "
        f"training tokens; {o.steps} steps of {o.batch_size} x {o.seq_len}")
    loss_and_grad = nn.value_and_grad(model, _loss)
    state = [model.state, opt.state]

    def update(tokens: mx.array) -> mx.array:
        loss, grads = loss_and_grad(model, tokens)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(model, grads)
        return loss

    compiled = mx.compile(update, inputs=state, outputs=state)  # the model and optimiser state update in place

    def save() -> None:
        work.mkdir(parents=True, exist_ok=True)
        mx.save_safetensors(str(work / "weights.safetensors"), dict(tree_flatten(model.parameters())))
        mx.save_safetensors(str(work / "optimizer.safetensors"), dict(tree_flatten(opt.state)))
        (work / "state.json.tmp").write_text(json.dumps({"step": step, "options": asdict(o)}))
        (work / "state.json.tmp").replace(state_file)

    t0, shown, losses = time.perf_counter(), time.perf_counter(), []
    start = step
    while step < o.steps:
        loss = compiled(mx.array(_batch(stream, o, step)))
        mx.eval(state)
        step += 1
        losses.append(loss.item())
        now = time.perf_counter()
        if now - shown > 15 or step == o.steps:
            rate = (step - start) / (now - t0)
            log(f"target step {step}/{o.steps}  loss {np.mean(losses[-50:]):.3f}  {rate:.1f} steps/s  "
                f"{rate * o.batch_size * o.seq_len:,.0f} tok/s")
            shown = now
        if step % o.checkpoint_every == 0 or step == o.steps:
            save()
        if step < o.steps and ((until is not None and step >= until) or (deadline is not None and now >= deadline)):
            save()
            log(f"target: stopped at step {step} of {o.steps}; run again to resume")
            return None
    return model


def save_checkpoint(model: nn.Module, o: TargetOptions, tokenizer_dir: Path, out: Path) -> None:
    """The target as an mlx-lm checkpoint: config.json, bfloat16 model.safetensors, the tokenizer."""
    out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.astype(mx.bfloat16) for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config(o), indent=1))
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, out / f.name)
