"""A request body's fields checked one by one, and the error a bad one gets (``APIError``: OpenAI's error shape).

``hooks.openai_compat`` reads what the fields mean (mlx-lm's server API); here: a field's JSON type
(``typed``), its value against a range or the shared rule of hooks/validate.py (``in_range``, ``checked``),
and the 4xx errors that name the field, what it got and what is allowed.
"""

from __future__ import annotations

import json
import math
from typing import Any, Dict, Optional, Sequence

from . import validate


class APIError(Exception):
    """A request the server refuses: HTTP status plus OpenAI's error object."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None, type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_

    def to_dict(self) -> Dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


_TYPE_NAMES = {type(None): "null", bool: "boolean", int: "integer", float: "number", str: "string",
               list: "array", dict: "object"}


def described(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return f"{_TYPE_NAMES.get(type(value), type(value).__name__)} {text[:60]}"


def is_kind(value: Any, kind: str) -> bool:
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return isinstance(value, {"bool": bool, "str": str, "list": list, "dict": dict}[kind])


_EXPECTED = {"int": "an integer", "number": "a number", "bool": "a boolean", "str": "a string",
             "list": "an array", "dict": "an object"}


def typed(body: Dict[str, Any], name: str, kinds: Sequence[str], default: Any) -> Any:
    """``body[name]`` checked against ``kinds``; ``default`` when absent or null."""
    value = body.get(name)
    if value is None:
        return default
    if not any(is_kind(value, k) for k in kinds):
        expected = " or ".join(_EXPECTED[k] for k in kinds)
        raise APIError(400, f"{name}: expected {expected}, got {described(value)}", name, "invalid_type")
    return value


def bad_value(name: str, value: Any, allowed: str) -> APIError:
    return APIError(400, f"{name}: got {described(value)}; allowed: {allowed}", name, "invalid_value")


def in_range(name: str, value: float, lo: Optional[float] = None, hi: Optional[float] = None,
             lo_open: bool = False, allowed: str = "") -> None:
    if (lo is not None and (value < lo or (lo_open and value == lo))) or (hi is not None and value > hi):
        raise bad_value(name, value, allowed)


def checked(name: str, value: Any, rule: Optional[str] = None) -> Any:
    """``value`` (already of the right JSON type) against the shared rule (hooks/validate.py)."""
    try:
        return validate.check(rule or name, value, name, text_ok=False)
    except validate.SettingError as e:
        raise bad_value(name, value, e.allowed) from None


def unsupported(name: str, value: Any, allowed: str) -> APIError:
    return APIError(400, f"{name}: {described(value)} is not supported by this server; allowed: {allowed}",
                    name, "unsupported_parameter")
