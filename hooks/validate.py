"""Every setting's allowed values, in one place.

The CLI, the host YAML and the server's requests check values with these rules, so that a bad
value reads the same everywhere: ``<field>: got <value>; allowed: <what is allowed>``, where the
field is what the user wrote (``--temp``, ``generation.temp``, ``temperature``). Checks that need
only the arguments run before any model loads; ``logit_bias`` token ids are checked against the
vocabulary once it is known.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple, Union

MAX_BLOCK = 128
MAX_SEED = 2**64 - 1


class HostConfigError(ValueError):
    """A bad configuration (YAML, flags, environment); the message says what to fix. ``field``: the
    setting as written (``generation.temp``), so that a YAML error can name its file and line."""

    def __init__(self, message: str, field: Optional[str] = None):
        super().__init__(message)
        self.field = field


class SettingError(HostConfigError):
    """One bad value: ``field: got X; allowed: Y`` (the parts stay readable for other renderings)."""

    def __init__(self, field: str, got: Any, allowed: str, shown: Optional[str] = None):
        self.got, self.allowed = got, allowed
        super().__init__(f"{field}: got {shown if shown is not None else show(got)}; allowed: {allowed}", field)


def show(value: Any) -> str:
    """A received value as the user wrote it: strings quoted, true/false/null as in YAML and JSON."""
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, (bool, type(None))):
        return json.dumps(value)
    return str(value)


@dataclass(frozen=True)
class Rule:
    type: str  # "int" | "number"
    allowed: str
    lo: Optional[float] = None
    hi: Optional[float] = None
    lo_open: bool = False

    def admits(self, x: Union[int, float]) -> bool:
        if self.lo is not None and (x < self.lo or (self.lo_open and x == self.lo)):
            return False
        return self.hi is None or x <= self.hi


RULES: Dict[str, Rule] = {
    # sampling (mlx-lm's meanings: temp 0 is greedy, top_p 1 / top_k 0 / min_p 0 are off)
    "temp": Rule("number", "a number >= 0 (0: greedy)", lo=0),
    "top_p": Rule("number", "a number in (0, 1]", lo=0, hi=1, lo_open=True),
    "top_k": Rule("int", "an integer >= 0 (0: off)", lo=0),
    "min_p": Rule("number", "a number in [0, 1] (0: off)", lo=0, hi=1),
    # mlx-lm's generate_step reads -1 as "no limit"; here a request always has a limit.
    "max_tokens": Rule("int", "an integer >= 1", lo=1),
    "seed": Rule("int", "an integer from 0 to 2**64 - 1", lo=0, hi=MAX_SEED),
    # mlx-lm's make_logits_processors: a penalty of 0 (its server's default) adds no processor.
    "repetition_penalty": Rule("number", "a number >= 0 (0: off; 1: no change)", lo=0),
    "repetition_context_size": Rule("int", "an integer >= 1 (tokens looked back)", lo=1),
    "presence_penalty": Rule("number", "a number (0: off)"),
    "frequency_penalty": Rule("number", "a number (0: off)"),
    "presence_context_size": Rule("int", "an integer >= 0", lo=0),
    "frequency_context_size": Rule("int", "an integer >= 0", lo=0),
    # speculative
    "ngram_n": Rule("int", "an integer from 1 to 32", lo=1, hi=32),
    # server
    "port": Rule("int", "an integer from 0 to 65535 (0: a free port)", lo=0, hi=65535),
    "context_length": Rule("int", "an integer >= 1", lo=1),
    "max_active": Rule("int", "an integer >= 1", lo=1),
    "max_queue": Rule("int", "an integer >= 0 (0: no queue, 503 when all are active)", lo=0),
    "prefill_step_size": Rule("int", "an integer >= 1", lo=1),
    "prompt_cache_size": Rule("int", "an integer >= 0 (entries kept; 0: off)", lo=0),
    "warmup_rows": Rule("int", "an integer >= 0 (batches of 1..N rows decoded before serving; 0: off)", lo=0),
    "warmup_tokens": Rule("int", "an integer >= 0 (keys the warm-up's longest row reaches; 0: short prompts only)", lo=0),
    # generate
    "max_kv_size": Rule("int", "an integer >= 1 (positions the cache keeps; older ones are dropped)", lo=1),
    # mlx-lm's count of draft tokens per round: the block size - 1 (0: speculative off, as in requests)
    "num_draft_tokens": Rule("int", f"an integer from 0 to {MAX_BLOCK - 1} (the block size - 1; 0: speculative off)",
                             lo=0, hi=MAX_BLOCK - 1),
}
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _parse(rule: Rule, value: Any, text_ok: bool) -> Optional[Union[int, float]]:
    """The number ``value`` stands for, or None when it is not one of ``rule.type``."""
    if isinstance(value, str) and text_ok:
        text = value.strip()
        try:
            value = int(text)
        except ValueError:
            try:
                value = float(text)
            except ValueError:
                return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    if rule.type == "int":
        if isinstance(value, float):
            if not value.is_integer():
                return None
            value = int(value)
        return value
    return value


def check(name: str, value: Any, field: Optional[str] = None, text_ok: bool = True) -> Union[int, float]:
    """``value`` of setting ``name`` (a key of RULES), as a number; ``text_ok``: parse strings
    (flags, environment, a quoted YAML value), else only JSON numbers pass (requests)."""
    rule = RULES[name]
    field = field or name
    n = _parse(rule, value, text_ok)
    if n is None or not rule.admits(n):
        raw = value.strip() if isinstance(value, str) and n is not None else None
        raise SettingError(field, value, rule.allowed, shown=raw)
    return float(n) if rule.type == "number" else int(n)


def optional(name: str, value: Any, field: Optional[str] = None, text_ok: bool = True) -> Optional[Union[int, float]]:
    return None if value is None else check(name, value, field, text_ok)


def block_size(value: Any, field: str = "speculative.block_size") -> Optional[int]:
    """'auto' (None: the drafter's own) or an integer from 2 to MAX_BLOCK."""
    allowed = f"'auto' or an integer from 2 to {MAX_BLOCK}"
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None
    n = _parse(Rule("int", allowed), value, text_ok=True)
    if n is None or not 2 <= n <= MAX_BLOCK:
        raise SettingError(field, value, allowed, shown=value.strip() if isinstance(value, str) and n is not None else None)
    return int(n)


BYTES_ALLOWED = ("a number of bytes >= 0 (0: off), a size such as '8GB', '512MB' or '4GiB', or 'auto' "
                 "(a quarter of the device memory left after the model's weights)")
_UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9,
          "T": 10**12, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def byte_size(value: Any, field: str) -> Optional[int]:
    """A size in bytes: an integer, or text with a unit (decimal K/M/G/T[B] as mlx-lm's
    ``--prompt-cache-bytes``, binary KiB/MiB/GiB/TiB); 'auto' or null: None (the default)."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None
    if isinstance(value, str):
        text = value.strip().replace(" ", "").replace("_", "")
        digits = len(text) - len(text.lstrip("0123456789."))
        unit = _UNITS.get(text[digits:].upper())
        try:
            number = float(text[:digits]) if digits and unit is not None else None
        except ValueError:
            number = None
        if number is not None and math.isfinite(number) and number * unit == int(number * unit):
            return int(number * unit)
        raise SettingError(field, value, BYTES_ALLOWED)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < 0 or int(value) != value:
        raise SettingError(field, value, BYTES_ALLOWED)
    return int(value)


def flag(value: Any, field: str) -> bool:
    """true or false (also t/f as mlx-lm's ``--verbose`` reads them, 1/0, yes/no, on/off)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "t", "1", "yes", "on", "false", "f", "0", "no", "off"):
        return value.strip().lower() in ("true", "t", "1", "yes", "on")
    raise SettingError(field, value, "true or false")


LOGIT_BIAS_ALLOWED = 'an object mapping token ids to numbers, e.g. {"12": -100, "40": 2.5}'


def logit_bias(value: Any, field: str = "logit_bias", vocab_size: Optional[int] = None,
               text_ok: bool = True) -> Optional[Dict[int, float]]:
    """mlx-lm's logit_bias as its server accepts it: {token id: additive bias}. A flag's value is
    that object as JSON text. Token ids are checked against ``vocab_size`` when it is given."""
    if value is None:
        return None
    given = value
    if isinstance(value, str) and text_ok:
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise SettingError(field, given, LOGIT_BIAS_ALLOWED) from None
    if not isinstance(value, Mapping):
        raise SettingError(field, given, LOGIT_BIAS_ALLOWED)
    out: Dict[int, float] = {}
    for k, v in value.items():
        try:
            if isinstance(k, bool) or isinstance(v, bool) or isinstance(v, str):
                raise ValueError
            token, bias = int(k), float(v)
            if isinstance(k, float) or not math.isfinite(bias):
                raise ValueError
        except (TypeError, ValueError):
            raise SettingError(field, given, LOGIT_BIAS_ALLOWED, shown=_short(given)) from None
        out[token] = bias
    if vocab_size is not None:
        bad = sorted(t for t in out if not 0 <= t < vocab_size)
        if bad:
            raise SettingError(field, given, f"token ids from 0 to {vocab_size - 1} (this model's vocab_size is "
                               f"{vocab_size}); {bad[0]} is outside", shown=_short(given))
    return out


def _short(value: Any) -> str:
    text = show(value) if not isinstance(value, Mapping) else json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


# The host YAML's ``generation:`` section; `generate` has a flag for each (hooks/cli.py).
GENERATION_KEYS = ("max_tokens", "temp", "top_p", "top_k", "min_p", "seed", "repetition_penalty",
                   "repetition_context_size", "logit_bias")


def generation_value(key: str, value: Any, field: str, vocab_size: Optional[int] = None) -> Any:
    """One ``generation:`` value (or its flag's text) checked; None stays None (unset)."""
    if key == "logit_bias":
        return logit_bias(value, field, vocab_size)
    return optional(key, value, field)


def generation_section(values: Mapping[str, Any], prefix: str = "generation") -> Dict[str, Any]:
    """The ``generation:`` section checked key by key (unknown keys are refused)."""
    out: Dict[str, Any] = {}
    for key, value in values.items():
        if key not in GENERATION_KEYS:
            raise HostConfigError(f"{prefix}.{key}: unknown key (value {show(value)}); allowed keys: "
                                  f"{', '.join(GENERATION_KEYS)}", f"{prefix}.{key}")
        out[key] = generation_value(key, value, f"{prefix}.{key}")
    return out


def choice(value: Any, field: str, allowed: Sequence[str]) -> str:
    """One of ``allowed`` (case-insensitive), as spelled there."""
    if isinstance(value, str):
        for a in allowed:
            if value.strip().lower() == a.lower():
                return a
    raise SettingError(field, value, ", ".join(allowed))


def json_object(value: Any, field: str, allowed: str) -> Dict[str, Any]:
    """A mapping, or its JSON text (a flag's value)."""
    parsed = value
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = None
    if not isinstance(parsed, dict):
        raise SettingError(field, value, allowed)
    return parsed


def origins(value: Any, field: str) -> Tuple[str, ...]:
    """mlx-lm's ``--allowed-origins``: '*' or comma-separated origins (a list in the YAML)."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(o, str) for o in items):
        raise SettingError(field, value, "'*' or comma-separated origins such as 'http://localhost:3000'")
    out = tuple(o.strip() for o in items if o.strip())
    if not out or any(o != "*" and "://" not in o for o in out):
        raise SettingError(field, value, "'*' or comma-separated origins such as 'http://localhost:3000'")
    return out


def token(value: str, field: str, vocab: Mapping[str, int], vocab_size: int) -> int:
    """A token as mlx-lm's ``add_eos_token`` takes it: its text in the vocabulary, or its id."""
    if value in vocab:
        return vocab[value]
    if value.strip().isdigit() and int(value) < vocab_size:
        return int(value)
    raise SettingError(field, value, f"a token of this tokenizer: its text as in the vocabulary, or its id from 0 to "
                       f"{vocab_size - 1}")


# -- text -----------------------------------------------------------------------------------------

def utf8_text(value: Union[str, bytes], field: str) -> Tuple[str, Optional[str]]:
    """Text the user gave (a flag's value, stdin's bytes) as valid Unicode, and a warning when it was not
    valid UTF-8: such bytes become U+FFFD. A flag's bytes reach Python as lone surrogates (the
    filesystem encoding's ``surrogateescape``), turned back into those bytes first."""
    raw = value if isinstance(value, bytes) else None
    if raw is None:
        try:
            value.encode("utf-8")
            return value, None
        except UnicodeEncodeError:
            raw = value.encode("utf-8", "surrogateescape" if _escaped_bytes_only(value) else "surrogatepass")
    try:
        return raw.decode("utf-8"), None
    except UnicodeDecodeError as e:
        return (raw.decode("utf-8", "replace"),
                f"{field}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start}); such bytes were replaced by U+FFFD")


def _escaped_bytes_only(text: str) -> bool:
    return all(not 0xD800 <= ord(c) <= 0xDFFF or 0xDC80 <= ord(c) <= 0xDCFF for c in text)


def lone_surrogate(value: Any, path: str = "") -> Optional[Tuple[str, int, str]]:
    """(where, index, the character) of the first lone surrogate in a parsed JSON value's strings (keys
    included), or None: JSON's escapes allow one ("\\udce9"), UTF-8 cannot encode it, so no tokenizer takes it."""
    if isinstance(value, str):
        for i, c in enumerate(value):
            if 0xD800 <= ord(c) <= 0xDFFF:
                return path, i, c
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            where = f"{path}.{k}" if path else str(k)
            found = lone_surrogate(k, where) or lone_surrogate(v, where)
            if found:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found = lone_surrogate(v, f"{path}[{i}]")
            if found:
                return found
    return None


# -- the context length ---------------------------------------------------------------------------

def prompt_fits(prompt_tokens: int, context: Optional[int], field: str) -> None:
    """The server's rule, the CLI's too: a prompt leaves room for at least one completion token."""
    if context is not None and prompt_tokens >= context:
        raise HostConfigError(f"{field}: the prompt has {prompt_tokens} tokens; this model's context length is "
                              f"{context} tokens (prompt plus completion)", field)


def completion_overflow(prompt_tokens: int, max_tokens: int, context: Optional[int], field: str) -> Optional[str]:
    """Why ``max_tokens`` does not fit after the prompt (None: it fits); the server refuses the request
    with it, the CLI generates ``context - prompt_tokens`` tokens and says so."""
    if context is None or prompt_tokens + max_tokens <= context:
        return None
    return (f"{field}: {prompt_tokens} prompt tokens + {max_tokens} completion tokens exceed the context length "
            f"of {context} tokens")


def context_length(model_config: Mapping[str, Any]) -> Optional[int]:
    """The model config's ``max_position_embeddings`` (a VLM's ``text_config``'s), or None."""
    return model_config.get("max_position_embeddings") or (model_config.get("text_config") or {}).get(
        "max_position_embeddings")
