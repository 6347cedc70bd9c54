"""The generation and response side of mlx-lm's OpenAI-compatible server, the twin of
``hooks.openai_compat`` (which parses requests): token-level stop sequences and the text state
machine (``make_stop_sequences``, ``make_text_state_machine``), log-probabilities, the text
clean-up of stop words, reasoning and tool calls (``ToolCallFormatter``) and mlx-lm's response
shapes. The names imported from ``mlx_lm`` below are the whole surface used here.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx_lm
from mlx_lm.generate import StopSequences, TextStateMachine, make_stop_sequences, make_text_state_machine
from mlx_lm.server import ToolCallFormatter

# Generation-side helpers (run on the generation thread) ----------------------------------------

_STOP_CACHE: Dict[Tuple[int, Tuple[str, ...]], Tuple[StopSequences, TextStateMachine]] = {}


def stop_machinery(tokenizer: Any, stop_words: Sequence[str]) -> Tuple[StopSequences, TextStateMachine]:
    """mlx-lm's token-level stop automaton (EOS + stop words) and its text state machine, cached."""
    key = (id(tokenizer), tuple(stop_words))
    found = _STOP_CACHE.get(key)
    if found is None:
        if len(_STOP_CACHE) > 100:
            _STOP_CACHE.clear()
        found = _STOP_CACHE[key] = (make_stop_sequences(tokenizer, list(stop_words)),
                                    make_text_state_machine(tokenizer, list(stop_words)))
    return found


def logprob_entry(tokenizer: Any, logprobs: mx.array, token: int, top_n: int) -> Dict[str, Any]:
    """The token's log-probability and the ``top_n`` most likely tokens (logprobs: [V]), mlx-lm's shape."""
    entry: Dict[str, Any] = {"id": int(token), "token": tokenizer.convert_ids_to_tokens([int(token)])[0],
                             "logprob": float(logprobs[token].item())}
    if top_n > 0:
        top = mx.argpartition(-logprobs, kth=top_n - 1)[:top_n]  # [top_n]
        ids, values = top.tolist(), logprobs[top].tolist()
        order = sorted(range(top_n), key=lambda i: -values[i])
        names = tokenizer.convert_ids_to_tokens([ids[i] for i in order])
        entry["top_logprobs"] = [{"id": ids[i], "token": n, "logprob": values[i]} for i, n in zip(order, names)]
    return entry


# Output assembly (run on the HTTP thread) -------------------------------------------------------

class ResponseText:
    """mlx-lm's text clean-up: strips stop words and control markers, splits reasoning and tool calls."""

    def __init__(self, tokenizer: Any, text_sm: TextStateMachine, tools: Optional[List[Any]],
                 initial_state: str, streaming: bool):
        self.sm_state = text_sm.make_state(initial_state)
        self.prev = initial_state
        self.current = initial_state
        self.formatter = ToolCallFormatter(tokenizer.tool_parser, tools, streaming)
        self.text = ""
        self.reasoning = ""
        self.tool_text = ""
        self.tool_calls: List[str] = []
        self.made_tool_call = False

    def feed(self, text: str, finish_reason: Optional[str]) -> None:
        if finish_reason == "stop":
            self.sm_state, current = TextStateMachine.discard(self.sm_state)
            segments = [(current, "")]
        elif finish_reason == "length":
            self.sm_state, segments = TextStateMachine.split(self.sm_state, text)
            self.sm_state, flushed, current = TextStateMachine.flush(self.sm_state)
            segments.append((current, flushed))
        else:
            self.sm_state, segments = TextStateMachine.split(self.sm_state, text)
        for state, clean in segments:
            if state == "reasoning":
                self.reasoning += clean
            elif state == "tool":
                self.tool_text += clean
            elif state == "normal":
                if self.prev == "tool":
                    self.tool_calls.append(self.tool_text)
                    self.tool_text = ""
                    self.made_tool_call = True
                self.text += clean
            self.prev = state
        self.current = self.prev

    def finish(self, finish_reason: str) -> str:
        if self.prev == "tool" and self.tool_text:
            self.tool_calls.append(self.tool_text)
            self.made_tool_call = True
        return "tool_calls" if finish_reason == "stop" and self.made_tool_call else finish_reason

    def ready(self) -> bool:
        """Something to stream (mlx-lm holds text back while inside a tool call)."""
        return self.current != "tool" and bool(self.text or self.tool_calls or self.reasoning)

    def take(self) -> Tuple[str, str, List[Dict[str, Any]]]:
        out = (self.text, self.reasoning, self.formatter(self.tool_calls))
        self.text, self.reasoning, self.tool_calls = "", "", []
        return out


def response_body(
    kind: str, request_id: str, model: str, created: int, fingerprint: str, stream: bool,
    text: str, finish_reason: Optional[str], reasoning: str = "", tool_calls: Optional[List[Dict[str, Any]]] = None,
    logprobs: Optional[List[Dict[str, Any]]] = None,
) -> Dict[str, Any]:
    """One response object (or stream chunk) in mlx-lm's shape."""
    obj = ("chat.completion.chunk" if stream else "chat.completion") if kind == "chat" else "text_completion"
    choice: Dict[str, Any] = {"index": 0, "finish_reason": finish_reason}
    if logprobs:
        choice["logprobs"] = {"content": logprobs}
    if kind == "chat":
        key = "delta" if stream else "message"
        message: Dict[str, Any] = {"role": "assistant"}
        if not stream:
            message["content"] = text if text else None
        elif text:
            message["content"] = text
        if reasoning:
            message["reasoning"] = reasoning
        if tool_calls:
            message["tool_calls"] = tool_calls
        choice[key] = message
    else:
        choice["text"] = text
    return {"id": request_id, "system_fingerprint": fingerprint, "object": obj, "model": model,
            "created": created, "choices": [choice]}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Dict[str, Any]:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens reused from the prompt cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def system_fingerprint() -> str:
    return f"mlx-speculative-{getattr(mlx_lm, '__version__', 'unknown')}-{mx.__version__}"
