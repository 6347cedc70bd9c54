"""Real inputs for ``mlx-spec bench``: drafter checkpoints and text prompts.

Drafters load through the registry exactly as ``mlx-spec generate --draft-model PATH`` loads them
(``registry.resolve`` with kind auto, ``registry.load`` with the target's ``DraftTarget`` and the
bench's cache policy), so their proposals, and the tau measured, are the real ones.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

from ..drafters import registry
from ..hooks.api import Backend, LoadedTarget
from ..plugin.hookimpls import draft_target


@dataclass
class DrafterSpec:
    path: str
    block: Optional[int] = None  # None: every --block-sizes, or the drafter's own default block


def parse_drafter(text: str) -> DrafterSpec:
    """``PATH`` or ``PATH@B`` (B: this drafter's block size)."""
    path, sep, block = text.rpartition("@")
    if not sep or not block.isdigit():
        return DrafterSpec(text)
    b = int(block)
    if not path or not 2 <= b <= 128:
        raise ValueError(f"--drafter: got {text!r}; expected PATH or PATH@B with B from 2 to 128 (e.g. ckpt/dflash@16)")
    return DrafterSpec(path, b)


def check(s: Any) -> None:
    """Combinations refused before anything loads."""
    if not s.drafters and not s.prompts_file:
        return
    if s.synthetic_target and s.drafters:
        raise ValueError("--drafter: real drafter checkpoints need a real target (--model PATH); got --synthetic-target "
                         f"{s.synthetic_target!r}, whose random weights no checkpoint was trained on")
    if s.synthetic_target and s.prompts_file:
        raise ValueError(f"--prompts-file: text prompts need the target's tokenizer (--model PATH); got --synthetic-target "
                         f"{s.synthetic_target!r}, which has none")
    if s.drafters and s.draft_model:
        raise ValueError(f"--draft-model {s.draft_model!r} with --drafter: give the draft LM as one more --drafter PATH "
                         "(mlx-lm's speculative loop then uses it)")
    if s.drafters and s.kind not in ("auto", "ngram"):
        raise ValueError(f"--kind {s.kind} with --drafter: allowed: auto (the drafters' own kinds, read from their "
                         "checkpoints) or ngram (adds the n-gram drafter)")


def blocks_for(spec_block: Optional[int], block_sizes: List[int], default: int) -> List[int]:
    return [spec_block] if spec_block else (list(block_sizes) or [int(default)])


def load_drafters(s: Any, target: LoadedTarget, policy: Optional[Backend]
                  ) -> Tuple[Dict[str, Any], Dict[str, Dict[str, Any]]]:
    """(kind -> (drafter, draft LM module or None, description), kind -> checkpoint record)."""
    drafters: Dict[str, Any] = {}
    info: Dict[str, Dict[str, Any]] = {}
    padded = policy is not None and policy.shape_stable
    for spec in map(parse_drafter, s.drafters):
        resolution = registry.resolve(spec.path, "auto")
        for warning in resolution.warnings:
            print(f"[bench] {warning}", file=sys.stderr)
        if resolution.kind in drafters:
            raise ValueError(f"--drafter {spec.path!r}: a second {resolution.kind} drafter (the first: "
                             f"{info[resolution.kind]['path']!r}); allowed: one drafter per kind")
        explicit = [spec.block] if spec.block else s.block_sizes
        options = {"ngram_n": 3, "block_size": max(explicit) if explicit else None}
        drafter = registry.load(resolution, draft_target(target, policy), options)
        blocks = blocks_for(spec.block, s.block_sizes, drafter.default_block_size)
        lm = drafter.model if resolution.kind == "draft_model" else None
        desc = (f"{resolution.family.name} checkpoint {spec.path} (kind {resolution.kind}, blocks "
                f"{','.join(map(str, blocks))}, real drafts)" + (", padded caches" if padded else ""))
        drafters[resolution.kind] = (drafter, lm, desc)
        info[resolution.kind] = {"path": spec.path, "resolved_path": str(resolution.path), "kind": resolution.kind,
                                 "family": resolution.family.name, "blocks": blocks,
                                 "default_block": int(drafter.default_block_size), "warnings": list(resolution.warnings)}
    if s.kind == "ngram":
        from ..drafters.base import DraftTarget
        from ..drafters.ngram import family as ngram_family

        drafter = ngram_family.load(None, {}, DraftTarget(config=target.model_config), {"ngram_n": 3})
        blocks = blocks_for(None, s.block_sizes, drafter.default_block_size)
        drafters["ngram"] = (drafter, None, f"ngram (n=3, blocks {','.join(map(str, blocks))})")
        info["ngram"] = {"path": None, "resolved_path": None, "kind": "ngram", "family": "ngram", "blocks": blocks,
                         "default_block": int(drafter.default_block_size), "warnings": []}
    return drafters, info


# -- prompts ----------------------------------------------------------------------------------------

class TextPrompt(NamedTuple):
    text: str
    chat: bool  # through the target's chat template (``{"prompt": ..., "chat": true}`` in a JSON file)


def read_prompts(path: str) -> List[TextPrompt]:
    """A JSON list of strings, a JSON object {"prompts": [strings or {"prompt": ..., "chat": bool}]} (the demo's
    prompts.json, bench/prompts/real_pair.json), or plain text: one prompt per blank-line-separated paragraph."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"--prompts-file: cannot read {path!r}: {e}") from None
    expected = ('expected a JSON list of strings, a JSON object {"prompts": [{"prompt": "..."}, ...]}, '
                "or plain text with one prompt per blank-line-separated paragraph")
    if p.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--prompts-file {path!r}: not valid JSON ({e}); {expected}") from None
        items = data.get("prompts") if isinstance(data, dict) else data
        if not isinstance(items, list):
            raise ValueError(f"--prompts-file {path!r}: got a JSON {type(data).__name__} without a \"prompts\" list; {expected}")
        prompts = []
        for i, item in enumerate(items):
            value = item.get("prompt") if isinstance(item, dict) else item
            chat = item.get("chat", False) if isinstance(item, dict) else False
            if not isinstance(value, str):
                raise ValueError(f"--prompts-file {path!r}: prompt {i} is {type(item).__name__} {str(item)[:60]!r}; {expected}")
            if not isinstance(chat, bool):
                raise ValueError(f"--prompts-file {path!r}: prompt {i}'s \"chat\" is {chat!r}; expected true or false")
            prompts.append(TextPrompt(value, chat))
    else:
        prompts = [TextPrompt(para.strip("\n"), False) for para in text.replace("\r\n", "\n").split("\n\n")]
    prompts = [x for x in prompts if x.text.strip()]
    if not prompts:
        raise ValueError(f"--prompts-file {path!r}: no prompts found; {expected}")
    return prompts


def tokenize(tokenizer: Any, prompts: List[TextPrompt], path: str) -> List[List[int]]:
    """The target's tokenizer; a chat prompt through its chat template (as ``mlx-spec generate`` does), the
    others as raw text (as ``--ignore-chat-template``)."""
    from ..hooks.api import encode_prompt

    if tokenizer is None:
        raise ValueError("--prompts-file: the target has no tokenizer")
    if any(p.chat for p in prompts) and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"--prompts-file {path!r}: prompts marked \"chat\": true, but the target's tokenizer has no "
                         "chat template")
    out = [encode_prompt(tokenizer, p.text, chat=p.chat) for p in prompts]
    for i, ids in enumerate(out):
        if not ids:
            raise ValueError(f"--prompts-file {path!r}: prompt {i} ({prompts[i].text[:40]!r}) has no tokens")
    return out


TOKENIZED = ("the target's tokenizer; prompts marked \"chat\": true through its chat template, the others as raw "
             "text")
FRESH_NOTE = ("first pass over the prompts; every method decodes every prompt (same text, comparable tau), so the "
              "rule that no method meets a key length another ran cannot hold: only the first method on a prompt "
              "meets its lengths new (the order rotates from prompt to prompt)")
WARM_NOTE = "the same prompts replayed, in the same order"
