"""``mlx-spec drafters``, ``check`` and ``config`` (plugin/config_command.py), added to the host CLI through ``host_add_commands``."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..drafters import registry
from ..drafters.base import DraftTarget
from ..hooks.api import loading


def cmd_drafters(args: argparse.Namespace) -> int:
    fams = registry.families()
    rows = [(f.kind, f.name, f.distribution, f.description) for f in sorted(fams.values(), key=lambda f: (f.kind, f.name))]
    if args.json:
        print(json.dumps([dict(zip(("kind", "family", "distribution", "description"), r)) for r in rows], indent=1))
        return 0
    print(f"{'kind':<12} {'family':<16} {'from':<24} description")
    for kind, name, dist, desc in rows:
        print(f"{kind:<12} {name:<16} {dist:<24} {desc}")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    target_path = loading.resolve_path(args.model, "model")
    target_config = loading.read_config(target_path, "model")
    # Every header of the target's files (no tensor is read); a corrupt file is an error.
    target_headers = loading.safetensors_headers(target_path, "model", required=False)
    num_layers = target_config.get("num_hidden_layers") or (target_config.get("text_config") or {}).get("num_hidden_layers")
    target = DraftTarget(config=target_config, path=target_path, num_layers=num_layers)
    resolution = registry.resolve(args.draft_model, args.draft_kind, target)
    verdict = registry.check(resolution, target)
    verdict.notes.append("target " + registry.describe_headers(target_headers))
    report: dict[str, Any] = {
        "kind": resolution.kind,
        "family": resolution.family.name,
        "compatible": verdict.ok,
        "reasons": verdict.reasons,
        "checked": verdict.notes,
        "warnings": resolution.warnings,
    }
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        for w in resolution.warnings:
            print(f"warning: {w}")
        print(f"kind: {resolution.kind} (family {resolution.family.name})")
        print("verdict: " + ("compatible" if verdict.ok else "NOT compatible"))
        for r in verdict.reasons:
            print(f"  x {r}")
        for n in verdict.notes:
            print(f"  ok {n}")
    return 0 if verdict.ok else 1


def add_commands(subparsers: Any) -> None:
    p = subparsers.add_parser("drafters", help="list registered drafter kinds and families")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_drafters)

    p = subparsers.add_parser("check", help="resolve a drafter's kind and check it against a target")
    p.add_argument("--model", required=True, help="target model: path, HF repo id or 'demo'")
    p.add_argument("--draft-model", default=None, help="drafter: path, HF repo id or 'demo-drafter' (none for ngram, or for mtp heads inside the target)")
    p.add_argument("--draft-kind", default="auto", help="auto or a registered kind")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_check)

    from .config_command import add_command as add_config  # mlx-spec config --show

    add_config(subparsers)
    from .train_command import add_command as add_train  # mlx-spec train-drafter
    add_train(subparsers)
