"""The server's settings: the ``server:`` YAML section, the API-key variable, CLI flags; request defaults."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from .config import HostConfigError
from .state import HostConfig

SERVER_KEYS = ("host", "port", "api_key", "max_tokens", "context_length", "max_active", "max_queue",
               "model_name", "chat_template_args", "prefill_step_size", "batching")
API_KEY_ENV = "MLX_SPEC_API_KEY"


@dataclass
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: Optional[str] = None
    max_tokens: int = 512
    context_length: Optional[int] = None  # default: the model config's max_position_embeddings
    max_active: int = 8
    max_queue: int = 64
    model_name: Optional[str] = None  # the id clients send as "model"; default: the model spec
    chat_template_args: Dict[str, Any] = field(default_factory=dict)
    prefill_step_size: int = 2048
    batching: bool = True  # batched decode steps (one target forward for all rows) where the target allows
    sources: Dict[str, str] = field(default_factory=dict)


def _int_setting(key: str, value: Any, lo: int, hi: Optional[int] = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise HostConfigError(f"server.{key}: got {value!r}; allowed: an integer >= {lo}")
    try:
        n = int(value)
    except ValueError:
        raise HostConfigError(f"server.{key}: got {value!r}; allowed: an integer >= {lo}") from None
    if n < lo or (hi is not None and n > hi):
        raise HostConfigError(f"server.{key}: got {n}; allowed: an integer from {lo}" + (f" to {hi}" if hi else " up"))
    return n


def server_settings(config: HostConfig, environ: Optional[Dict[str, str]] = None) -> ServerSettings:
    """The ``server:`` section; precedence CLI > environment (API key only) > YAML > defaults."""
    environ = os.environ if environ is None else environ
    layers = [("yaml", config.section("server"))]
    if environ.get(API_KEY_ENV):
        layers.append(("env", {"api_key": environ[API_KEY_ENV]}))
    layers.append(("cli", {k: v for k, v in config.overrides.get("server", {}).items() if v is not None}))
    out = ServerSettings()
    for source, values in layers:
        for key, value in values.items():
            if key not in SERVER_KEYS:
                raise HostConfigError(f"server.{key}: unknown key (value {value!r}); allowed keys: {', '.join(SERVER_KEYS)}")
            if key in ("host", "api_key", "model_name"):
                if not isinstance(value, str) or not value.strip():
                    raise HostConfigError(f"server.{key}: got {value!r}; allowed: a non-empty string")
                value = value.strip()
            elif key == "port":
                value = _int_setting(key, value, 0, 65535)
            elif key == "batching":
                if not isinstance(value, bool):
                    raise HostConfigError(f"server.{key}: got {value!r}; allowed: true or false")
            elif key == "chat_template_args":
                if not isinstance(value, dict):
                    raise HostConfigError(f"server.{key}: got {value!r}; allowed: a mapping of template arguments")
            else:
                value = _int_setting(key, value, 1 if key != "max_queue" else 0)
            setattr(out, key, value)
            out.sources[key] = source
    return out


def request_defaults(config: HostConfig, settings: ServerSettings) -> Dict[str, Any]:
    """Defaults for fields a request leaves out: ``generation:`` (as for `generate`), then mlx-lm's."""
    gen = config.section("generation")
    out: Dict[str, Any] = {}
    for key, name, cast in (("temp", "temperature", float), ("top_p", "top_p", float), ("top_k", "top_k", int),
                            ("min_p", "min_p", float), ("max_tokens", "max_tokens", int)):
        if key in gen:
            try:
                out[name] = cast(gen[key])
            except (TypeError, ValueError):
                raise HostConfigError(f"generation.{key}: got {gen[key]!r}; expected {'an integer' if cast is int else 'a number'}") from None
    if "max_tokens" in settings.sources or "max_tokens" not in out:
        out["max_tokens"] = settings.max_tokens
    return out


def serve_overrides(args: argparse.Namespace) -> Dict[str, Any]:
    return {k: getattr(args, k, None) for k in ("host", "port", "api_key", "max_tokens", "context_length",
                                                "max_active", "max_queue", "model_name")}
