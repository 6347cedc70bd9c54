"""``mlx-spec check`` for EAGLE-3 drafters: every field that must fit the target, one reason each.

Checked from config.json and the safetensors headers (plus the small ``d2t`` tensor itself):
the widths (``target_hidden_size`` / ``hidden_size``), the vocabulary, the layer ids under the
layout's convention, ``fc`` / ``lm_head`` shapes, and the draft vocabulary mapping.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np

from ...hooks.api import loading
from ..base import Compatibility, DraftTarget
from ..compat import check_tokenizer, config_value
from .model import INPUT, ModelArgs, canonical_name

_NUMPY = {"I64": np.int64, "I32": np.int32, "BOOL": np.bool_, "U8": np.uint8, "I16": np.int16, "I8": np.int8}


def read_tensor(path: Path, name: str) -> Optional[np.ndarray]:
    """One integer or bool tensor (``d2t``, ``t2d``) read from a checkpoint's safetensors files
    through their headers alone; None when no file holds it."""
    for f in sorted(path.glob("*.safetensors")):
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
            entry = header.get(name)
            if entry is None:
                continue
            if entry["dtype"] not in _NUMPY:
                raise ValueError(f"{name}: dtype {entry['dtype']}; expected an integer or bool tensor")
            start, end = entry["data_offsets"]
            fh.seek(8 + n + start)
            return np.frombuffer(fh.read(end - start), dtype=_NUMPY[entry["dtype"]]).reshape(entry["shape"])
    return None


def field_name(layout: str, name: str) -> str:
    """Where ``name`` lives in this layout's config.json (for messages)."""
    if layout == "speculators":
        if name in ("hidden_size", "vocab_size", "num_hidden_layers", "hidden_act"):
            return f"transformer_layer_config.{name}"
        if name == "layer_ids":
            return "eagle_aux_hidden_state_layer_ids"
    if layout == "specforge" and name == "layer_ids":
        return "eagle_config.eagle_aux_hidden_state_layer_ids"
    return name


def convention_text(args: ModelArgs) -> str:
    if args.layer_convention == INPUT:
        return "hidden_states[id]: the input of decoder layer id, i.e. the output of layer id-1"
    return "the output of decoder layer id (SGLang captures the input of layer id+1)"


def target_layers(target: DraftTarget) -> Optional[int]:
    if target.num_layers is not None:
        return int(target.num_layers)
    n = config_value(target.config, "num_hidden_layers")
    return int(n) if n is not None else None


def check_vocab_map(d2t: np.ndarray, args: ModelArgs, verdict: Compatibility, vocab: int) -> None:
    """d2t holds offsets: target id = draft id + d2t[draft id]; every one within the target's vocabulary, distinct."""
    if tuple(d2t.shape) != (args.draft_vocab_size,):
        verdict.fail(f"d2t: shape {list(d2t.shape)}; expected [{args.draft_vocab_size}] (one offset per draft token, "
                     "draft_vocab_size)")
        return
    ids = np.arange(len(d2t), dtype=np.int64) + d2t.astype(np.int64)
    bad = np.nonzero((ids < 0) | (ids >= vocab))[0]
    if len(bad):
        verdict.fail(f"d2t: draft ids {bad[:4].tolist()} map to target ids {ids[bad[:4]].tolist()} (draft id + d2t), "
                     f"outside the target's vocabulary (vocab_size {vocab}: ids 0..{vocab - 1})")
    elif len(np.unique(ids)) != len(ids):
        verdict.fail(f"d2t: {len(ids) - len(np.unique(ids))} draft ids map to a target id another draft id maps "
                     "to too; the draft vocabulary must be distinct target tokens")
    else:
        verdict.notes.append(f"d2t: {len(ids)} draft tokens -> distinct target ids within 0..{vocab - 1} "
                             f"({int((d2t != 0).sum())} moved by an offset)")


def check(path: Optional[Path], config: Dict[str, Any], target: DraftTarget) -> Compatibility:
    verdict = Compatibility()
    try:
        args = ModelArgs.from_dict(config)
    except (TypeError, ValueError, KeyError) as e:
        verdict.fail(f"config.json: cannot read the EAGLE-3 drafter's fields: {e}")
        return verdict
    f = lambda name: field_name(args.layout, name)  # noqa: E731
    verdict.notes.append(f"layout: {args.layout} (architectures {config.get('architectures')}); layer ids name "
                         f"{convention_text(args)}")
    if args.hidden_act != "silu":
        verdict.fail(f"{f('hidden_act')}: {args.hidden_act!r}; supported: 'silu'")
    if args.layout != "speculators" and args.num_hidden_layers != 1:
        verdict.fail(f"{f('num_hidden_layers')}: {args.num_hidden_layers}; the {args.layout} layout has exactly one "
                     "decoder layer (midlayer)")
    elif args.num_hidden_layers < 1:
        verdict.fail(f"{f('num_hidden_layers')}: {args.num_hidden_layers}; expected 1 or more")

    n = target_layers(target)
    ids = args.layer_ids(n or 0) if args.aux_layer_ids else (args.layer_ids(n) if n is not None else None)
    where = "from the checkpoint" if args.aux_layer_ids else "absent: the published default [2, N//2, N-3]"
    if args.aux_layer_ids and list(args.aux_layer_ids) != ids:
        where += f", listed as {list(args.aux_layer_ids)}: fc reads the taps in ascending layer order"
    if ids is not None:
        captures = args.capture_layers(n or 0)
        bad = [i for i, c in zip(ids, captures) if c < 0 or (n is not None and c >= n)]
        if bad:
            zero = " (hidden_states[0] is the embedding output, which is not captured)" if 0 in bad and args.layer_convention == INPUT else ""
            span = f"the target has {n} decoder layers (0..{n - 1})" if n is not None else "ids must name decoder layers"
            verdict.fail(f"{f('layer_ids')}: {ids} ({where}) names layer(s) {bad}{zero}; ids name {convention_text(args)}; {span}")
        else:
            verdict.notes.append(f"{f('layer_ids')}: {ids} ({where}) -> outputs of target layers {captures} of {n}")

    t_hidden = config_value(target.config, "hidden_size")
    if args.target_hidden_size is not None:
        if t_hidden is not None and args.target_hidden_size != t_hidden:
            verdict.fail(f"target_hidden_size: the drafter reads {args.target_hidden_size}-wide target states, the "
                         f"target's hidden_size is {t_hidden}; they must be equal")
        else:
            verdict.notes.append(f"target_hidden_size: {args.target_hidden_size} on both")
    elif t_hidden is not None and args.hidden_size != t_hidden:
        verdict.fail(f"{f('hidden_size')}: the drafter has {args.hidden_size}, the target's hidden_size is {t_hidden}, "
                     "and no target_hidden_size says the drafter reads states of another width; fc expects "
                     f"{args.taps} x {args.hidden_size}")
    else:
        verdict.notes.append(f"{f('hidden_size')}: {args.hidden_size} on both")

    t_vocab = config_value(target.config, "vocab_size")
    if t_vocab is not None and args.vocab_size != t_vocab:
        verdict.fail(f"{f('vocab_size')}: the drafter has {args.vocab_size}, the target has {t_vocab}; they must be equal "
                     "(d2t maps draft ids into this vocabulary)")
    else:
        verdict.notes.append(f"{f('vocab_size')}: {args.vocab_size} on both")
    if not 1 <= args.draft_vocab_size <= args.vocab_size:
        verdict.fail(f"draft_vocab_size: {args.draft_vocab_size}; allowed: 1 to vocab_size ({args.vocab_size})")
    if path is not None:
        _check_tensors(path, config, args, verdict, int(t_vocab or args.vocab_size))
    check_tokenizer(target.path, path, verdict)
    return verdict


def _check_tensors(path: Path, config: Dict[str, Any], args: ModelArgs, verdict: Compatibility, vocab: int) -> None:
    try:
        headers = loading.safetensors_headers(path, "draft model", required=False)
    except loading.CheckpointError:
        return  # the registry reports unreadable weights
    if not headers:
        return  # a config-only check
    shapes = {canonical_name(k) or k: h.shape for k, h in headers.items()}
    quantized = "quantization" in config
    expected = {"fc.weight": [args.hidden_size, args.taps * args.feature_size],
                "lm_head.weight": [args.draft_vocab_size, args.hidden_size]}
    for name, shape in expected.items():
        if name not in shapes:
            verdict.fail(f"{name}: not found in {path}'s safetensors files; an EAGLE-3 drafter needs it")
        elif not quantized and list(shapes[name]) != shape:
            why = (f"hidden_size x {args.taps} taps x {args.feature_size}" if name == "fc.weight"
                   else "draft_vocab_size x hidden_size")
            verdict.fail(f"{name}: shape {list(shapes[name])}; expected {shape} ({why})")
        else:
            verdict.notes.append(f"{name}: {list(shapes[name])}")
    own = "embed_tokens.weight" in shapes
    if not own and args.feature_size != args.hidden_size:
        verdict.fail(f"embed_tokens.weight: absent, and the drafter ({args.hidden_size} wide) cannot borrow the "
                     f"target's {args.feature_size}-wide embedding (target_hidden_size differs)")
    verdict.notes.append("embed_tokens: the drafter's own" if own else "embed_tokens: absent, the target's is used")
    d2t = read_tensor(path, "d2t")
    if d2t is None:
        if args.draft_vocab_size < args.vocab_size:
            verdict.fail(f"d2t: not found; a draft vocabulary of {args.draft_vocab_size} < vocab_size {args.vocab_size} "
                         "needs d2t (target id = draft id + d2t[draft id])")
        else:
            verdict.notes.append("d2t: absent; the draft vocabulary is the target's")
    else:
        check_vocab_map(d2t, args, verdict, vocab)
    t2d = headers.get("t2d")
    if t2d is not None and tuple(t2d.shape) != (args.vocab_size,):
        verdict.fail(f"t2d: shape {list(t2d.shape)}; expected [{args.vocab_size}] (one flag per target token)")


def draft_ids(path: Path, args: ModelArgs) -> List[int]:
    """The target id of each draft id (identity without d2t)."""
    d2t = read_tensor(path, "d2t")
    base = np.arange(args.draft_vocab_size, dtype=np.int64)
    return (base if d2t is None else base + d2t.astype(np.int64)).tolist()
