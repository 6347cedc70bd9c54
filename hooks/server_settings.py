"""``mlx-spec serve``'s settings: the ``server:`` section, its flags, and the request defaults.

Precedence: CLI flag > environment (API key only) > YAML > defaults. Every value is checked with
the shared rules (hooks/validate.py) before the model loads; so is the port (``check_port``).
"""

from __future__ import annotations

import argparse
import errno
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from . import validate
from .state import HostConfig
from .validate import HostConfigError, SettingError

SERVER_KEYS = ("host", "port", "api_key", "max_tokens", "context_length", "max_active", "max_queue",
               "model_name", "chat_template", "chat_template_args", "prefill_step_size", "batching",
               "prompt_cache_bytes", "prompt_cache_size", "allowed_origins", "log_level", "warmup_rows", "warmup_tokens")
API_KEY_ENV = "MLX_SPEC_API_KEY"
# `serve`'s flags that set server: keys (argparse dest = key)
FLAG_KEYS = ("host", "port", "api_key", "max_tokens", "context_length", "max_active", "max_queue", "model_name",
             "prompt_cache_bytes", "prompt_cache_size", "prefill_step_size", "chat_template", "chat_template_args",
             "allowed_origins", "log_level", "warmup_rows", "warmup_tokens")
# `serve`'s flags that set generation: keys, the defaults of requests (mlx-lm's server flags)
GENERATION_FLAG_KEYS = ("temp", "top_p", "top_k", "min_p")
CHAT_TEMPLATE = "a chat template: Jinja text, or a file holding it"
CHAT_TEMPLATE_ARGS = 'a JSON object of apply_chat_template arguments, e.g. \'{"enable_thinking": false}\''


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
    chat_template: Optional[str] = None  # instead of the tokenizer's (Jinja text)
    chat_template_args: Dict[str, Any] = field(default_factory=dict)
    prefill_step_size: int = 2048
    batching: bool = True  # batched decode steps (one target forward for all rows) where the target allows
    # Bytes of finished requests' caches kept for later requests (0: off; None: the default,
    # hooks/prompt_cache.default_bytes: (device memory - the target's weights) / 4).
    prompt_cache_bytes: Optional[int] = None
    prompt_cache_size: Optional[int] = None  # at most this many entries (None: no bound but the bytes)
    allowed_origins: Tuple[str, ...] = ("*",)  # CORS, as mlx-lm's server
    log_level: Optional[str] = None  # None: INFO (DEBUG with mlx-spec -v)
    # Batches of 1 .. N rows decoded before serving (hooks/warmup.py); None: max_active on CUDA, else 0.
    warmup_rows: Optional[int] = None
    # Keys the warm-up's longest row reaches (one batch per cache bucket); None: 2048.
    warmup_tokens: Optional[int] = None
    sources: Dict[str, str] = field(default_factory=dict)


def server_value(key: str, value: Any, field_name: str) -> Any:
    """One ``server:`` value checked; ``field_name`` is what the user wrote (server.port, --port)."""
    if key not in SERVER_KEYS:
        raise HostConfigError(f"{field_name}: unknown key (value {value!r}); allowed keys: {', '.join(SERVER_KEYS)}",
                              field_name)
    if key in ("host", "api_key", "model_name"):
        if not isinstance(value, str) or not value.strip():
            raise SettingError(field_name, value, "a non-empty string")
        return value.strip()
    if key == "chat_template":
        if not isinstance(value, str) or not value.strip():
            raise SettingError(field_name, value, CHAT_TEMPLATE)
        return _template_text(value, field_name)
    if key == "allowed_origins":
        return validate.origins(value, field_name)
    if key == "log_level":
        return validate.choice(value, field_name, validate.LOG_LEVELS)
    if key == "batching":
        if not isinstance(value, bool):
            raise SettingError(field_name, value, "true or false")
        return value
    if key == "prompt_cache_bytes":
        return validate.byte_size(value, field_name)
    if key == "chat_template_args":
        return validate.json_object(value, field_name, CHAT_TEMPLATE_ARGS)
    return validate.check(key, value, field_name)


def _template_text(value: str, field_name: str) -> str:
    """A chat template given as Jinja text (it has ``{`` or a newline), or the UTF-8 text of the file it names."""
    if "\n" in value or "{" in value:
        return value
    path = Path(value).expanduser()
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise SettingError(field_name, value, f"{CHAT_TEMPLATE} (no Jinja '{{' in it, and {path} cannot be read: "
                           f"{e.strerror or e})") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SettingError(field_name, value, f"{CHAT_TEMPLATE} in UTF-8 ({path} has byte 0x{raw[e.start]:02x} at offset "
                           f"{e.start})") from None


def server_settings(config: HostConfig, environ: Optional[Dict[str, str]] = None) -> ServerSettings:
    """The ``server:`` section with the environment and the flags on top, every value checked."""
    environ = os.environ if environ is None else environ
    layers = [("yaml", config.section("server"))]
    if environ.get(API_KEY_ENV):
        layers.append(("env", {"api_key": environ[API_KEY_ENV]}))
    layers.append(("cli", {k: v for k, v in config.overrides.get("server", {}).items() if v is not None}))
    out = ServerSettings()
    for source, values in layers:
        for key, value in values.items():
            name = {"yaml": f"server.{key}", "env": API_KEY_ENV, "cli": "--" + key.replace("_", "-")}[source]
            setattr(out, key, server_value(key, value, name))
            out.sources[key] = source
    return out


def request_defaults(config: HostConfig, settings: ServerSettings) -> Dict[str, Any]:
    """Defaults for fields a request leaves out: ``generation:`` (as for `generate`), then mlx-lm's.

    Returns ServingLimits' keyword arguments (hooks/openai_compat.py)."""
    gen = validate.generation_section(config.section("generation"))
    for key, value in config.overrides.get("generation", {}).items():
        if value is not None:
            gen[key] = validate.generation_value(key, value, "--" + key.replace("_", "-"))
    names = {"temp": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "max_tokens": "max_tokens",
             "seed": "seed", "repetition_penalty": "repetition_penalty",
             "repetition_context_size": "repetition_context_size", "logit_bias": "logit_bias"}
    out = {names[k]: v for k, v in gen.items() if v is not None}
    if "max_tokens" in settings.sources or "max_tokens" not in out:
        out["max_tokens"] = settings.max_tokens
    return out


def serve_overrides(args: argparse.Namespace) -> Dict[str, Dict[str, Any]]:
    """The ``server:`` and ``generation:`` values of `serve`'s flags."""
    return {"server": {k: getattr(args, k, None) for k in FLAG_KEYS},
            "generation": {k: getattr(args, k, None) for k in GENERATION_FLAG_KEYS}}


def check_port(host: str, port: int) -> None:
    """Refuse a port that cannot be bound, before the model loads (the server binds it after)."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise SettingError("server.host", host, f"an address of this machine ({e.strerror})") from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # As the server binds (allow_reuse_address): a port left in TIME_WAIT is free.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as e:
            why = "is already in use" if e.errno == errno.EADDRINUSE else f"cannot be bound ({e.strerror})"
            raise HostConfigError(f"server.port: {host}:{port} {why}; allowed: a free port (--port), "
                                  "or 0 to pick one") from None
