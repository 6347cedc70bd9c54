"""The host's YAML configuration file."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional

import yaml

from .state import HostConfig

SECTIONS = ("model", "server", "generation", "speculative")


class HostConfigError(ValueError):
    pass


def load_host_config(path: Optional[str], overrides: Optional[Dict[str, Dict[str, Any]]] = None, strict: bool = True) -> HostConfig:
    sections: Dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise HostConfigError(f"config file {path!r} not found")
        try:
            sections = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise HostConfigError(f"config file {path!r} is not valid YAML: {str(e).splitlines()[0]}") from e
        if not isinstance(sections, dict):
            raise HostConfigError(f"config file {path!r}: expected a mapping at the top, got {type(sections).__name__}")
        unknown = [k for k in sections if k not in SECTIONS]
        if unknown:
            raise HostConfigError(
                f"config file {path!r}: unknown top-level key {unknown[0]!r} (value {sections[unknown[0]]!r}); allowed: {', '.join(SECTIONS)}"
            )
        if "model" in sections and not isinstance(sections["model"], str):
            raise HostConfigError(f"model: got {sections['model']!r}; allowed: a local path or a Hugging Face repo id")
        for name in ("server", "generation"):
            if name in sections and not isinstance(sections[name], dict):
                raise HostConfigError(f"{name}: got {sections[name]!r}; allowed: a mapping")
    return HostConfig(sections=sections, overrides=overrides or {}, source=path, strict=strict)


def model_or_demo(model: Optional[str], config: HostConfig, speculative_overrides: Dict[str, Any]) -> str:
    """The target to load: the flag, else the config's ``model``, else the embedded tiny demo.

    For the demo, its drafter is used unless speculation was configured or switched off.
    """
    model = model or config.sections.get("model")
    if model is not None:
        return model
    import sys

    from .tiny_models import ensure_demo_pair

    target_dir, drafter_dir = ensure_demo_pair(announce=lambda m: print(m, file=sys.stderr))
    spec = speculative_overrides
    if "speculative" not in config.sections and not spec.get("draft_model") and spec.get("enabled") is not False:
        spec.setdefault("draft_model", str(drafter_dir))
    print(f"[mlx-spec] target {target_dir}", file=sys.stderr)
    return str(target_dir)
