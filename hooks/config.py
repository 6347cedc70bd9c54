"""The host's YAML configuration file."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Dict, Optional

import pluggy
import yaml

from . import knobs, validate
from .loading import DEMO_TARGET, resolve_relative
from .state import HostConfig
from .validate import HostConfigError, SettingError

SECTIONS = ("model", "server", "generation", "speculative", "distributed", knobs.SECTION)
# Values that name a checkpoint: relative paths are read from the YAML file's folder.
PATH_KEYS = (("model",), ("speculative", "draft_model"))

__all__ = ["HostConfigError", "SECTIONS", "load_host_config", "model_or_demo", "plugin_overrides"]


def _key_lines(node: Any, path: str, source: str, out: Dict[str, int]) -> None:
    """Each key's 1-based line (``generation.temp`` -> 4) into ``out``; a key given twice in one mapping
    is an error (YAML loaders would keep the last one silently)."""
    if not isinstance(node, yaml.MappingNode):
        return
    seen: Dict[str, int] = {}
    for k, v in node.value:
        if not isinstance(k, yaml.ScalarNode):
            continue
        name = f"{path}.{k.value}" if path else str(k.value)
        line = k.start_mark.line + 1
        if k.value in seen:
            raise HostConfigError(f"{source}:{line}: {name}: duplicate key (first at line {seen[k.value]}); "
                                  "allowed: each key once", name)
        seen[k.value] = out[name] = line
        _key_lines(v, name, source, out)


def _utf8_text(raw: bytes, path: str) -> str:
    """The file's text; YAML files are UTF-8, so other bytes are refused with their line and column."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        column = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise HostConfigError(f"{path}:{line}:{column}: not valid UTF-8 (byte 0x{raw[e.start]:02x}); expected a UTF-8 "
                              "text file (re-save it as UTF-8)") from None


def _check_sections(sections: Dict[str, Any]) -> None:
    """Every value with a rule, before anything loads (the plugin checks its own keys again)."""
    from .server_settings import server_value

    if "generation" in sections:
        validate.generation_section(sections["generation"])
    for key, value in sections.get("server", {}).items():
        server_value(key, value, f"server.{key}")
    if "distributed" in sections:
        from .distributed import settings

        settings(sections["distributed"])
    knobs.check_section(sections.get(knobs.SECTION))
    spec = sections.get("speculative")
    if isinstance(spec, dict):
        if "block_size" in spec:
            validate.block_size(spec["block_size"])
        if "ngram_n" in spec:
            validate.check("ngram_n", spec["ngram_n"], "speculative.ngram_n", text_ok=False)


def load_host_config(path: Optional[str], overrides: Optional[Dict[str, Dict[str, Any]]] = None, strict: bool = True) -> HostConfig:
    sections: Dict[str, Any] = {}
    lines: Dict[str, int] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise HostConfigError(f"config file {path!r} not found")
        text = _utf8_text(p.read_bytes(), path)
        try:
            _key_lines(yaml.compose(text, Loader=yaml.SafeLoader), "", path, lines)
            sections = yaml.safe_load(text) or {}
        except yaml.MarkedYAMLError as e:
            mark = e.problem_mark or e.context_mark
            where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else path
            raise HostConfigError(f"{where}: not valid YAML: {e.problem or e.context}"
                                  + (f" ({e.context})" if e.problem and e.context else "")) from e
        except yaml.YAMLError as e:
            raise HostConfigError(f"config file {path!r} is not valid YAML: {str(e).splitlines()[0]}") from e
        if not isinstance(sections, dict):
            raise HostConfigError(f"config file {path!r}: expected a mapping at the top, got {type(sections).__name__}")
        config = HostConfig(source=path, lines=lines)
        try:
            unknown = [k for k in sections if k not in SECTIONS]
            if unknown:
                raise HostConfigError(f"{unknown[0]}: unknown top-level key (value {sections[unknown[0]]!r}); "
                                      f"allowed: {', '.join(SECTIONS)}", str(unknown[0]))
            if "model" in sections and not isinstance(sections["model"], str):
                raise SettingError("model", sections["model"], "a local path or a Hugging Face repo id")
            for name in ("server", "generation"):
                if name in sections and not isinstance(sections[name], dict):
                    raise SettingError(name, sections[name], "a mapping")
            _check_sections(sections)
        except HostConfigError as e:
            if e.field is None:
                raise
            raise HostConfigError(f"{config.where(e.field)}{e}", e.field) from e
        base = p.resolve().parent
        for keys in PATH_KEYS:
            owner = sections if len(keys) == 1 else sections.get(keys[0])
            if isinstance(owner, dict) and isinstance(owner.get(keys[-1]), str):
                owner[keys[-1]] = resolve_relative(owner[keys[-1]], base)
        runtime = sections.get(knobs.SECTION)
        if isinstance(runtime, dict) and isinstance(runtime.get("cache_dir"), str):  # a folder, never a repo id
            runtime["cache_dir"] = str(base / Path(runtime["cache_dir"]).expanduser())
    return HostConfig(sections=sections, overrides=overrides or {}, source=path, strict=strict, lines=lines)


def plugin_overrides(pm: pluggy.PluginManager, args: argparse.Namespace, command: str) -> Dict[str, Dict[str, Any]]:
    """The configuration values the plugins' flags set (``host_overrides``), by section, checked before any model
    loads."""
    out: Dict[str, Dict[str, Any]] = {}
    for part in pm.hook.host_overrides(args=args, command=command):
        for section, values in part.items():
            out.setdefault(section, {}).update(values)
    return out


def model_or_demo(model: Optional[str], config: HostConfig, pm: pluggy.PluginManager) -> str:
    """The target to load: the flag, else the config's ``model``, else the embedded demo target, with what the
    plugins pair with it (``host_demo``: their values join ``config.overrides``)."""
    model = model or config.sections.get("model")
    if model is not None:
        return model
    parts = pm.hook.host_demo(config=config)
    for part in parts:
        for section, values in part.overrides.items():
            config.overrides.setdefault(section, {}).update(values)
    paired = "".join(f", {part.label}" for part in parts)
    print(f"[mlx-spec] no model given: target {DEMO_TARGET!r}{paired} (the embedded demo pair)", file=sys.stderr)
    return DEMO_TARGET
