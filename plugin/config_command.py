"""``mlx-spec config``: the resolved settings tree (``--show``: every key, its value and where it came from), and
``--markdown``: docs/configuration.md's table of the ``runtime:`` knobs, written from their registry (hooks/knobs.py).

Every section resolves as ``generate`` / ``serve`` resolve it, with one precedence rule: CLI flag > environment >
YAML > default. The values shown are those a load would use; nothing is loaded.
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Dict, List, NamedTuple

from ..hooks.api import GENERATION_DEFAULTS, GENERATION_KEYS, HostConfig, generation_section, knobs, load_host_config
from .flags import add_flags, overrides
from .settings import KEYS, resolve

SECRET_KEYS = ("server.api_key",)


class Row(NamedTuple):
    key: str  # section.key as written in the YAML
    value: Any
    source: str  # cli | env | yaml | default (env names its variable)


def tree(config: HostConfig) -> List[Row]:
    """Every setting of every section, resolved (the environment read now)."""
    from ..hooks.api import DISTRIBUTED_KEYS, SERVER_KEYS, distributed_settings, server_settings

    model = config.sections.get("model")
    rows = [Row("model", model if model is not None else "demo (none given)", "yaml" if model is not None else "default")]
    server = server_settings(config)
    rows += [Row(f"server.{k}", getattr(server, k), _env(server.sources.get(k, "default"), "MLX_SPEC_API_KEY"))
             for k in SERVER_KEYS]
    gen = generation_section(config.section("generation"))
    rows += [Row(f"generation.{k}", gen.get(k, GENERATION_DEFAULTS.get(k)), "yaml" if k in gen else "default")
             for k in GENERATION_KEYS]
    spec = resolve(config.section("speculative") if "speculative" in config.sections else None,
                   cli=config.overrides.get("speculative"), where=config.where)
    from .settings import ENV as SPEC_ENV

    rows += [Row(f"speculative.{k}", getattr(spec, k), _env(spec.sources.get(k, "default"), SPEC_ENV.get(k, "")))
             for k in KEYS]
    if spec.enabled and "enabled" not in spec.sources:  # turned on by the layer that gave a speculative setting
        on = "yaml" if "speculative" in config.sections else ("cli" if any(
            v is not None for v in config.overrides.get("speculative", {}).values()) else "env")
        rows[-len(KEYS)] = rows[-len(KEYS)]._replace(source=on)
    dist = distributed_settings(config.sections.get("distributed"), where=config.where)
    section = config.section("distributed")
    rows += [Row(f"distributed.{k}", getattr(dist, k) if dist is not None else None,
                 "yaml" if k in section else "default") for k in DISTRIBUTED_KEYS]
    for name, s in knobs.resolved(config.sections.get(knobs.SECTION), config.overrides.get(knobs.SECTION),
                                  where=config.where).items():
        shown = knobs.cache_root() if name == "cache_dir" and s.value is None else s.value
        rows.append(Row(f"{knobs.SECTION}.{name}", shown, _env(s.source, s.field)))
    return rows


def _env(source: str, variable: str) -> str:
    return f"env ({variable})" if source == "env" and variable else source


def _shown(row: Row) -> Any:
    if row.key in SECRET_KEYS and row.value is not None:
        return "***"
    if isinstance(row.value, tuple):
        return list(row.value)
    return row.value


def render(rows: List[Row]) -> str:
    width = max(len(r.key) for r in rows)
    values = [json.dumps(_shown(r)) if not isinstance(_shown(r), str) else _shown(r) for r in rows]
    vwidth = min(max(len(v) for v in values), 40)
    return "\n".join(f"{r.key:<{width}}  {v:<{vwidth}}  {r.source}" for r, v in zip(rows, values)) + "\n"


def cmd_config(args: argparse.Namespace) -> int:
    if args.markdown:
        print(knobs.table_markdown(), end="")
        return 0
    config = load_host_config(args.config, {"speculative": overrides(args)})
    rows = tree(config)
    if args.json:
        out: Dict[str, Dict[str, Any]] = {r.key: {"value": _shown(r), "source": r.source} for r in rows}
        print(json.dumps(out, indent=1, default=str))
    else:
        print(render(rows), end="")
    return 0


def add_command(subparsers: Any) -> None:
    p = subparsers.add_parser("config", help="print the resolved settings: every key, its value and where it came "
                              "from (cli / env / yaml / default)")
    p.add_argument("--show", action="store_true", help="print the resolved tree (the default)")
    p.add_argument("--config", help="host YAML file")
    p.add_argument("--json", action="store_true", help="print JSON: {key: {value, source}}")
    p.add_argument("--markdown", action="store_true", help="print docs/configuration.md's table of the runtime: knobs")
    add_flags(p)
    p.set_defaults(func=cmd_config)
