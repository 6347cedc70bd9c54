"""The ``runtime:`` settings: the library's switches that are also environment variables, in one typed registry.

Each knob has a YAML key (``runtime.<name>``), an environment variable (read exactly as before: the same
names, values and defaults), a type and a default. Precedence, as for every section: **CLI > environment >
YAML > default** (an explicit argument such as the bench's ``--kernel`` is the CLI layer: the functions that
take a mode use it before asking here).

Data flows one way. The host checks the section when it reads the YAML (``check_section``) and installs the
YAML and CLI layers when it loads a target (``install``, from ``Host.load``); code asks ``value(name)`` (or
``setting(name)`` for the field to name in an error). The installed layers are this module's only state
(``_loaded``): a snapshot replaced by each load, never written elsewhere. The environment is read when a value is
asked for, so that a variable set in a running process (the tests' ``monkeypatch.setenv``) is seen as before;
the callers ask at load (the cache policy, draft-ahead and lazy drafts when the plugin attaches), not at import.
``table_markdown()`` writes docs/configuration.md's table of them (tests/test_knobs.py checks it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Tuple

from .validate import HostConfigError, SettingError

SECTION = "runtime"
KERNEL_MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class Knob:
    """One setting: ``runtime.<name>`` and $``env``. ``from_env`` reads the variable's text as the library always
    has (an unset or blank variable is no value); ``from_yaml`` checks a YAML value; both raise ``SettingError``
    naming the field."""

    name: str
    env: str
    default: Any  # the value when no layer sets one (None: the code's own, e.g. per-mask-kind thresholds)
    shown_default: str  # the default as the docs show it
    allowed: str  # what a value may be, for errors and the docs
    help: str  # one line for the docs and `mlx-spec config --show`
    from_env: Callable[[str, str], Any]
    from_yaml: Callable[[Any, str], Any]
    doc: str = ""  # a link into the docs: "gpu.md#shape-stable-caches"


# -- parsers: (value, field) -> the typed value ---------------------------------------------------------------

def _choice(choices: Tuple[str, ...]) -> Tuple[Callable[[str, str], str], Callable[[Any, str], str]]:
    """A mode: the variable's text stripped and lower-cased (as the library read it); in the YAML also true / false,
    which is what YAML makes of an unquoted on / off."""
    allowed = ", ".join(choices)

    def env(text: str, name: str) -> str:
        mode = text.strip().lower()
        if mode not in choices:
            raise SettingError(name, mode, allowed)
        return mode

    def yaml(value: Any, name: str) -> str:
        if isinstance(value, bool):
            value = "on" if value else "off"
        if not isinstance(value, str):
            raise SettingError(name, value, allowed)
        return env(value, name)

    return env, yaml


def _int(lo: int, allowed: str) -> Tuple[Callable[[str, str], int], Callable[[Any, str], int]]:
    def env(text: str, name: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise SettingError(name, text, allowed) from None
        if n < lo:
            raise SettingError(name, n, allowed)
        return n

    def yaml(value: Any, name: str) -> int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise SettingError(name, value, allowed)
        return env(value, name) if isinstance(value, str) else env(str(value), name)

    return env, yaml


def _flag(yaml_value: Any, name: str) -> bool:
    from .validate import flag

    return flag(yaml_value, name)


def _blas(value: Any, name: str) -> str:
    """hooks/blas.py checks the value itself (a library path must exist); an unquoted YAML off is false."""
    if isinstance(value, bool):
        return "auto" if value else "off"
    if not isinstance(value, str):
        raise SettingError(name, value, "auto, openblas, off, or the path of an LP64 BLAS library")
    return value.strip()


def _path(value: Any, name: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise SettingError(name, value, "a folder path")
    return value


_MODE_ENV, _MODE_YAML = _choice(KERNEL_MODES)
_AHEAD_ENV, _AHEAD_YAML = _choice(("on", "verify", "off"))
_PREWARM = _int(0, "an integer >= 0 (0: no pre-warming)")
_MIN_KEYS = _int(0, "a non-negative integer (keys)")

KNOBS: Dict[str, Knob] = {k.name: k for k in (
    Knob("padded_cache", "MLX_SPEC_PADDED_CACHE", "auto", "`auto`", "auto, on, off",
         "shape-stable padded caches (auto: on for CUDA, off for CPU and Metal)", _MODE_ENV, _MODE_YAML,
         "gpu.md#shape-stable-caches"),
    Knob("prewarm_tokens", "MLX_SPEC_PREWARM_TOKENS", 4096, "4096", "an integer >= 0 (0: no pre-warming)",
         "prompt positions up to which the padded caches' shapes (and compiled traces) are pre-warmed at load",
         *_PREWARM),
    Knob("attention_kernel", "MLX_SPEC_ATTENTION_KERNEL", "auto", "`auto`", "auto, on, off",
         "the short-query CUDA attention kernel (auto: on where MLX runs on CUDA; `on` elsewhere is an error)",
         _MODE_ENV, _MODE_YAML, "gpu.md#short-query-attention-kernel"),
    Knob("attention_min_keys", "MLX_SPEC_ATTENTION_MIN_KEYS", None, "4096 (no mask / causal), 1024 (described masks)",
         "a non-negative integer (keys)", "key length from which the kernel takes a call; one number sets both",
         *_MIN_KEYS),
    Knob("projection_kernel", "MLX_SPEC_PROJECTION_KERNEL", "auto", "`auto`", "auto, on, off",
         "the verify-width bf16/fp16 matmul kernel for 2..16 rows", _MODE_ENV, _MODE_YAML,
         "gpu.md#verify-width-projection-kernel"),
    Knob("quantized_kernel", "MLX_SPEC_QUANTIZED_KERNEL", "auto", "`auto`", "auto, on, off",
         "the verify-width 4-bit matmul kernel", _MODE_ENV, _MODE_YAML, "gpu.md#verify-width-4-bit-kernel"),
    Knob("compiled_forward", "MLX_SPEC_COMPILED_FORWARD", "auto", "`auto`", "auto, on, off",
         "verify forwards traced once per shape with `mx.compile` (auto: on where MLX runs on CUDA)",
         _MODE_ENV, _MODE_YAML, "gpu.md#compiled-verify-forwards"),
    Knob("compiled_batches", "MLX_SPEC_COMPILED_BATCHES", True, "`true` (`on`)", "true or false (the variable: off or on)",
         "false (`off`): a batch's compiled calls (rows at their own lengths) run plainly; one row's stay compiled",
         lambda text, name: text.strip().lower() != "off", _flag),
    Knob("draft_ahead", "MLX_SPEC_DRAFT_AHEAD", "on", "`on`", "on, verify, off",
         "queue the next round's drafting (and with `verify`, its verify forward) before reading this round's "
         "outcome; applies on MLX-CUDA", _AHEAD_ENV, _AHEAD_YAML, "gpu.md#drafting-ahead"),
    Knob("lazy_drafts", "MLX_SPEC_LAZY_DRAFTS", True, "`true` (`1`)", "true or false (the variable: 0 or 1)",
         "false (`0`): evaluate each proposal before the verify is built (for measurements)",
         lambda text, name: text.strip() != "0", _flag),
    Knob("cache_dir", "MLX_SPEC_CACHE", None, "`~/.cache/mlx-speculative`", "a folder path",
         "where GGUF checkpoints are converted on first use (`gguf/`) and the benchmarks' random test pair is kept "
         "(`random-pair/`); relative to the YAML file's folder", lambda text, name: text, _path),
    Knob("offline", "HF_HUB_OFFLINE", False, "`false` (unset)", "true or false (the variable: 1, true or yes)",
         "Hugging Face repo ids resolve from the local cache only, never the network",
         lambda text, name: text.lower() in ("1", "true", "yes"), _flag),
    Knob("blas", "MLX_SPEC_BLAS", "", "unset (a one-line hint when MLX's reference BLAS is in use)",
         "auto, openblas, off, or the path of an LP64 BLAS library",
         "Linux CPU: `auto` re-executes `mlx-spec` once with OpenBLAS preloaded where found; `openblas` (or an "
         "error); a library's path; `off` (no hint). Read from the `--config` file before MLX loads",
         lambda text, name: text.strip(), _blas, "usage.md#linux-cpu-an-optimised-blas"),
)}


class Setting(NamedTuple):
    value: Any
    source: str  # cli | env | yaml | default
    field: str  # what to name in an error: the variable, `runtime.<name>` (with its file and line), the flag


@dataclass(frozen=True)
class Layers:
    """The YAML and CLI layers the host installed (values checked), and where YAML keys are."""

    yaml: Mapping[str, Any] = field(default_factory=dict)
    cli: Mapping[str, Any] = field(default_factory=dict)
    where: Callable[[str], str] = lambda key: ""


_loaded = Layers()  # the snapshot: replaced by install() at each load, read by setting()


def check_section(section: Any, where: Callable[[str], str] = lambda key: "") -> Dict[str, Any]:
    """The ``runtime:`` section's values, checked (an unknown key or a bad value names the key, its file and line)."""
    if section is None:
        return {}
    if not isinstance(section, Mapping):
        raise HostConfigError(f"{where(SECTION)}{SECTION}: got {section!r}; allowed: a mapping of "
                              f"{', '.join(KNOBS)}", SECTION)
    out: Dict[str, Any] = {}
    for key, value in section.items():
        name = f"{SECTION}.{key}"
        knob = KNOBS.get(key)
        if knob is None:
            raise HostConfigError(f"{where(name)}{name}: unknown key (value {value!r}); allowed keys: "
                                  f"{', '.join(KNOBS)}", name)
        try:
            out[key] = knob.from_yaml(value, name)
        except SettingError as e:
            raise HostConfigError(f"{where(name)}{e}", name) from None
    return out


def install(section: Any = None, cli: Optional[Mapping[str, Any]] = None,
            where: Callable[[str], str] = lambda key: "") -> None:
    """Make ``section`` (the YAML's ``runtime:``) and ``cli`` (values of flags, by knob name) the layers under and
    over the environment; ``install()`` alone: none (the environment and the defaults)."""
    global _loaded
    flags = {k: v for k, v in (cli or {}).items() if v is not None}
    unknown = [k for k in flags if k not in KNOBS]
    if unknown:
        raise HostConfigError(f"{unknown[0]}: not a runtime setting; allowed: {', '.join(KNOBS)}", unknown[0])
    _loaded = Layers(check_section(section, where), flags, where)


def setting(name: str, environ: Optional[Mapping[str, str]] = None, layers: Optional[Layers] = None) -> Setting:
    """Knob ``name``'s value and where it came from: the CLI layer, else $env (read now), else the YAML, else the
    default. A bad variable raises ``SettingError`` naming it."""
    knob = KNOBS[name]
    layers = _loaded if layers is None else layers
    environ = os.environ if environ is None else environ
    if name in layers.cli:
        return Setting(knob.from_yaml(layers.cli[name], f"--{name.replace('_', '-')}"), "cli",
                       f"--{name.replace('_', '-')}")
    text = environ.get(knob.env)
    if text is not None and text.strip():
        return Setting(knob.from_env(text, knob.env), "env", knob.env)
    key = f"{SECTION}.{name}"
    if name in layers.yaml:
        return Setting(layers.yaml[name], "yaml", f"{layers.where(key)}{key}")
    return Setting(knob.default, "default", knob.env)


def value(name: str) -> Any:
    """Knob ``name``'s value (``setting``'s)."""
    return setting(name).value


def resolved(section: Any = None, cli: Optional[Mapping[str, Any]] = None, environ: Optional[Mapping[str, str]] = None,
             where: Callable[[str], str] = lambda key: "") -> Dict[str, Setting]:
    """Every knob as these layers resolve it (``mlx-spec config --show``); installs nothing."""
    layers = Layers(check_section(section, where), {k: v for k, v in (cli or {}).items() if v is not None}, where)
    return {name: setting(name, environ, layers) for name in KNOBS}


def cache_root() -> str:
    """The library's cache folder: ``runtime.cache_dir`` / $MLX_SPEC_CACHE, else ~/.cache/mlx-speculative."""
    return value("cache_dir") or os.path.join(os.path.expanduser("~"), ".cache", "mlx-speculative")


def table_markdown() -> str:
    """docs/configuration.md's table of the runtime knobs (between its ``knobs`` markers)."""
    rows: List[str] = ["| key | variable | default | allowed | what it does |", "|---|---|---|---|---|"]
    for k in KNOBS.values():
        more = f" ([{k.doc.split('#')[0]}]({k.doc}))" if k.doc else ""
        rows.append(f"| `{SECTION}.{k.name}` | `{k.env}` | {k.shown_default} | {k.allowed} | {k.help}{more} |")
    return "\n".join(rows) + "\n"
