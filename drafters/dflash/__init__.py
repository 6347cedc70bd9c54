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
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import mlx.core as mx

from ..base import Compatibility, DraftBatch, Drafter, DrafterError, DrafterFamily, DraftTarget
from ..checkpoint import load_into, read_tensors
from ..compat import check_tokenizer, config_value
from ...hooks.api import CompiledCalls, DraftBackend, loading, zeroed
from .batch import CONTEXT_CHUNK, DFlashBatch
from ..target_parts import target_embedding_and_head
from .features import final_norm_tap
from .config import MUSE_ASSISTANT, UNSUPPORTED_ARCHITECTURES, config_layout
from .model import Model, ModelArgs, canonical_name

KIND = "dflash"


class DFlashDrafter(Drafter):
    kind = KIND
    family = "dflash"
    staged = True  # ``draft`` queues its stages one after another (False: one graph; the bench's A/B)

    def __init__(self, model: Model, embed: Callable[[mx.array], mx.array], head: Callable[[mx.array], mx.array],
                 backend: Optional[DraftBackend] = None):
        self.model = model
        self.args = model.args
        self.embed = embed
        self.head = head
        self.mask_token_id = int(self.args.mask_token_id)
        self.default_block_size = int(self.args.block_size)
        self.backend = backend or DraftBackend()  # the target's backend, as drafters see it (hooks/backend.py)
        # The backend's compiled calls (plugin/cuda/compiled.py) over its padded caches (one row or a batch's), or None.
        self.compiler: Optional[CompiledCalls] = self.backend.calls
        # (the target's last layer, its final norm) when a tap reads the last layer's output.
        self.final_norm: Optional[Tuple[int, Callable[[mx.array], mx.array]]] = None

    @property
    def shape_stable(self) -> bool:
        """Shape-stable caches (the backend's on CUDA): context K/V padded to buckets, blocks and context counts to
        powers of two, so that rounds meet few attention shapes."""
        return self.backend.shape_stable

    def capture_layers(self) -> List[int]:
        return list(self.args.capture_layers)

    def make_cache(self) -> List[Any]:
        return self.model.make_cache(self.backend.kv_cache)

    def new_batch(self) -> DraftBatch:
        return DFlashBatch(self)

    def append_context(self, caches: List[Any], feats: mx.array) -> None:
        """The context K/V of ``feats`` [B, n, taps*H] appended to ``caches`` (``Model.append_context``),
        compiled for up to 32 positions where the backend compiles (a round's new context)."""
        n = feats.shape[1]
        if self.compiler is None or n > 32 or self.compiler.call(
                ("dflash context",), self, _append, caches, [feats], n, n, "compiled dflash context") is None:
            self.model.append_context(feats, caches)

    def block(self, caches: List[Any], tokens: mx.array, widths: Optional[mx.array] = None) -> mx.array:
        """The block's final hidden states [B, T, H] for ``tokens`` [B, T] over the context in ``caches``
        (``Model.__call__``), compiled where the backend compiles."""
        if self.compiler is not None:
            arrays = [tokens] if widths is None else [tokens, widths]
            got = self.compiler.call(("dflash block",), self, _block, caches, arrays, tokens.shape[1], 0,
                                     "compiled dflash block")
            if got is not None:
                return got[0]
        return self.model(self.embed(tokens), caches, widths)

    def draft(self, caches: List[Any], tokens: mx.array, widths: Optional[mx.array] = None,
              feats: Optional[mx.array] = None, shift: Optional[mx.array] = None) -> Optional[mx.array]:
        """Greedy drafts [B, T - 1] in one compiled call: the head's argmax over the block's positions
        1.. (``block`` and the head in one graph). With ``feats`` [B, W, taps*H] (drafting ahead): their context
        K/V first written right past each row's context in ``caches``, whose offsets stay (the host keeps some of
        them later), and the block run ``shift`` (a device scalar <= W, or [B]: each row's) positions past it. Compiled calls
        only; None: declined.

        ``staged`` (the default): the call's context writes, then each layer, queued to the device one after
        another (``mx.async_eval``) before the drafts are returned. MLX commits queued work to the device every
        100 operations or 1000 MB of arrays (MLX-CUDA), so one graph of the whole draft (~200 operations,
        3.4 GB at the Llama-3-8B shape) first reaches the device after about two layers' encoding; in stages
        the device starts after the context writes' and runs while the host encodes the rest."""
        if self.compiler is None:
            return None
        arrays = [tokens] + ([] if widths is None else [widths]) + ([] if feats is None else [feats, shift])
        past = 0 if feats is None else feats.shape[1]
        how = (widths is not None, feats is not None, self.staged)
        got = self.compiler.call(("dflash draft",) + how, self, _DRAFTS[how], caches, arrays, past + tokens.shape[1],
                                 0, "compiled dflash draft" + (" ahead" if feats is not None else ""))
        if got is None:
            return None
        drafts, stages = got[0], got[1:]
        del got
        written = 2 * len(caches) if feats is not None else 0  # the context writes' buffers: one stage
        if written:
            mx.async_eval(*stages[:written])
            del stages[:written]
        while stages:  # no reference kept to an evaluated stage: the cache writes after it then run in place
            mx.async_eval(stages.pop(0))
        return drafts


def _append(d: DFlashDrafter, caches: List[Any], feats: mx.array) -> List[mx.array]:
    d.model.append_context(feats, caches)
    return []


def _block(d: DFlashDrafter, caches: List[Any], tokens: mx.array, widths: Optional[mx.array] = None) -> List[mx.array]:
    return [d.model(d.embed(tokens), caches, widths)]


def _draft_fn(with_widths: bool, with_feats: bool, staged: bool) -> Callable[..., List[mx.array]]:
    def fn(d: DFlashDrafter, caches: List[Any], tokens: mx.array, *rest: mx.array) -> List[mx.array]:
        stages: List[mx.array] = []
        if with_feats:
            feats, shift = rest[-2:]
            base = caches[0].offset
            d.model.append_context(feats, caches)
            if staged:
                stages += [a for c in caches for a in (c.keys, c.values)]
            at = base + shift.astype(mx.int32)  # one array for every layer: their writes and masks are made once
            for c in caches:
                c.offset = at
        h = d.model(d.embed(tokens), caches, rest[0] if with_widths else None, stages if staged else None)  # [B, T, H]
        return [mx.argmax(d.head(h[:, 1:]).astype(mx.float32), axis=-1)] + stages  # [B, T - 1], then the stages

    return fn


_DRAFTS = {(w, f, s): _draft_fn(w, f, s) for w in (False, True) for f in (False, True) for s in (False, True)}


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
    if path is not None:
        _check_fc(path, config, args, verdict)
    check_tokenizer(target.path, path, verdict)
    return verdict


def _fc_problem(shape: Tuple[int, ...], args: ModelArgs) -> Optional[str]:
    expected = (args.hidden_size, len(args.target_layer_ids) * args.hidden_size)
    if tuple(shape) == expected:
        return None
    return (f"fc.weight has shape {list(shape)}; expected {list(expected)} (hidden_size x "
            f"len(target_layer_ids)*hidden_size with {len(args.target_layer_ids)} target layers)")


def _check_fc(path: Path, config: Dict[str, Any], args: ModelArgs, verdict: Compatibility) -> None:
    """fc.weight's shape from the safetensors headers (no tensor is loaded)."""
    try:
        headers = loading.safetensors_headers(path, "draft model", required=False)
    except loading.CheckpointError:
        return  # the registry reports unreadable weights
    if not headers:
        return  # a config-only check
    fc = [h for name, h in headers.items() if canonical_name(name) == "fc.weight"]
    if not fc:
        verdict.fail(f"fc.weight: not found in {path}'s safetensors files; a DFlash drafter needs it")
    elif "quantization" in config:
        verdict.notes.append("fc.weight: quantized, shape not compared")
    elif args.target_layer_ids:
        problem = _fc_problem(fc[0].shape, args)
        if problem:
            verdict.fail(problem)
        else:
            verdict.notes.append(f"fc.weight: {list(fc[0].shape)} (from the safetensors header)")


# -- loading ----------------------------------------------------------------------------------

def load(path: Optional[Path], config: Dict[str, Any], target: DraftTarget, options: Dict[str, Any]) -> Drafter:
    if path is None:
        raise DrafterError("dflash drafters need a checkpoint (speculative.draft_model / --draft-model)")
    args = ModelArgs.from_dict(config)
    model = Model(args)
    weights = model.sanitize(read_tensors(path))
    fc = weights.get("fc.weight")
    problem = _fc_problem(fc.shape, args) if fc is not None and "quantization" not in config else None
    if problem:
        raise DrafterError(f"draft model {str(path)!r}: {problem}")
    load_into(model, weights, config, path, "a DFlash drafter of this config")
    if target.model is None:
        raise DrafterError("dflash drafters borrow the target's embedding and lm_head: load the target first")
    embed, head = target_embedding_and_head(target.model)
    target.backend.route(model)  # the backend's attention and projection dispatchers (CUDA), if any
    drafter = DFlashDrafter(model, embed, head, target.backend)
    drafter.final_norm = final_norm_tap(target.model, drafter.capture_layers())
    if drafter.shape_stable:
        prewarm(drafter, target.backend.prewarm_tokens,
                max(args.block_size, int(options.get("block_size") or 0)))
    return drafter


CONTEXT_PREWARM = CONTEXT_CHUNK  # context counts pre-warmed: 1, 2, 4 .. 512 (longer appends go in chunks of 512)


def prewarm(drafter: DFlashDrafter, max_tokens: int, block: int, context_counts: int = CONTEXT_PREWARM) -> int:
    """One drafter forward per (context bucket, power-of-two block width) up to ``max_tokens``
    context positions, and one context append per power-of-two count up to ``context_counts``, so that rounds
    meet no attention shape for the first time (CUDA compiles each one, 40-70 ms). Returns the count."""
    bucket = drafter.backend.bucket
    if not bucket or max_tokens <= 0:
        return 0
    model, args = drafter.model, drafter.args
    dtype = model.norm.weight.dtype
    caches = drafter.make_cache()
    widths = [1 << i for i in range(1, (max(2, block) - 1).bit_length() + 1)]
    emb = mx.zeros((1, widths[-1], args.hidden_size), dtype)
    taps = len(args.target_layer_ids) * args.hidden_size
    runs = 0
    for n in (1 << i for i in range(context_counts.bit_length())):  # padded context counts (prepare)
        model.append_context(mx.zeros((1, n, taps), dtype), caches)
        mx.eval([c.keys for c in caches])
        for c in caches:
            c.trim(c.offset)
        runs += 1
    model.append_context(mx.zeros((1, 1, taps), dtype), caches)
    shapes = [(c.keys.shape, c.values.shape, dtype) for c in caches]
    for span in range(bucket, -(-max(bucket, max_tokens) // bucket) * bucket + 1, bucket):
        for w in widths:
            if w > span:
                continue
            zeroed(caches, shapes, span, span - w)  # the block, written after the context, ends the bucket
            mx.eval(model(emb[:, :w], caches, mx.array([w - 1])))
            runs += 1
    # A batch's block: rows x width positions in each projection launch, up to 32 (the kernel's plans for 17..32
    # rows, which one row's blocks never meet): compiled here, once, not at a batch's first round.
    if widths[-1] < 32 <= max(bucket, max_tokens):
        zeroed(caches, shapes, -(-32 // bucket) * bucket, 0)
        mx.eval(model(mx.zeros((1, 32, args.hidden_size), dtype), caches, mx.array([31])), drafter.head(
            mx.zeros((1, 32, args.hidden_size), dtype)))
        runs += 1
    if drafter.compiler is not None:
        runs += prewarm_compiled(drafter, caches, shapes, max_tokens, widths)
    mx.clear_cache()
    return runs


def prewarm_compiled(drafter: DFlashDrafter, caches: List[Any], shapes: List[Any], max_tokens: int,
                     widths: List[int]) -> int:
    """The compiled calls' traces (plugin/cuda/compiled.py) at every buffer length up to ``max_tokens``: each block
    width, with and without per-row widths, as a block, as greedy drafts and as drafts ahead of as many verified
    positions (a block is drafted ahead for as many drafts as the round that verifies before it); and each
    power-of-two context append up to the block."""
    if drafter.compiler is None:
        return 0
    grow, dtype = drafter.compiler.grow, drafter.model.norm.weight.dtype
    taps = len(drafter.args.target_layer_ids) * drafter.args.hidden_size
    runs = 0
    for length in range(grow, -(-max(grow, max_tokens) // grow) * grow + 1, grow):
        for w in [1] + widths:
            zeroed(caches, shapes, length, length - w)
            drafter.append_context(caches, mx.zeros((1, w, taps), dtype))
            mx.eval([c.keys for c in caches])
            runs += 1
            for per_row in ([None, mx.array([w - 1])] if w > 1 else []):
                block = mx.zeros((1, w), dtype=mx.uint32)
                zeroed(caches, shapes, length, length - w)
                mx.eval(drafter.block(caches, block, per_row), [c.keys for c in caches])
                zeroed(caches, shapes, length, length - w)
                mx.eval(drafter.draft(caches, block, per_row), [c.keys for c in caches])
                zeroed(caches, shapes, length, length - 2 * w)  # drafting ahead: as many verified positions, then the block
                mx.eval(drafter.draft(caches, block, per_row, mx.zeros((1, w, taps), dtype), mx.array(1)),
                        [c.keys for c in caches])
                runs += 3
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
