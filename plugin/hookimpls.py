"""The speculative plugin: hook implementations registered under ``mlx_speculative.host``."""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from mlx_lm.models.cache import make_prompt_cache

from ..drafters import registry
from ..drafters.base import Drafter, DraftTarget
from ..hooks.batch import DecodeBatch
from ..hooks.specs import hookimpl
from ..hooks.state import CaptureRequest, DecodeState, HostConfig, LoadedTarget, StepOutput
from . import batch_round, commit, padded_cache
from .adaptive import BlockSizeController
from .metrics import SpecStats
from .round import RequestRounds, run_round
from .settings import SpeculativeSettings, resolve

NAME = "speculative"
log = logging.getLogger("mlx_speculative")


@dataclass
class Attachment:
    """What the plugin attaches to a target: the settings and the loaded drafter (or why not)."""

    settings: SpeculativeSettings
    drafter: Optional[Drafter] = None
    error: Optional[str] = None
    block_size: int = 0


def draft_target(target: LoadedTarget) -> DraftTarget:
    return DraftTarget(
        config=target.model_config, path=target.path, model=target.model,
        tokenizer=target.tokenizer, num_layers=target.num_layers,
    )


def attach(target: LoadedTarget, settings: SpeculativeSettings) -> Attachment:
    """Resolve, check and load the drafter for ``target``; raises on any problem."""
    resolution = registry.resolve(settings.draft_model, settings.kind)
    for warning in resolution.warnings:
        log.warning(warning)
    # Refuse cache types the transaction cannot roll back before any token is generated.
    commit.check_supported(make_prompt_cache(target.model))
    options: Dict[str, Any] = {"ngram_n": settings.ngram_n}
    drafter = registry.load(resolution, draft_target(target), options)
    block = settings.block_size or drafter.default_block_size
    return Attachment(settings=settings, drafter=drafter, block_size=block)


@hookimpl
def host_model_loaded(target: LoadedTarget, config: HostConfig) -> None:
    settings = resolve(config.section("speculative") if "speculative" in config.sections else None,
                       cli=config.overrides.get("speculative"))
    # Shape-stable caches where the backend compiles per attention shape (CUDA), for plain decoding too.
    padded_cache.install(target, widths=padded_cache.widths_for(settings.block_size))
    if not settings.enabled:
        target.attachments[NAME] = Attachment(settings=settings)
        return
    log.info("%s", settings.describe())
    try:
        target.attachments[NAME] = attach(target, settings)
    except Exception as e:
        if config.strict:
            raise
        log.warning("speculative decoding disabled for %s: %s", target.name, e)
        target.attachments[NAME] = Attachment(settings=settings, error=str(e))


@hookimpl
def host_prefill_captures(target: LoadedTarget) -> Optional[CaptureRequest]:
    att: Optional[Attachment] = target.attachments.get(NAME)
    if att is None or att.drafter is None:
        return None
    layers = att.drafter.capture_layers()
    return CaptureRequest(layers=list(layers)) if layers else None


def rounds_for(state: DecodeState) -> Optional[RequestRounds]:
    """The request's speculative state, made at its first decode step; None: plain decoding."""
    req = state.extras.get(NAME)
    if req is None:
        att: Optional[Attachment] = state.target.attachments.get(NAME)
        if att is None or att.drafter is None or state.extras.get("speculative_enabled") is False:
            state.extras[NAME] = False
            # Nobody reads this request's captures: stop recording them.
            state.capture_layers = []
            state.captures.clear()
            return None
        stats = SpecStats(kind=att.drafter.kind)
        state.report[NAME] = stats
        req = RequestRounds(
            session=att.drafter.new_session(state),
            controller=BlockSizeController(
                cap=att.block_size, adaptive=att.settings.adaptive and att.settings.block_size is None
            ),
            stats=stats,
            settings=att.settings,
            vocab_size=int(state.pending_logprobs.shape[-1]) if state.pending_logprobs is not None else 0,
        )
        state.extras[NAME] = req
    return req or None


@hookimpl
def host_decode_step(state: DecodeState) -> Optional[StepOutput]:
    req = rounds_for(state)
    out = run_round(state, req) if req is not None else None
    if req is None or req.failed is not None:
        state.idle_plugins.add(sys.modules[__name__])  # no more rounds for this request
    return out


@hookimpl
def host_batch_refusal(target: LoadedTarget) -> Optional[str]:
    att: Optional[Attachment] = target.attachments.get(NAME)
    if att is None or att.drafter is None:
        return None
    return batch_round.refusal(att.drafter.kind)


@hookimpl
def host_decode_batch(batch: DecodeBatch) -> Optional[List[StepOutput]]:
    att: Optional[Attachment] = batch.target.attachments.get(NAME)
    if att is None or att.drafter is None:
        return None  # the host's own batched one-token step
    return batch_round.run_batch_round(batch, [rounds_for(s) for s in batch.rows])


@hookimpl
def host_add_commands(subparsers: Any) -> None:
    from . import commands

    commands.add_commands(subparsers)


def describe_attachment(target: LoadedTarget) -> List[str]:
    att: Optional[Attachment] = target.attachments.get(NAME)
    if att is None:
        return ["speculative: plugin not active"]
    if att.drafter is None:
        return [att.settings.describe()] + ([f"drafter error: {att.error}"] if att.error else [])
    return [att.settings.describe(), f"drafter: kind={att.drafter.kind} family={att.drafter.family} block_size={att.block_size}"]
