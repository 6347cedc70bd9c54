"""Training data: text files -> the target's tokens -> prompts -> the target's own continuations.

Each sequence is a prompt of ``prompt_tokens`` tokens cut from the text, continued by the target
to ``seq_len`` tokens (greedy, or sampled at ``temperature``): the drafter learns what the target
itself writes, which is what a round verifies. The sequences are made once and kept next to the
training state, so a resumed run trains on the same ones.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from .spec import TrainOptions, TrainTarget

PIECE_CHARS = 4000


def collect_files(paths: Sequence[str], pattern: str, option: str) -> List[Path]:
    """Files named directly, plus the files under named directories matching ``pattern``."""
    files: List[Path] = []
    for spec in paths:
        path = Path(spec).expanduser()
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            found = sorted(p for p in path.rglob(pattern) if p.is_file())
            if not found:
                raise ValueError(f"{option}: directory {spec!r} has no files matching --glob {pattern!r}")
            files.extend(found)
        else:
            raise ValueError(f"{option}: {spec!r} does not exist; expected text files or directories of them")
    return files


def digest_files(files: Sequence[Path]) -> List[Tuple[str, str]]:
    return [(str(f.resolve()), hashlib.sha256(f.read_bytes()).hexdigest()[:16]) for f in files]


def read_texts(files: Sequence[Path], option: str) -> List[str]:
    texts = []
    for f in files:
        try:
            texts.append(f.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise ValueError(f"{option}: {str(f)!r} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    return texts


def _pieces(text: str, size: int = PIECE_CHARS) -> List[str]:
    """``text`` cut after newlines into pieces of about ``size`` characters: tokenizers warn about
    (and some models cap) one encode longer than the model's context."""
    pieces, start = [], 0
    while start < len(text):
        end = text.find("\n", start + size)
        end = len(text) if end < 0 else end + 1
        pieces.append(text[start:end])
        start = end
    return pieces


def prompt_windows(tokenizer: Any, texts: Sequence[str], prompt_tokens: int) -> List[List[int]]:
    """Non-overlapping windows of ``prompt_tokens`` tokens, per text; the BOS first where the
    tokenizer adds one (as mlx-lm's generate encodes a prompt)."""
    probe = list(tokenizer.encode("a"))
    bos = getattr(tokenizer, "bos_token_id", None)
    lead = [bos] if bos is not None and probe and probe[0] == bos else []
    width = prompt_tokens - len(lead)
    windows = []
    for text in texts:
        ids = [i for piece in _pieces(text) for i in tokenizer.encode(piece, add_special_tokens=False)]
        windows.extend(lead + ids[i:i + width] for i in range(0, len(ids) - width + 1, width))
    return windows


def continue_prompts(
    model: Any, prompts: np.ndarray, length: int, temperature: float, seed: int, batch: int,
    log: Callable[[str], None],
) -> np.ndarray:
    """[N, length] tokens: ``prompts`` ([N, P]) continued by the target, ``batch`` rows at a time."""
    from mlx_lm.models.cache import make_prompt_cache

    n, p = prompts.shape
    out = np.zeros((n, length), dtype=np.int32)
    out[:, :p] = prompts
    keys = mx.random.split(mx.random.key(seed), max(1, -(-n // batch)))
    start, shown = time.perf_counter(), 0.0
    for b, lo in enumerate(range(0, n, batch)):
        rows = mx.array(prompts[lo:lo + batch], dtype=mx.uint32)  # [b, P]
        cache = make_prompt_cache(model)
        logits = model(rows, cache=cache)[:, -1, :]  # [b, V]
        key = keys[b]
        new = []
        for _ in range(length - p):
            if temperature > 0:
                key, sub = mx.random.split(key)
                nxt = mx.random.categorical(logits.astype(mx.float32) / temperature, key=sub)
            else:
                nxt = mx.argmax(logits, axis=-1)
            nxt = nxt.astype(mx.uint32)[:, None]  # [b, 1]
            new.append(nxt)
            logits = model(nxt, cache=cache)[:, -1, :]
        block = mx.concatenate(new, axis=1)  # [b, length - P]
        out[lo:lo + len(block), p:] = np.array(block)
        elapsed = time.perf_counter() - start
        if elapsed - shown > 10 or lo + batch >= n:
            shown = elapsed
            done = min(n, lo + batch)
            log(f"data: continued {done}/{n} prompts ({done * (length - p) / max(elapsed, 1e-9):.0f} tok/s)")
    return out


@dataclass
class Data:
    train: np.ndarray  # [N, L] int32
    heldout: np.ndarray  # [H, L] int32 (H may be 0)
    first: int  # the first anchor: the prompts' last position (at least 1)
    info: Dict[str, Any]


def _pick(windows: List[List[int]], count: int, rng: np.random.Generator, width: int) -> Tuple[np.ndarray, List[List[int]]]:
    order = rng.permutation(len(windows))
    chosen = [windows[i] for i in order[:count]]
    rest = [windows[i] for i in order[count:]]
    if any(len(w) != width for w in chosen):
        raise ValueError(f"prompts must all have {width} tokens; got lengths {sorted({len(w) for w in chosen})}")
    return np.array(chosen, dtype=np.int32).reshape(len(chosen), width), rest


@dataclass
class Sources:
    """The run's text, read before anything loads (so that bad paths fail first)."""

    files: List[Path]
    texts: List[str]
    held_files: List[Path]
    held_texts: List[str]


def read_sources(o: TrainOptions, prompts: bool, heldout_prompts: bool) -> Sources:
    files = collect_files(o.data, o.glob, "--data") if not prompts else []
    held_files = collect_files(o.heldout, o.glob, "--heldout") if not heldout_prompts else []
    return Sources(files, read_texts(files, "--data"), held_files, read_texts(held_files, "--heldout"))


def prepare(
    target: TrainTarget, options: TrainOptions, cache_file: Path, log: Callable[[str], None], sources: Sources,
    prompts: Optional[List[List[int]]] = None, heldout_prompts: Optional[List[List[int]]] = None,
) -> Data:
    """The run's sequences, from ``cache_file`` when it holds the same run's, else generated (and saved)."""
    o = options
    files, held_files = sources.files, sources.held_files
    digests = digest_files(files)
    wanted = o.sequences or o.steps * o.batch_size  # the sequences asked for
    fingerprint = json.dumps({
        "target": str(target.path.resolve()), "data": digests, "heldout": digest_files(held_files),
        "prompts": hashlib.sha256(json.dumps([prompts, heldout_prompts]).encode()).hexdigest()[:16],
        **{k: getattr(o, k) for k in ("prompt_tokens", "seq_len", "temperature", "seed", "heldout_sequences")},
        # the sequences asked for, not the steps: runs of other lengths (or families) over the same data share it
        "sequences": wanted,
    }, sort_keys=True)
    if cache_file.is_file():
        arrays, meta = mx.load(str(cache_file), return_metadata=True)
        if meta.get("fingerprint") == fingerprint:
            info = json.loads(meta["info"])
            held = np.array(arrays["heldout"]) if "heldout" in arrays else np.zeros((0, o.seq_len), np.int32)
            return Data(np.array(arrays["train"]), held, info["first"], info)

    rng = np.random.default_rng([o.seed, 7])
    if prompts is None:
        windows = prompt_windows(target.tokenizer, sources.texts, o.prompt_tokens)
        if not windows:
            raise ValueError(f"--data: the text gives no prompt of --prompt-tokens {o.prompt_tokens} tokens")
    else:
        windows = [list(w) for w in prompts]
        if not windows:
            raise ValueError("prompts: none given; expected token lists")
    p = len(windows[0])
    if heldout_prompts is not None:
        held, _ = _pick([list(w) for w in heldout_prompts], o.heldout_sequences, rng, p)
    elif held_files:
        held_windows = prompt_windows(target.tokenizer, sources.held_texts, o.prompt_tokens)
        held, _ = _pick(held_windows, o.heldout_sequences, rng, p)
    else:
        # No held-out text: hold out up to a tenth of the prompts (none from a handful).
        held, windows = _pick(windows, min(o.heldout_sequences, len(windows) // 10), rng, p)
    count = min(len(windows), wanted)
    train, _ = _pick(windows, count, rng, p)
    source = "given prompts" if prompts is not None else f"{len(files)} file(s)"
    log(f"data: {len(train)} training and {len(held)} held-out prompts of {p} tokens from {source}; "
        f"continuing them to {o.seq_len} tokens with the target "
        f"({'greedy' if o.temperature == 0 else f'sampled at temperature {o.temperature}'})")
    start = time.perf_counter()
    seqs = continue_prompts(target.model, train, o.seq_len, o.temperature, o.seed, o.gen_batch, log)
    # Held out: always the greedy continuation, which the offline tau compares drafts with.
    held_seqs = (continue_prompts(target.model, held, o.seq_len, 0.0, o.seed, o.gen_batch, log) if len(held)
                 else np.zeros((0, o.seq_len), np.int32))
    # Anchors start at the prompt's last token (never 0: a round always has some context).
    info = {"first": max(p - 1, 1), "prompt_tokens": p, "train": len(train), "heldout": len(held),
            "files": [f for f, _ in digests], "seconds": round(time.perf_counter() - start, 2)}
    data = Data(seqs, held_seqs, info["first"], info)
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache_file.with_suffix(".tmp.safetensors")
    arrays = {"train": mx.array(data.train)}
    if len(held_seqs):
        arrays["heldout"] = mx.array(held_seqs)
    mx.save_safetensors(str(tmp), arrays, metadata={"fingerprint": fingerprint, "info": json.dumps(info)})
    tmp.replace(cache_file)
    return data
