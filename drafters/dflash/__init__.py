"""``dflash``: z-lab DFlash drafters (block diffusion over the target's hidden states).

One drafter forward proposes a whole block. The drafter reads the outputs of the target layers
named by ``target_layer_ids`` (captured by the host from the target's ordinary forward, through
prefill and each verify), keeps their context K/V in its own cache (committed or rolled back with
the round), and borrows the target's embedding and lm_head.

Config layouts read: z-lab flat (Qwen3 b16: top-level ``block_size``), z-lab nested
(Qwen3.5-4B-DFlash: ``dflash_config.block_size``), speculators (``speculators_model_type: dflash``)
and the flat Muse-Glimmer assistant. DFlash2 checkpoints are recognised and refused by name.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from ...plugin.types import Proposal
from ..base import Compatibility, DraftSession, Drafter, DrafterError, DrafterFamily, DraftTarget
from ..compat import check_tokenizer, config_value
from .model import MUSE_ASSISTANT, UNSUPPORTED_ARCHITECTURES, Model, ModelArgs, config_layout

KIND = "dflash"


class DFlashSession(DraftSession):
    """One request: the drafter's context cache and what the last proposal consumed."""

    def __init__(self, drafter: "DFlashDrafter"):
        self.drafter = drafter
        if drafter.cache_bucket:
            from ...plugin.padded_cache import PaddedKVCache

            self.cache = drafter.model.make_cache(lambda: PaddedKVCache(drafter.cache_bucket))
        else:
            self.cache = drafter.model.make_cache()
        self._consumed = 0  # positions of state.captures read by the last propose

    def caches(self) -> List[Any]:
        return self.cache

    @property
    def context_length(self) -> int:
        return self.cache[0].offset if self.cache else 0

    def _new_hidden(self, state: Any) -> mx.array:
        layers = self.drafter.capture_layers()
        missing = [i for i in layers if i not in state.captures]
        if missing:
            raise RuntimeError(f"the target's forward did not capture layers {missing} (asked for {layers})")
        parts = [state.captures[i] for i in layers]  # each [1, n, H]
        last = self.drafter.final_norm
        if last is not None:
            # HF's hidden_states[N] (the id of the last layer) is taken after the final norm.
            parts = [last[1](h) if i == last[0] else h for i, h in zip(layers, parts)]
        return mx.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]  # [1, n, taps*H]

    def propose(self, state: Any, max_drafts: int) -> Proposal:
        d = self.drafter
        hidden = self._new_hidden(state)
        n = hidden.shape[1]
        start = len(state.tokens) - 1  # position of the pending token
        if self.context_length + n != start:
            raise RuntimeError(
                f"context out of step: {self.context_length} positions in the drafter's cache plus {n} "
                f"new captured positions, but the target has consumed {start}"
            )
        B = max_drafts + 1
        # Padded caches (CUDA): the block too is padded to a power of two, so that adaptive sizes
        # meet few attention shapes; the padding slots are masked out as keys.
        width = 1 << (B - 1).bit_length() if d.cache_bucket else B
        block = mx.array([[state.pending] + [d.mask_token_id] * (width - 1)], dtype=mx.uint32)  # [1, width]
        if d.cache_bucket and n > 1:
            # The context too: a catch-up after plain steps feeds any number of positions, and each
            # new count would build new kernels; the padding rows are trimmed off the cache.
            n_pad = 1 << (n - 1).bit_length()
            if n_pad > n:
                hidden = mx.concatenate([hidden, mx.zeros((1, n_pad - n, hidden.shape[2]), hidden.dtype)], axis=1)
        h = d.model(d.embed(block), hidden, self.cache, width=B, context_len=n)  # [1, width, H]
        logits = d.head(h[:, 1:B]).astype(mx.float32)[0]  # [k, V]
        self._consumed = n
        if state.sampling.greedy:
            # Greedy rounds compare tokens only: no q to hand back.
            tokens, logprobs = mx.argmax(logits, axis=-1), None
        else:
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)  # [k, V]
            # Drafts must be drawn from the q handed back, or rejection sampling is not lossless;
            # q goes through the request's sampling filters as the target's p does.
            process = getattr(state.sampling, "process", None)
            if process is not None:
                logprobs = process(logprobs)
            else:
                scaled = logprobs / state.sampling.temperature
                logprobs = scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)
            next_key = getattr(state, "next_draft_key", None)
            tokens = mx.random.categorical(logprobs, axis=-1, key=next_key() if next_key else None)
        # Queued, not awaited: the round builds its verify forward while the GPU drafts.
        mx.async_eval(tokens, *([logprobs] if logprobs is not None else []), [c.state for c in self.cache])
        return Proposal(tokens, logprobs)  # tokens: [k] (lazy); q: [k, V] or None (greedy)

    def commit(self, state: Any, accepted: int, draft_tokens: int) -> int:
        # The context K/V written by propose are committed positions: all stay. The captured
        # hidden states they came from are dropped; what remains are this round's accepted + 1.
        n, self._consumed = self._consumed, 0
        for i in set(self.drafter.capture_layers()):
            state.captures[i] = state.captures[i][:, n:]
        return n


class DFlashDrafter(Drafter):
    kind = KIND
    family = "dflash"

    def __init__(self, model: Model, embed: Callable[[mx.array], mx.array], head: Callable[[mx.array], mx.array]):
        self.model = model
        self.args = model.args
        self.embed = embed
        self.head = head
        self.mask_token_id = int(self.args.mask_token_id)
        self.default_block_size = int(self.args.block_size)
        # Context K/V padded to buckets where attention compiles per key length (CUDA): the key
        # length grows every round, which would otherwise compile a kernel per round.
        self.cache_bucket: Optional[int] = None
        # (the target's last layer, its final norm) when a tap reads the last layer's output.
        self.final_norm: Optional[Tuple[int, Callable[[mx.array], mx.array]]] = None

    def capture_layers(self) -> List[int]:
        return list(self.args.capture_layers)

    def new_session(self, state: Any) -> DraftSession:
        return DFlashSession(self)


# -- detection and validation -----------------------------------------------------------------

def detect(config: Dict[str, Any]) -> bool:
    """DFlash from config.json alone: the architecture, a ``dflash_config``, or a flat drafter
    config that carries all three DFlash fields (block, mask token, target layers)."""
    archs = set(config.get("architectures") or [])
    if archs & {"DFlashDraftModel", *UNSUPPORTED_ARCHITECTURES, *MUSE_ASSISTANT}:
        return True
    if isinstance(config.get("dflash_config"), dict) or config_layout(config) == "speculators":
        return True
    has_ids = "target_layer_ids" in config or "aux_hidden_state_layer_ids" in config
    return has_ids and "mask_token_id" in config and "block_size" in config


def _field(layout: str, name: str) -> str:
    """Where ``name`` lives in this layout's config.json (for messages)."""
    if layout == "dflash_config" and name in ("target_layer_ids", "mask_token_id"):
        return f"dflash_config.{name}"
    if layout == "speculators":
        return {"target_layer_ids": "aux_hidden_state_layer_ids", "hidden_size": "transformer_layer_config.hidden_size",
                "vocab_size": "transformer_layer_config.vocab_size"}.get(name, name)
    return name


def _target_layers(target: DraftTarget) -> Optional[int]:
    if target.num_layers is not None:
        return int(target.num_layers)
    n = config_value(target.config, "num_hidden_layers")
    return int(n) if n is not None else None


def check(path: Optional[Path], config: Dict[str, Any], target: DraftTarget) -> Compatibility:
    verdict = Compatibility()
    archs = [a for a in config.get("architectures") or [] if a in UNSUPPORTED_ARCHITECTURES]
    if archs:
        verdict.fail(
            f"architectures: {archs[0]} (DFlash2: attention/mlp convolutions and a candidate selector) "
            "is not supported; supported: DFlashDraftModel and the flat DFlash layouts"
        )
        return verdict
    try:
        args = ModelArgs.from_dict(config)
    except (TypeError, ValueError) as e:
        verdict.fail(f"config.json: cannot read the DFlash drafter's fields: {e}")
        return verdict
    f = lambda name: _field(args.layout, name)  # noqa: E731
    verdict.notes.append(f"layout: {args.layout}; block_size {args.block_size}")

    n_layers = _target_layers(target)
    if not args.target_layer_ids:
        verdict.fail(f"{f('target_layer_ids')}: missing (and no num_target_layers to derive it from)")
    else:
        convention = "output of layer id" if args.layer_id_offset == 1 else "hidden_states[id], i.e. output of layer id-1"
        bad = [i for i, c in zip(args.target_layer_ids, args.capture_layers)
               if c < 0 or (n_layers is not None and c >= n_layers)]
        if bad:
            where = f"the target has {n_layers} decoder layers (0..{n_layers - 1})" if n_layers is not None else "layer ids must be >= 0"
            verdict.fail(f"{f('target_layer_ids')}: {args.target_layer_ids} names layer(s) {bad} ({convention}); {where}")
        else:
            verdict.notes.append(f"{f('target_layer_ids')}: {args.target_layer_ids} within the target's {n_layers} layers ({convention})")
    if args.num_target_layers is not None and n_layers is not None and args.num_target_layers != n_layers:
        verdict.notes.append(
            f"num_target_layers: the drafter was trained on a {args.num_target_layers}-layer target, this one has "
            f"{n_layers} (not refused by itself; expect low acceptance if this is not the model it was trained for)"
        )

    t_hidden = config_value(target.config, "hidden_size")
    if t_hidden is not None and args.hidden_size != t_hidden:
        verdict.fail(f"{f('hidden_size')}: the drafter has {args.hidden_size}, the target's hidden_size is {t_hidden}; "
                     "they must be equal (the drafter uses the target's embedding, lm_head and hidden states)")
    else:
        verdict.notes.append(f"{f('hidden_size')}: {args.hidden_size} on both")

    t_vocab = config_value(target.config, "vocab_size")
    if args.mask_token_id is None:
        verdict.fail(f"{f('mask_token_id')}: missing; a DFlash drafter needs the id of its mask token")
    elif t_vocab is not None and not 0 <= args.mask_token_id < t_vocab:
        verdict.fail(f"{f('mask_token_id')}: {args.mask_token_id} is outside the target's vocabulary "
                     f"(vocab_size {t_vocab}: ids 0..{t_vocab - 1})")
    else:
        verdict.notes.append(f"{f('mask_token_id')}: {args.mask_token_id} within the target's vocab_size {t_vocab}")
    if args.vocab_size is not None and t_vocab is not None and args.vocab_size != t_vocab:
        verdict.fail(f"{f('vocab_size')}: the drafter has {args.vocab_size}, the target has {t_vocab}; they must be equal")
    draft_vocab = config.get("draft_vocab_size")
    if draft_vocab is not None and t_vocab is not None and draft_vocab != t_vocab:
        verdict.fail(f"draft_vocab_size: {draft_vocab} (a reduced draft vocabulary with d2t/t2d) is not supported; "
                     f"the target's vocab_size is {t_vocab}")
    if not 2 <= args.block_size <= 128:
        verdict.fail(f"block_size: {args.block_size}; allowed: 2 to 128")
    check_tokenizer(target.path, path, verdict)
    return verdict


# -- loading ----------------------------------------------------------------------------------

def target_embedding_and_head(model: nn.Module) -> Tuple[nn.Module, Callable[[mx.array], mx.array]]:
    """The loaded mlx-lm target's token embedding and output head (tied or not)."""
    owners = [getattr(model, "language_model", None), model]
    for owner in owners:
        if owner is None:
            continue
        inner = getattr(owner, "model", None)
        embed = getattr(inner, "embed_tokens", None) if inner is not None else None
        if embed is None:
            continue
        head = getattr(owner, "lm_head", None)
        if head is not None:
            return embed, head
        tied = getattr(getattr(owner, "args", None), "tie_word_embeddings", True)
        if not tied:
            break
        return embed, embed.as_linear
    raise DrafterError(
        f"cannot find the target's embedding and lm_head on {type(model).__module__}.{type(model).__name__}: "
        "expected model.model.embed_tokens (or model.language_model.model.embed_tokens) and lm_head or tied embeddings"
    )


def target_final_norm(model: nn.Module) -> Callable[[mx.array], mx.array]:
    for owner in (getattr(model, "language_model", None), model):
        norm = getattr(getattr(owner, "model", None), "norm", None) if owner is not None else None
        if norm is not None:
            return norm
    raise DrafterError(
        f"a target_layer_id names the target's last layer, whose HF hidden state is taken after the final "
        f"norm, but {type(model).__name__} has no model.norm"
    )


def _read_weights(path: Path) -> Dict[str, mx.array]:
    weights: Dict[str, mx.array] = {}
    for f in sorted(path.glob("*.safetensors")):
        weights.update(mx.load(str(f)))
    return weights


def load(path: Optional[Path], config: Dict[str, Any], target: DraftTarget, options: Dict[str, Any]) -> Drafter:
    if path is None:
        raise DrafterError("dflash drafters need a checkpoint (speculative.draft_model / --draft-model)")
    args = ModelArgs.from_dict(config)
    model = Model(args)
    weights = model.sanitize(_read_weights(path))
    fc = weights.get("fc.weight")
    expected = (args.hidden_size, len(args.target_layer_ids) * args.hidden_size)
    if fc is not None and "quantization" not in config and tuple(fc.shape) != expected:
        raise DrafterError(
            f"draft model {str(path)!r}: fc.weight has shape {list(fc.shape)}; expected {list(expected)} "
            f"(hidden_size x len(target_layer_ids)*hidden_size with {len(args.target_layer_ids)} target layers)"
        )
    quant = config.get("quantization")
    if quant:
        nn.quantize(model, group_size=quant["group_size"], bits=quant["bits"],
                    class_predicate=lambda p, m: f"{p}.scales" in weights)
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise DrafterError(f"draft model {str(path)!r}: its tensors do not match a DFlash drafter of this config: {e}") from e
    mx.eval(model.parameters())
    model.eval()
    if target.model is None:
        raise DrafterError("dflash drafters borrow the target's embedding and lm_head: load the target first")
    embed, head = target_embedding_and_head(target.model)
    drafter = DFlashDrafter(model, embed, head)
    n_layers = target.num_layers
    if n_layers is not None and n_layers - 1 in drafter.capture_layers():
        drafter.final_norm = (n_layers - 1, target_final_norm(target.model))
    try:
        from ...plugin import padded_cache

        if padded_cache.resolve_mode():
            drafter.cache_bucket = padded_cache.DEFAULT_BUCKET
            tokens = int(os.environ.get("MLX_SPEC_PREWARM_TOKENS", padded_cache.DEFAULT_PREWARM_TOKENS))
            prewarm(drafter, tokens, max(args.block_size, int(options.get("block_size") or 0)))
    except ImportError:  # an older plugin without padded caches
        pass
    return drafter


CONTEXT_PREWARM = 512  # padded context counts pre-warmed: 1, 2, 4 .. 512 (a catch-up after a pause)


def prewarm(drafter: DFlashDrafter, max_tokens: int, block: int) -> int:
    """One drafter forward per (context bucket, power-of-two block width) up to ``max_tokens``
    context positions, and one per power-of-two context count, so that rounds meet no attention
    shape for the first time (CUDA compiles each one, 40-70 ms). Returns the number of forwards."""
    from ...plugin.padded_cache import PaddedKVCache

    bucket = drafter.cache_bucket
    if not bucket or max_tokens <= 0:
        return 0
    model, args = drafter.model, drafter.args
    dtype = model.norm.weight.dtype
    caches = model.make_cache(lambda: PaddedKVCache(bucket))
    widths = [1 << i for i in range(1, (max(2, block) - 1).bit_length() + 1)]
    emb = mx.zeros((1, widths[-1], args.hidden_size), dtype)
    taps = len(args.target_layer_ids) * args.hidden_size
    runs = 0
    for n in (1 << i for i in range(CONTEXT_PREWARM.bit_length())):  # padded context counts (propose)
        mx.eval(model(emb[:, :2], mx.zeros((1, n, taps), dtype), caches, width=1))
        for c in caches:
            c.trim(c.offset)
        runs += 1
    model(emb[:, :2], mx.zeros((1, 1, taps), dtype), caches)
    shapes = [(c.keys.shape, c.values.shape) for c in caches]
    for span in range(bucket, -(-max(bucket, max_tokens) // bucket) * bucket + 1, bucket):
        for c, (ks, vs) in zip(caches, shapes):
            c.keys = mx.zeros((ks[0], ks[1], span, ks[3]), dtype)
            c.values = mx.zeros((vs[0], vs[1], span, vs[3]), dtype)
            c.offset = span - 1  # keys_and_values() then returns all ``span`` slots
        for w in widths:
            mx.eval(model(emb[:, :w], None, caches, width=w - 1))
            runs += 1
    mx.clear_cache()
    return runs


family = DrafterFamily(
    name="dflash",
    kind=KIND,
    description="z-lab DFlash: one block-diffusion forward over the target's hidden states drafts a whole block",
    load=load,
    check=check,
    detect=detect,
    trainer=lambda: importlib.import_module(".train", __name__).DFlashTrainer,  # mlx-spec train-drafter
    priority=10,
)
