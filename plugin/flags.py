"""The plugin's command line and the demo pairing, added to the host's commands through hooks.

``--draft-model``, ``--draft-kind``, ``--draft-block-size``, ``--num-draft-tokens`` and ``--no-speculative`` on
``mlx-spec generate`` and ``serve`` (``host_add_arguments``), read back as ``speculative:`` overrides before any
model loads (``host_overrides``); the demo drafter paired with the host's demo target when no speculative setting
was given (``host_demo``). ``mlx-spec config`` takes the same flags.
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Dict, Mapping, Optional

from ..hooks.api import HostConfig, validate

DRAFT_HELP = "drafter: path (a folder or a .gguf file), HF repo id, or 'demo-drafter'"
COMMANDS = ("generate", "serve")  # the host's commands that take the flags
ENV_PREFIX = "MLX_VLM_DRAFT_"  # any such variable set (plugin/settings.py ENV) is a speculative setting


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft-model", help=DRAFT_HELP)
    p.add_argument("--draft-kind", help="auto or a registered kind (see `mlx-spec drafters`)")
    p.add_argument("--draft-block-size", help="positions verified per round, or 'auto'")
    p.add_argument("--num-draft-tokens", help="mlx-lm's flag: draft tokens per round, i.e. the block size - 1 "
                   "(--num-draft-tokens 3 = --draft-block-size 4); 0: plain decoding")
    p.add_argument("--no-speculative", action="store_true", help="plain one-token decoding")


def overrides(args: argparse.Namespace) -> Dict[str, Any]:
    """The ``speculative:`` values the flags set, checked before any model loads."""
    spec: Dict[str, Any] = {}
    if args.draft_model is not None:
        spec["draft_model"] = args.draft_model
    if args.draft_kind is not None:
        spec["kind"] = args.draft_kind
    if args.draft_block_size is not None:
        validate.block_size(args.draft_block_size, "--draft-block-size")
        spec["block_size"] = args.draft_block_size
    n = getattr(args, "num_draft_tokens", None)
    if n is not None:
        n = validate.check("num_draft_tokens", n, "--num-draft-tokens")
        pinned = validate.block_size(args.draft_block_size, "--draft-block-size")
        if n and pinned is not None and pinned != n + 1:
            raise validate.SettingError("--num-draft-tokens", n, f"{pinned - 1} (--draft-block-size {pinned}: "
                                        "the block holds the pending token and the draft tokens), or leave one out")
        if n:
            spec["block_size"] = n + 1
        else:
            spec["enabled"] = False
    if args.no_speculative:
        spec["enabled"] = False
    return spec


def configured(config: HostConfig, environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether some speculative setting was given: a YAML ``speculative:`` section, a flag, an MLX_VLM_DRAFT_*
    variable (switching speculation off counts)."""
    environ = os.environ if environ is None else environ
    return ("speculative" in config.sections
            or any(v is not None for v in config.overrides.get("speculative", {}).values())
            or any(k.startswith(ENV_PREFIX) and v.strip() for k, v in environ.items()))


def off_reason(args: argparse.Namespace, config: HostConfig) -> Optional[str]:
    """Why a run had no speculative decoding at all (its tokens all came from plain steps); None: no setting
    turned it off (the drafter drafted nothing for this request)."""
    spec = config.overrides.get("speculative", {})  # the flags' values and the demo drafter's
    if getattr(args, "no_speculative", False):
        return "--no-speculative"
    if spec.get("enabled") is False:
        return "--num-draft-tokens 0"
    enabled = config.section("speculative").get("enabled")
    if enabled is not None and not validate.flag(enabled, "speculative.enabled"):
        return f"{config.where('speculative.enabled')}speculative.enabled: false"
    if not spec and not config.section("speculative"):
        return "no --draft-model or --draft-kind given"
    return None
