"""The ``speculative:`` settings: YAML section, MLX_VLM_* environment, CLI flags.

Precedence: CLI flag > environment > YAML > the drafter's config (block size) > defaults.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Mapping, Optional

from ..hooks.api import validate

ENV = {
    "kind": "MLX_VLM_DRAFT_KIND",
    "draft_model": "MLX_VLM_DRAFT_MODEL",
    "block_size": "MLX_VLM_DRAFT_BLOCK_SIZE",
}
KEYS = ("enabled", "draft_model", "kind", "block_size", "adaptive", "acceptance", "ngram_n")
# The flags of `generate` / `serve` that set keys (an error names what the user wrote)
FLAGS = {"enabled": "--no-speculative", "draft_model": "--draft-model", "kind": "--draft-kind",
         "block_size": "--draft-block-size"}
ACCEPTANCE = ("rejection", "exact")
MAX_BLOCK = validate.MAX_BLOCK
log = logging.getLogger("mlx_speculative")


class ConfigError(validate.HostConfigError):
    """A bad setting: names the key as written (YAML key with its file and line, variable, flag), the
    value received and what is allowed."""


@dataclass
class SpeculativeSettings:
    enabled: bool = False
    draft_model: Optional[str] = None
    kind: str = "auto"
    block_size: Optional[int] = None  # None: "auto", the drafter's default
    adaptive: bool = True
    acceptance: str = "rejection"
    ngram_n: int = 3
    sources: Dict[str, str] = field(default_factory=dict)  # key -> cli | env | yaml | default

    def describe(self) -> str:
        def shown(k: str) -> str:
            value = getattr(self, k)
            return "auto" if k == "block_size" and value is None else repr(value)

        parts = [f"{k}={shown(k)} ({self.sources.get(k, 'default')})" for k in KEYS if k != "enabled"]
        return ", ".join(parts)

    def sources_text(self) -> str:
        """Where the settings came from, e.g. "draft_model: cli, kind: env" (or "defaults")."""
        return ", ".join(f"{k}: {self.sources[k]}" for k in KEYS if k in self.sources) or "defaults"


def _validate(key: str, value: Any, kinds: list[str], field: str) -> Any:
    """One value checked; ``field``: the key as the user wrote it."""
    try:
        if key in ("enabled", "adaptive"):
            return validate.flag(value, field)
        if key == "block_size":
            return validate.block_size(value, field)
        if key == "draft_model":
            if value is None or (isinstance(value, str) and value.strip()):
                return value.strip() if isinstance(value, str) else None
            raise validate.SettingError(field, value, "a local path or a Hugging Face repo id")
        if key == "kind":
            return validate.choice(value, field, ["auto"] + kinds)
        if key == "acceptance":
            return validate.choice(value, field, ACCEPTANCE)
        if key == "ngram_n":
            return validate.check("ngram_n", value, field, text_ok=False)
    except validate.SettingError as e:
        raise ConfigError(str(e), field) from None
    raise AssertionError(key)


def resolve(
    yaml_section: Optional[Mapping[str, Any]],
    cli: Optional[Mapping[str, Any]] = None,
    environ: Optional[Mapping[str, str]] = None,
    kinds: Optional[list[str]] = None,
    weightless: Optional[list[str]] = None,
    where: Callable[[str], str] = lambda key: "",
) -> SpeculativeSettings:
    """Merge the layers into settings; ``enabled`` follows from any layer asking for a drafter.

    An explicit kind that needs no drafter weights (``weightless``, e.g. ngram) wins over a
    configured draft model, which is then dropped with one log line. ``where(key)``: the YAML file and
    line of ``speculative.<key>`` for errors (``HostConfig.where``).
    """
    from ..drafters import registry

    kinds = kinds if kinds is not None else registry.kinds()
    weightless = weightless if weightless is not None else registry.weightless_kinds()
    environ = os.environ if environ is None else environ
    if yaml_section is not None and not isinstance(yaml_section, Mapping):
        raise ConfigError(f"speculative: got {type(yaml_section).__name__}; allowed: a mapping of {', '.join(KEYS)}")
    settings = SpeculativeSettings()
    layers = [
        ("yaml", dict(yaml_section or {})),
        ("env", {k: environ[v] for k, v in ENV.items() if environ.get(v, "").strip()}),
        ("cli", {k: v for k, v in (cli or {}).items() if v is not None}),
    ]
    for source, values in layers:
        for key, value in values.items():
            field = {"yaml": f"speculative.{key}", "env": ENV.get(key, ""), "cli": FLAGS.get(key, key)}[source]
            try:
                if key not in KEYS:
                    raise ConfigError(f"{field}: unknown key (value {value!r}); allowed keys: {', '.join(KEYS)}", field)
                setattr(settings, key, _validate(key, value, kinds, field))
            except ConfigError as e:
                if source != "yaml":
                    raise
                raise ConfigError(f"{where(field)}{e}", field) from None
            settings.sources[key] = source
    explicit_on = yaml_section is not None or any(v for _, v in layers[1:])
    if "enabled" not in settings.sources:
        settings.enabled = explicit_on
    if settings.kind in weightless and settings.draft_model is not None:
        log.warning("%s", registry.ignored_draft_model(settings.kind, settings.draft_model, settings.sources.get("kind"),
                                                       settings.sources.get("draft_model")))
        settings.draft_model = None
        settings.sources["draft_model"] = f"ignored for kind {settings.kind!r}"
    return settings
