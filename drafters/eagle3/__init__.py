"""``eagle3``: EAGLE-3 drafters (SafeAILab EAGLE, SpecForge and speculators layouts), chain drafting.

The drafter reads the outputs of three (or more) target layers, captured from the target's
ordinary forward (prefill and every verify), fused by ``fc``; one decoder layer drafts a token
per step over its own reduced vocabulary, mapped to the target's by ``d2t`` (target id = draft
id + d2t[draft id]). Verification is the target's own, over its full vocabulary: greedy argmax,
or rejection sampling against q over the full vocabulary (zero outside the draft vocabulary).

Chain, not tree: the ordinary forward takes its positions from the caches' offsets, so a round
verifies one sequence; EAGLE's token trees would need their own verify (tree masks, positions).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import mlx.core as mx

from ...hooks.api import DraftBackend
from ..base import DraftBatch, Drafter, DrafterError, DrafterFamily, DraftTarget
from ..checkpoint import load_into, read_tensors
from .batch import Eagle3Batch
from .check import check, target_layers
from .model import DEFAULT_BLOCK_SIZE, Model, ModelArgs, canonical_name, config_layout

KIND = "eagle3"


class Eagle3Drafter(Drafter):
    kind = KIND
    family = "eagle3"

    def __init__(self, model: Model, embed: Callable[[mx.array], mx.array], targets: mx.array,
                 capture: List[int], backend: Optional[DraftBackend] = None):
        self.model = model
        self.args = model.args
        self.embed = embed
        self.targets = targets  # [draft_vocab] uint32: the target id of each draft id
        self.capture = list(capture)
        self.dtype = model.norm.weight.dtype
        self.vocab_size = int(self.args.vocab_size)
        tokens = self.args.speculative_tokens
        self.default_block_size = int(tokens) + 1 if tokens else DEFAULT_BLOCK_SIZE
        self.backend = backend or DraftBackend()  # the target's backend, as drafters see it (hooks/backend.py)

    @property
    def shape_stable(self) -> bool:
        """The backend keeps attention shapes (CUDA): catch-ups feed power-of-two counts."""
        return self.backend.shape_stable

    def capture_layers(self) -> List[int]:
        return list(self.capture)

    def make_cache(self) -> List[Any]:
        return self.model.make_cache(self.backend.kv_cache)

    def full_vocab(self, logits: mx.array) -> mx.array:
        """[B, draft_vocab] -> [B, vocab]: the draft logits at their target ids, -inf elsewhere."""
        full = mx.full((logits.shape[0], self.vocab_size), -mx.inf, dtype=logits.dtype)
        full[:, self.targets] = logits
        return full

    def new_batch(self) -> DraftBatch:
        return Eagle3Batch(self)


def detect(config: Dict[str, Any]) -> bool:
    """EAGLE-3 from config.json alone: one of the three layouts, and no DFlash fields."""
    if "dflash_config" in config or "mask_token_id" in config:
        return False
    kind = config.get("speculators_model_type")
    return config_layout(config) is not None and kind in (None, "eagle3")


def draft_targets(raw: Dict[str, mx.array], args: ModelArgs) -> mx.array:
    """[draft_vocab] target ids of the draft ids: arange + d2t (identity without d2t)."""
    base = mx.arange(args.draft_vocab_size, dtype=mx.int64)
    d2t = raw.get("d2t")
    return (base if d2t is None else base + d2t.astype(mx.int64)).astype(mx.uint32)


def build(path: Path, config: Dict[str, Any]) -> Tuple[Model, Dict[str, mx.array]]:
    """(Model with the checkpoint's weights, the raw tensors) from a checkpoint folder."""
    args = ModelArgs.from_dict(config)
    raw = read_tensors(path)
    own = any(canonical_name(k) == "embed_tokens.weight" for k in raw)
    model = Model(args, own_embedding=own)
    weights = model.sanitize(raw)
    load_into(model, weights, config, path, f"an EAGLE-3 drafter of this config (layout {args.layout})")
    return model, raw


def load(path: Optional[Path], config: Dict[str, Any], target: DraftTarget, options: Dict[str, Any]) -> Drafter:
    if path is None:
        raise DrafterError("eagle3 drafters need a checkpoint (speculative.draft_model / --draft-model)")
    if target.model is None:
        raise DrafterError("eagle3 drafters read the target's hidden states: load the target first")
    model, raw = build(path, config)
    if "embed_tokens" in model:
        embed: Callable[[mx.array], mx.array] = model.embed_tokens
    else:
        from ..target_parts import target_embedding_and_head

        embed = target_embedding_and_head(target.model)[0]
    n = target_layers(target)
    drafter = Eagle3Drafter(model, embed, draft_targets(raw, model.args), model.args.capture_layers(n or 0),
                            target.backend)
    if drafter.shape_stable:
        prewarm(drafter, target.backend.prewarm_tokens,
                max(drafter.default_block_size, int(options.get("block_size") or 0)))
    return drafter


def prewarm(drafter: Eagle3Drafter, max_tokens: int, block: int) -> int:
    """One forward per (key bucket, query width) up to ``max_tokens`` positions: the catch-up's
    power-of-two widths (a chain step is one position, exact key lengths), so that rounds meet no
    attention shape for the first time (CUDA compiles each one). Returns the count."""
    bucket = drafter.backend.bucket
    if not bucket or max_tokens <= 0:
        return 0
    args, dtype = drafter.args, drafter.dtype
    widths = [1 << i for i in range(1, (max(2, block) - 1).bit_length() + 1)]
    runs = 0
    for span in range(bucket, -(-max(bucket, max_tokens) // bucket) * bucket + 1, bucket):
        for w in widths:
            caches = drafter.make_cache()
            for c in caches:  # a cache holding span - w positions: the forward's keys fill the bucket
                if span > w:
                    kv = mx.zeros((1, args.num_key_value_heads, span - w, args.head_dim), dtype)
                    c.update_and_fetch(kv, kv)
            emb = mx.zeros((1, w, args.hidden_size), dtype)
            mx.eval(drafter.model(emb, emb, caches))
            runs += 1
    mx.clear_cache()
    return runs


family = DrafterFamily(
    name="eagle3",
    kind=KIND,
    description="EAGLE-3: fc over three target layers, one decoder layer, reduced draft vocabulary (chain drafting)",
    load=load,
    check=check,
    detect=detect,
    trainer=lambda: importlib.import_module(".train", __name__).Eagle3Trainer,  # mlx-spec train-drafter
    priority=5,
)
