"""All coupling to mlx-lm's OpenAI-compatible server (``mlx_lm.server``) lives here.

The server (``hooks.server``) runs generation through ``hooks.host.Host`` so the speculative plugin
applies; what a request *means* is mlx-lm's: the same parameters with the same defaults, chat
prompts built by the tokenizer's ``apply_chat_template`` (``convert_chat`` without a template),
the same content-part handling, token-level stop sequences (``make_stop_sequences``) and text
clean-up of stop words, reasoning and tool calls (``make_text_state_machine``,
``ToolCallFormatter``), and the same response shapes. On top of mlx-lm, every field it reads is
checked (``hooks.openai_fields``) and a bad one gets a 4xx answer in OpenAI's error shape naming the field;
fields it does not read are ignored as mlx-lm ignores them, but for those that would change the answer
(``REFUSED_FIELDS``).

Tested with mlx-lm 0.32.2 (``TESTED_MLX_LM``); pyproject pins ``mlx-lm>=0.32.2,<0.33``. This module
parses requests; ``hooks.openai_output`` builds what goes back (stop sequences, text clean-up,
response shapes). The names imported from ``mlx_lm`` in the two are the whole surface used.
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import mlx_lm
from mlx_lm.sample_utils import make_logits_processors
from mlx_lm.server import convert_chat, process_message_content

from . import validate
from .openai_fields import APIError, bad_value, checked, described, in_range, typed, unsupported
from .state import LogitsProcessor, SamplingParams

log = logging.getLogger("mlx_speculative.server")

TESTED_MLX_LM = ("0.32.2",)
# mlx-lm's name for "whatever model the server loaded"; clients such as its own examples send it.
DEFAULT_MODEL_ALIAS = "default_model"
MAX_TOP_LOGPROBS = 20


def check_mlx_lm_version() -> Optional[str]:
    """A warning when the installed mlx-lm is not one this module was tested with."""
    version = getattr(mlx_lm, "__version__", "unknown")
    if version not in TESTED_MLX_LM:
        return (f"mlx-lm {version} is installed; the server's request semantics were tested with "
                f"mlx-lm {', '.join(TESTED_MLX_LM)}")
    return None


# Request fields ------------------------------------------------------------------------------

# Accepted by both endpoints (mlx-lm's parameters plus OpenAI's harmless ones).
COMMON_FIELDS = (
    "model", "stream", "stream_options", "max_tokens", "max_completion_tokens", "temperature", "top_p",
    "top_k", "min_p", "seed", "stop", "repetition_penalty", "repetition_context_size", "presence_penalty",
    "presence_context_size", "frequency_penalty", "frequency_context_size", "logit_bias", "logprobs",
    "top_logprobs", "draft_model", "num_draft_tokens", "speculative", "xtc_probability", "xtc_threshold",
    "adapters", "n", "user", "metadata", "store", "service_tier", "response_format",
)
CHAT_FIELDS = ("messages", "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs", "role_mapping")
TEXT_FIELDS = ("prompt", "best_of", "echo", "suffix")
# Fields that would change what comes back and that this server cannot honour: refused (400), not ignored.
REFUSED_FIELDS = {"functions": "tools (OpenAI's legacy functions are not read)",
                  "function_call": "tool_choice (OpenAI's legacy function_call is not read)",
                  "audio": "null (text output only)"}


@dataclass
class ServingLimits:
    """What the server allows; built by the server from its config and the loaded target."""

    model_id: str
    max_tokens: int = 512  # mlx-lm server's default --max-tokens
    context_length: Optional[int] = None
    temperature: float = 0.0  # mlx-lm server's defaults for --temp/--top-p/--top-k/--min-p
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    # Defaults from the host YAML's generation: section (none in mlx-lm's server).
    seed: Optional[int] = None
    repetition_penalty: float = 0.0
    repetition_context_size: int = 20
    logit_bias: Optional[Dict[int, float]] = None
    chat_template_args: Dict[str, Any] = field(default_factory=dict)
    vocab_size: Optional[int] = None
    drafter_names: Tuple[str, ...] = ()  # what a request may send as draft_model
    draft_tokens: Optional[int] = None  # block size - 1 of the attached drafter; None: speculative off


@dataclass
class ParsedRequest:
    kind: str  # "chat" | "text"
    model: str
    prompt: List[int]
    max_tokens: int
    sampling: SamplingParams
    # make_logits_processors' keyword arguments; the processors hold mx arrays, so the
    # generation thread builds them (``logits_processors``), never an HTTP thread.
    logits_args: Dict[str, Any]
    stop_words: List[str]
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    speculative: Optional[bool] = None  # None: the server's setting
    tools: Optional[List[Any]] = None
    initial_state: str = "normal"
    ignored: Tuple[str, ...] = ()  # fields clients send that this server (as mlx-lm's) ignores


def parse_body(raw: bytes) -> Dict[str, Any]:
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not valid UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start}); "
                       "expected JSON in UTF-8", None, "invalid_unicode") from None
    except json.JSONDecodeError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {described(body)}", None, "invalid_json")
    found = validate.lone_surrogate(body)
    if found is not None:
        where, i, char = found
        raise APIError(400, f"{where}: U+{ord(char):04X} at character {i} is a lone surrogate, not text; expected valid "
                       "Unicode (a JSON \\ud800-\\udfff escape only as half of a pair)", where, "invalid_unicode")
    return body


def parse_request(kind: str, body: Dict[str, Any], tokenizer: Any, limits: ServingLimits) -> ParsedRequest:
    """Check every field of a /v1/chat/completions ("chat") or /v1/completions ("text") body."""
    known = COMMON_FIELDS + (CHAT_FIELDS if kind == "chat" else TEXT_FIELDS)
    for name, what in REFUSED_FIELDS.items():
        if body.get(name) is not None:
            raise unsupported(name, body[name], what)
    ignored = tuple(name for name in body if name not in known)
    if ignored:
        log.debug("%s request: ignoring fields %s", kind, ", ".join(ignored))

    model = typed(body, "model", ["str"], DEFAULT_MODEL_ALIAS)
    if model not in (limits.model_id, DEFAULT_MODEL_ALIAS):
        raise APIError(404, f"model: {model!r} is not served here; allowed: {limits.model_id!r} "
                       f"(or {DEFAULT_MODEL_ALIAS!r})", "model", "model_not_found")

    stream = typed(body, "stream", ["bool"], False)
    options = typed(body, "stream_options", ["dict"], {})
    for name, value in options.items():
        if name != "include_usage":
            raise unsupported(f"stream_options.{name}", value, "include_usage")
        if not isinstance(value, bool):
            raise APIError(400, f"stream_options.include_usage: expected a boolean, got {described(value)}",
                           "stream_options.include_usage", "invalid_type")
    include_usage = bool(options.get("include_usage", False))

    requested_max = body.get("max_completion_tokens")
    max_name = "max_completion_tokens" if requested_max is not None else "max_tokens"
    max_tokens = typed(body, max_name, ["int"], None)
    if max_tokens is not None:
        max_tokens = checked(max_name, max_tokens, "max_tokens")

    temperature = checked("temperature", typed(body, "temperature", ["number"], limits.temperature), "temp")
    top_p = checked("top_p", typed(body, "top_p", ["number"], limits.top_p))
    top_k = checked("top_k", typed(body, "top_k", ["int"], limits.top_k))
    min_p = checked("min_p", typed(body, "min_p", ["number"], limits.min_p))
    seed = typed(body, "seed", ["int"], limits.seed)
    if seed is not None:
        seed = checked("seed", seed)

    stop = typed(body, "stop", ["str", "list"], [])
    stop_words = [stop] if isinstance(stop, str) else list(stop)
    for i, w in enumerate(stop_words):
        if not isinstance(w, str) or not w:
            raise bad_value(f"stop[{i}]", w, "a non-empty string")

    logits_args = _logits_args(body, limits)

    logprobs = typed(body, "logprobs", ["bool"], False)
    top_logprobs = typed(body, "top_logprobs", ["int"], 0)
    if top_logprobs != -1:  # mlx-lm's "off"
        in_range("top_logprobs", top_logprobs, lo=0, hi=MAX_TOP_LOGPROBS, allowed=f"an integer from 0 to {MAX_TOP_LOGPROBS}")
    top_logprobs = max(top_logprobs, 0)

    speculative = _speculative_choice(body, limits)

    for name, value in (("xtc_probability", 0.0), ("n", 1), ("best_of", 1)):
        got = typed(body, name, ["number"], value)
        if got != value:
            raise unsupported(name, got, f"{value} (or leave it out)")
    if body.get("adapters") is not None:
        raise unsupported("adapters", body["adapters"], "null: adapters are not loaded by this server")
    typed(body, "xtc_threshold", ["number"], 0.1)
    if typed(body, "echo", ["bool"], False):
        raise unsupported("echo", True, "false")
    if body.get("suffix") is not None:
        raise unsupported("suffix", body["suffix"], "null")
    response_format = typed(body, "response_format", ["dict"], {"type": "text"})
    if response_format.get("type") != "text":
        raise unsupported("response_format", response_format, '{"type": "text"}')
    for name in ("user", "service_tier"):
        typed(body, name, ["str"], None)
    typed(body, "metadata", ["dict"], None)
    typed(body, "store", ["bool"], None)

    tools = None
    if kind == "chat":
        prompt, initial_state, tools = _chat_prompt(body, tokenizer, limits)
        prompt_field = "messages"
    else:
        text = body.get("prompt")
        if text is None:
            raise APIError(400, "prompt: missing; expected a string", "prompt", "missing_field")
        if not isinstance(text, str):
            raise APIError(400, f"prompt: expected a string (one prompt per request), got {described(text)}",
                           "prompt", "invalid_type")
        prompt, initial_state, prompt_field = list(tokenizer.encode(text)), "normal", "prompt"
    prompt = [int(t) for t in prompt]
    if not prompt:
        raise APIError(400, f"{prompt_field}: the prompt encodes to zero tokens; expected at least one", prompt_field, "invalid_value")

    ctx = limits.context_length
    try:
        validate.prompt_fits(len(prompt), ctx, prompt_field)
    except validate.HostConfigError as e:
        raise APIError(400, str(e), prompt_field, "context_length_exceeded") from None
    overflow = validate.completion_overflow(len(prompt), max_tokens or 0, ctx, max_name)
    if overflow is not None and ctx is not None:
        raise APIError(400, f"{overflow}; allowed: at most {ctx - len(prompt)}", max_name, "context_length_exceeded")
    if max_tokens is None:
        max_tokens = limits.max_tokens if ctx is None else min(limits.max_tokens, ctx - len(prompt))

    return ParsedRequest(
        kind=kind, model=model, prompt=prompt, max_tokens=max_tokens,
        sampling=SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed),
        logits_args=logits_args, stop_words=stop_words, stream=stream,
        include_usage=bool(stream and include_usage), logprobs=logprobs, top_logprobs=top_logprobs,
        speculative=speculative, tools=tools, initial_state=initial_state, ignored=ignored,
    )


def logits_processors(request: ParsedRequest) -> List[LogitsProcessor]:
    return make_logits_processors(**request.logits_args)


def _logits_args(body: Dict[str, Any], limits: ServingLimits) -> Dict[str, Any]:
    """mlx-lm's penalties and logit_bias with its defaults (off unless given, or set in generation:)."""
    values: Dict[str, Any] = {}
    for name, default in (("repetition_penalty", limits.repetition_penalty), ("presence_penalty", 0.0),
                          ("frequency_penalty", 0.0)):
        values[name] = checked(name, typed(body, name, ["number"], default))
    for name, default in (("repetition_context_size", limits.repetition_context_size),
                          ("presence_context_size", 20), ("frequency_context_size", 20)):
        values[name] = checked(name, typed(body, name, ["int"], default))
    bias = typed(body, "logit_bias", ["dict"], None)
    if bias is None:
        bias = limits.logit_bias
    else:
        try:
            bias = validate.logit_bias(bias, "logit_bias", limits.vocab_size, text_ok=False)
        except validate.SettingError as e:
            raise bad_value("logit_bias", body["logit_bias"], e.allowed) from None
    return dict(values, logit_bias=bias)


def _speculative_choice(body: Dict[str, Any], limits: ServingLimits) -> Optional[bool]:
    """Per-request on/off: ``speculative`` (this server), ``draft_model``/``num_draft_tokens`` (mlx-lm)."""
    choice = typed(body, "speculative", ["bool"], None)
    draft = typed(body, "draft_model", ["str"], None)
    if draft is not None and draft != DEFAULT_MODEL_ALIAS and draft not in limits.drafter_names:
        allowed = ", ".join(repr(n) for n in (DEFAULT_MODEL_ALIAS,) + limits.drafter_names)
        raise APIError(400, f"draft_model: {draft!r} is not configured on this server; allowed: {allowed}",
                       "draft_model", "invalid_value")
    n = typed(body, "num_draft_tokens", ["int"], None)
    if n is not None:
        allowed = "0 (speculative off for this request)" + (
            f" or {limits.draft_tokens} (the configured block size - 1)" if limits.draft_tokens else "")
        if n != 0 and n != limits.draft_tokens:
            raise bad_value("num_draft_tokens", n, allowed)
        if n == 0:
            choice = False if choice is None else choice
    return choice


def _chat_prompt(body: Dict[str, Any], tokenizer: Any, limits: ServingLimits) -> Tuple[List[int], str, Optional[List[Any]]]:
    messages = body.get("messages")
    if messages is None:
        raise APIError(400, "messages: missing; expected an array of {role, content} objects", "messages", "missing_field")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, f"messages: expected a non-empty array of {{role, content}} objects, got {described(messages)}",
                       "messages", "invalid_type")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise APIError(400, f"messages[{i}]: expected an object, got {described(m)}", f"messages[{i}]", "invalid_type")
        if not isinstance(m.get("role"), str):
            raise APIError(400, f"messages[{i}].role: expected a string, got {described(m.get('role'))}",
                           f"messages[{i}].role", "invalid_type")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise APIError(400, f"messages[{i}].content: expected a string or an array of content parts, got "
                           f"{described(content)}", f"messages[{i}].content", "invalid_type")
        if isinstance(content, list) and not all(isinstance(p, dict) for p in content):
            raise APIError(400, f"messages[{i}].content: every content part must be an object", f"messages[{i}].content",
                           "invalid_type")
    tools = typed(body, "tools", ["list"], None) or None
    tool_choice = body.get("tool_choice")
    if tool_choice not in (None, "auto", "none"):
        raise unsupported("tool_choice", tool_choice, "'auto' or 'none'")
    typed(body, "parallel_tool_calls", ["bool"], None)
    template_kwargs = typed(body, "chat_template_kwargs", ["dict"], None)
    role_mapping = typed(body, "role_mapping", ["dict"], None)
    messages = copy.deepcopy(messages)  # mlx-lm's helpers edit messages in place

    if not getattr(tokenizer, "has_chat_template", False):
        return list(tokenizer.encode(convert_chat(messages, role_mapping))), "normal", tools
    try:
        process_message_content(messages)
    except (ValueError, KeyError, TypeError, json.JSONDecodeError) as e:
        raise APIError(400, f"messages: {e}; only text content parts are supported", "messages", "invalid_value") from None
    args = dict(limits.chat_template_args)
    args.update(template_kwargs or {})
    try:
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools, tokenize=True, **args)
    except Exception as e:  # noqa: BLE001 - jinja raises many types for bad conversations
        raise APIError(400, f"messages: the chat template rejected the conversation: {type(e).__name__}: {e}",
                       "messages", "invalid_value") from None
    return list(prompt), _initial_state(tokenizer, prompt), tools


def _initial_state(tokenizer: Any, prompt: Sequence[int]) -> str:
    """mlx-lm's rule: a prompt that ends inside an open think block starts in "reasoning"."""
    state = "normal"
    if tokenizer.has_thinking and tokenizer.rfind_think_start(prompt) > tokenizer.rfind_think_end(prompt):
        state = "reasoning"
    return tokenizer.response_initial_state or state
