"""What one ``mlx-spec bench`` run compares (benchmarks/core.py runs them): the target (a checkpoint or a
synthetic one, its weights quantized if asked), the drafters (synthetic or from checkpoints), and the methods:
plain decoding (mlx-lm, this host) and the speculative rounds per kind, block size and oracle tau.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import mlx.core as mx

from ..hooks.api import Backend, LoadedTarget, draft_backend
from ..plugin.draft import ahead_modes
from .methods import HostMethod, Method, MlxLmPlain, MlxLmSpec
from . import synthetic

if TYPE_CHECKING:
    from .core import BenchSettings

# A twin method's name suffix per --draft-ahead mode (the first mode's methods carry none; draft.ahead_modes)
TWINS = {"on": " draft-ahead", "verify": " verify-ahead", "off": " no-ahead"}


def load_target(s: BenchSettings) -> Tuple[LoadedTarget, Dict[str, Any], str]:
    target, config, note = _load_target(s)
    if s.quantize_bits:
        import mlx.nn as nn

        nn.quantize(target.model, group_size=64, bits=s.quantize_bits)
        mx.eval(target.model.parameters())
        note += f"; weights quantized to {s.quantize_bits} bits (group size 64)"
    return target, config, note


def _load_target(s: BenchSettings) -> Tuple[LoadedTarget, Dict[str, Any], str]:
    if s.synthetic_target:
        config = synthetic.config_for(s.synthetic_target)
        model = synthetic.build(config, seed=s.seed)
        note = (f"synthetic {s.synthetic_target}: random {config['torch_dtype']} weights built in memory; large logit "
                "margins by construction (head row pi(t) = embedding of t, layer output projections x0.1)")
        return LoadedTarget(model=model, tokenizer=None, path=Path("synthetic"), model_config=config,
                            name=s.synthetic_target), config, note
    if not s.model:
        raise ValueError("mlx-spec bench: give --model PATH or --synthetic-target NAME "
                         f"(allowed: {', '.join(synthetic.SPECS)})")
    from mlx_lm import load as mlx_load

    from ..hooks.api import loading

    path = loading.resolve_path(s.model, "model")
    config = loading.read_config(path, "model")
    model, tok = mlx_load(str(path))
    return LoadedTarget(model=model, tokenizer=tok, path=path, model_config=config, name=s.model), config, f"checkpoint {s.model}"


def load_drafters(s: BenchSettings, target: LoadedTarget, config: Dict[str, Any], policy: Optional[Backend]) -> Dict[str, Any]:
    """kind -> (drafter, draft LM module or None, description)."""
    from ..drafters.draft_model import DraftModelDrafter
    from ..drafters.ngram import family as ngram_family

    out: Dict[str, Any] = {}
    kinds = ["dflash", "draft_model"] if s.kind == "auto" else [s.kind]
    if s.synthetic_target:
        dcfg = synthetic.config_for(s.synthetic_target, num_hidden_layers=s.draft_layers)
        draft_lm = synthetic.build(dcfg, seed=s.seed + 1)
        desc = f"draft LM: {s.draft_layers} layers, width {dcfg['hidden_size']}, random weights"
    elif s.draft_model:
        from mlx_lm import load as mlx_load

        draft_lm, _ = mlx_load(s.draft_model)
        desc = f"draft LM {s.draft_model}"
    else:
        draft_lm, desc = None, ""
    if draft_lm is None and "draft_model" in kinds:
        raise ValueError("mlx-spec bench: the draft_model kind needs --draft-model PATH (or --synthetic-target)")
    if draft_lm is None and s.mlx_lm_spec:
        print("[bench] no draft LM (--draft-model): skipping mlx-lm's speculative_generate_step", file=sys.stderr)
    elif "draft_model" in kinds or s.mlx_lm_spec:
        padded = policy is not None and policy.shape_stable
        out["draft_model"] = (DraftModelDrafter(draft_lm, draft_backend(policy)), draft_lm, desc + (", padded caches" if padded else ""))
    if "dflash" in kinds:
        try:
            drafter, ddesc = synthetic.dflash_drafter(target.model, config, max(s.block_sizes), s.dflash_layers,
                                                      s.seed + 2, policy)
            if policy is not None and policy.shape_stable:  # as drafters.dflash.load does on CUDA: padded context cache
                ddesc += ", padded context cache"
            out["dflash"] = (drafter, None, ddesc)
        except Exception as e:  # noqa: BLE001 - the DFlash family may be missing in this build
            if s.kind == "dflash":
                raise
            print(f"[bench] dflash drafter unavailable ({type(e).__name__}: {e}); skipping it", file=sys.stderr)
    if "eagle3" in kinds:
        drafter, edesc = synthetic.eagle3_drafter(target.model, config, seed=s.seed + 3, backend=policy)
        out["eagle3"] = (drafter, None, edesc + (", padded caches" if policy is not None else ""))
    if "ngram" in kinds:
        from ..drafters.base import DraftTarget

        out["ngram"] = (ngram_family.load(None, {}, DraftTarget(config=config), {"ngram_n": 3}), None, "ngram (n=3)")
    return out


def build_methods(s: BenchSettings, target: LoadedTarget, config: Dict[str, Any], drafters: Dict[str, Any],
                  policy: Optional[Backend], blocks: Optional[Dict[str, List[int]]] = None,
                  spec_plugin: Any = None) -> List[Method]:
    """``blocks``: kind -> block sizes of real drafters (``real.load_drafters``); each runs every tau there.
    ``spec_plugin``: the speculative methods' host plugin (``HostMethod``'s ``plugin``)."""
    vocab = int(config["vocab_size"])
    methods: List[Method] = [MlxLmPlain(target.model), HostMethod(target, "host plain (KVCache)", None)]
    if policy is not None and policy.shape_stable:
        methods.append(HostMethod(target, "host plain (padded)", policy))
    order = ("dflash", "eagle3", "mtp", "draft_model", "ngram")
    spec_kinds = [k for k in order if k in drafters and (blocks is not None or s.kind in ("auto", k))]
    for kind in spec_kinds:
        drafter = drafters[kind][0]
        taus = s.taus if kind != "draft_model" or s.kind == "draft_model" or blocks else [t for t in s.taus[:1]]
        sizes = blocks[kind] if blocks is not None else s.block_sizes
        aheads = ahead_modes(s.draft_ahead)
        for block in sizes:
            for tau in taus:
                tag = f"tau{tau:g}" if tau else "real drafts"
                for ahead in aheads:
                    methods.append(HostMethod(target, f"plugin {kind} b{block} {tag}{TWINS[ahead] if ahead != aheads[0] else ''}",
                                              policy, drafter, block, tau, False, vocab, spec_plugin, ahead))
        for tau in s.adaptive_taus:
            block = max(sizes)
            methods.append(HostMethod(target, f"plugin {kind} b{block} tau{tau:g} adaptive", policy, drafter,
                                      block, tau, True, vocab, spec_plugin, aheads[0]))
    if s.mlx_lm_spec and "draft_model" in drafters:
        block = max(blocks["draft_model"] if blocks is not None else s.block_sizes)
        methods.append(MlxLmSpec(target.model, drafters["draft_model"][1], block, s.taus[0], vocab))
    return methods
