"""The speculative plugin: hook implementations registered under ``mlx_speculative.host``."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from ..drafters import registry
from ..drafters.base import Drafter, DraftTarget
from ..hooks.api import (
    Backend, CaptureRequest, DecodeBatch, DecodeState, DemoPart, Description, HostConfig, LoadedTarget, Metric,
    RowSnapshot, StepOutput, check_supported, draft_backend, hookimpl, knobs, loading,
)
from . import cuda, draft, flags, round
from .adaptive import Recent
from .costs import CostTable
from .metrics import METRICS
from .settings import SpeculativeSettings, resolve

NAME = round.NAME
log = logging.getLogger("mlx_speculative")


@dataclass
class Attachment:
    """What the plugin attaches to a target: the settings, the drafter (or why not) and the backend."""

    settings: SpeculativeSettings
    drafter: Optional[Drafter] = None
    error: Optional[str] = None
    block_size: int = 0
    policy: Optional[Backend] = None  # the CUDA backend (plugin/cuda/) for the target and drafter; None: the host's
    max_block: int = 0  # adaptive blocks grow up to this (the drafter's max_block_size; block_size when pinned)
    costs: CostTable = field(default_factory=CostTable)  # rounds and plain steps by shape, for the controllers
    recent: Recent = field(default_factory=Recent)  # what the target's latest rounds saw (adaptive.py)
    ahead_mode: str = "on"  # what rounds queue before reading their outcome ($MLX_SPEC_DRAFT_AHEAD: on | verify | off)
    lazy_drafts: bool = True  # proposals stay unevaluated until the verify (runtime.lazy_drafts, $MLX_SPEC_LAZY_DRAFTS)

    @property
    def ahead(self) -> bool:
        """Rounds draft the next block before reading their outcome, where the drafter can."""
        return self.ahead_mode != "off"

    @property
    def verify_ahead(self) -> bool:
        """... and queue the next verify over it (plugin/cuda/verify_ahead.py)."""
        return self.ahead_mode == "verify"


def draft_target(target: LoadedTarget, policy: Optional[Backend] = None) -> DraftTarget:
    """What a drafter family reads of ``target``; its backend's view for drafters is ``policy``'s (the one the host
    will apply), else the target's."""
    return DraftTarget(config=target.model_config, path=target.path, model=target.model, tokenizer=target.tokenizer,
                       num_layers=target.num_layers, backend=draft_backend(policy or target.cache_policy))


def attach(target: LoadedTarget, settings: SpeculativeSettings) -> Attachment:
    """Resolve, check and load the drafter for ``target``; raises on any problem."""
    mode = draft.ahead_mode()
    lazy = bool(knobs.value("lazy_drafts"))
    resolution = registry.resolve(settings.draft_model, settings.kind, draft_target(target))
    for warning in resolution.warnings:
        log.warning(warning)
    policy = cuda.backend_for()
    # Refuse cache types the transaction cannot roll back before any token is generated.
    check_supported((policy or target.cache_policy).make_cache(target.model))
    options: Dict[str, Any] = {"ngram_n": settings.ngram_n, "block_size": settings.block_size}
    drafter = registry.load(resolution, draft_target(target, policy), options)
    costs = CostTable()
    if target.cluster is not None:  # a sharded target: the ranks decide from rank 0's costs, draft where configured
        from .rank0_drafts import for_ranks

        drafter = for_ranks(drafter, costs, target.cluster)
    block = settings.block_size or drafter.default_block_size
    most = block if settings.block_size or not settings.adaptive else max(block, drafter.max_block_size or block)
    if policy is not None:
        policy.block_size = most  # the host warms the policy's shapes after routing attention (prepare)
        policy.capture_layers = tuple(drafter.capture_layers())  # tapped by the host before prepare
    return Attachment(settings=settings, drafter=drafter, block_size=block, policy=policy, ahead_mode=mode,
                      lazy_drafts=lazy, max_block=most, costs=costs)


def plain_backend() -> Optional[Backend]:
    """The backend for a target that decodes plainly (speculation off), where one is on (CUDA by default): its
    steps take a batch's rows at their own lengths with the verify-width kernels. On an H100, served plain steps of
    1 / 2 / 4 / 8 rows took 6.7 / 8.7 / 9.4 / 10.2 ms on it against 7.2 / 17.6 / 22.1 / 11.9 on mlx-lm's caches
    (bench/results/served/h100-llama8b-batch-ahead-jobtext-d10.json, plain-backend against plain)."""
    policy = cuda.backend_for()
    if policy is not None:
        policy.block_size, policy.capture_layers = 1, ()  # plain steps only: prewarm warms widths 1 and 2
    return policy


@hookimpl
def host_model_loaded(target: LoadedTarget, config: HostConfig) -> None:
    settings = resolve(config.section("speculative") if "speculative" in config.sections else None,
                       cli=config.overrides.get("speculative"), where=config.where)
    if not settings.enabled:
        target.attachments[NAME] = Attachment(settings=settings, policy=plain_backend())
        return
    try:
        target.attachments[NAME] = attach(target, settings)
    except Exception as e:
        if config.strict:
            raise
        log.warning("speculative decoding disabled for %s: %s", target.name, e)
        target.attachments[NAME] = Attachment(settings=settings, error=str(e))


def _attached(target: LoadedTarget) -> Optional[Attachment]:
    att: Optional[Attachment] = target.attachments.get(NAME)
    return att if att is not None and att.drafter is not None else None


@hookimpl
def host_cache_policy(target: LoadedTarget) -> Optional[Backend]:
    att: Optional[Attachment] = target.attachments.get(NAME)
    return att.policy if att is not None else None


@hookimpl
def host_prefill_captures(target: LoadedTarget, state: DecodeState) -> Optional[CaptureRequest]:
    att = _attached(target)
    if att is None or state.options.get("speculative") is False:
        return None
    layers = att.drafter.capture_layers()
    return CaptureRequest(layers=list(layers)) if layers else None


@hookimpl
def host_decode_step(batch: DecodeBatch) -> Optional[List[StepOutput]]:
    att = _attached(batch.target)
    return round.step(batch, att) if att is not None else None


@hookimpl
def host_request_finished(state: DecodeState, discarded: int) -> None:
    req = state.extras.get(NAME)
    if req:
        after_failure = state.generated - req.expected if req.failed else 0  # the host's steps since
        req.observe(state)
        req.stats.truncate_last(discarded)
        req.stats.finish(state.generated - discarded, after_failure, req.controller.plain_steps,
                         req.controller.pause_reason)
        state.report[NAME] = req.stats.report()


@hookimpl
def host_save_row(state: DecodeState, batch: Optional[DecodeBatch], positions: int) -> Optional[RowSnapshot]:
    """The drafter's state for the row's first ``positions`` tokens, for the server's prompt cache."""
    att = _attached(state.target)
    req = state.extras.get(NAME)
    if att is None or state.options.get("speculative") is False or req is False or (req and req.failed):
        return None
    br = batch.extras.get(NAME) if batch is not None else None
    if br is not None and req and req.synced:
        draft = br.draft
    else:  # not drafted yet: what was restored for it, plus what the host fed since (its captures)
        draft = att.drafter.new_batch()
        saved = state.restored.get(NAME) if state.cached else None
        if saved is not None and not draft.restore_row(state, saved.value, state.cached):
            return None
    kept = draft.export_row(state, positions)
    return RowSnapshot(NAME, kept.positions, kept, kept.nbytes) if kept is not None else None


@hookimpl
def host_describe(target: LoadedTarget) -> Optional[Description]:
    att: Optional[Attachment] = target.attachments.get(NAME)
    if att is None:
        return None
    s = att.settings
    info: Dict[str, Any] = {"enabled": s.enabled, "kind": s.kind, "draft_model": s.draft_model,
                            "block_size": att.block_size or s.block_size, "adaptive": s.adaptive,
                            "acceptance": s.acceptance, "sources": dict(s.sources), "error": att.error}
    if att.drafter is None:
        line = f"speculative decoding is off: {att.error}" if att.error else "speculative decoding is off"
        return Description(NAME, False, [line + f" ({s.describe()})" if att.error else line], info)
    d = att.drafter
    policy = att.policy or target.cache_policy
    info.update(kind=d.kind, family=d.family, cache_policy=policy.name,
                attention="kernel" if policy.attention is not None else "mlx-lm")
    line = (f"speculative decoding on: kind {d.kind} (family {d.family}), block size {att.block_size}"
            f"{' (adaptive)' if s.adaptive and s.block_size is None else ' (pinned)'}, acceptance {s.acceptance}, "
            f"draft model {s.draft_model or '-'}; settings from {s.sources_text()}")
    names = tuple(n for n in (s.draft_model, d.kind) if n)
    return Description(NAME, True, [line], info, draft_names=names, draft_tokens=att.block_size - 1)


@hookimpl
def host_metrics() -> Optional[List[Metric]]:
    return METRICS.prometheus()


@hookimpl
def host_add_commands(subparsers: Any) -> None:
    from . import commands

    commands.add_commands(subparsers)


@hookimpl
def host_add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    if command in flags.COMMANDS:
        flags.add_flags(parser)


@hookimpl
def host_overrides(args: argparse.Namespace, command: str) -> Optional[Dict[str, Dict[str, Any]]]:
    return {"speculative": flags.overrides(args)} if command in flags.COMMANDS else None


@hookimpl
def host_plain_reason(args: argparse.Namespace, config: HostConfig) -> Optional[str]:
    return flags.off_reason(args, config)


@hookimpl
def host_demo(config: HostConfig) -> Optional[DemoPart]:
    """The demo drafter, unless some speculative setting was given (or speculation was switched off)."""
    if flags.configured(config):
        return None
    return DemoPart(f"drafter {loading.DEMO_DRAFTER!r}", {"speculative": {"draft_model": loading.DEMO_DRAFTER}})
