"""``mlx-spec``: the host's command line. Plugins add subcommands through ``host_add_commands``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any, Dict, List, Optional

from .config import load_host_config, model_or_demo
from .host import GenerationParams, Host
from .manager import make_plugin_manager
from .state import SamplingParams

DEFAULT_PROMPT = "the model token draft verify accept commit the model token draft"


def add_generate(subparsers: Any) -> None:
    p = subparsers.add_parser("generate", help="generate text (speculative when configured)")
    p.add_argument("--config", help="host YAML file (model, speculative: ...)")
    p.add_argument("--model", help="target: path or HF repo id (default: the config's, else the tiny demo)")
    p.add_argument("--draft-model", help="drafter: path or HF repo id")
    p.add_argument("--draft-kind", help="auto or a registered kind (see `mlx-spec drafters`)")
    p.add_argument("--draft-block-size", help="positions verified per round, or 'auto'")
    p.add_argument("--no-speculative", action="store_true", help="plain one-token decoding")
    p.add_argument("--prompt", "-p", default=None, help="prompt text ('-' reads stdin)")
    p.add_argument("--max-tokens", "-m", type=int, default=None, help="tokens to generate (default 100)")
    p.add_argument("--temp", type=float, default=None, help="sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-chat-template", action="store_true", help="use the raw prompt")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    p.set_defaults(func=cmd_generate)


def _overrides(args: argparse.Namespace) -> Dict[str, Dict[str, Any]]:
    spec: Dict[str, Any] = {}
    if args.draft_model is not None:
        spec["draft_model"] = args.draft_model
    if args.draft_kind is not None:
        spec["kind"] = args.draft_kind
    if args.draft_block_size is not None:
        spec["block_size"] = args.draft_block_size
    if args.no_speculative:
        spec["enabled"] = False
    return {"speculative": spec}


def encode_prompt(tokenizer: Any, text: str, chat: bool) -> List[int]:
    if chat and getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True))
    return list(tokenizer.encode(text, add_special_tokens=False)) or list(tokenizer.encode(text))


def cmd_generate(args: argparse.Namespace) -> int:
    overrides = _overrides(args)
    config = load_host_config(args.config, overrides)
    gen = config.section("generation")
    model = model_or_demo(args.model, config, overrides["speculative"])
    host = Host(config, pm=getattr(args, "pm", None))
    target = host.load(model)
    prompt_text = args.prompt if args.prompt is not None else DEFAULT_PROMPT
    if prompt_text == "-":
        prompt_text = sys.stdin.read()
    prompt = encode_prompt(target.tokenizer, prompt_text, chat=not args.ignore_chat_template)
    params = GenerationParams(
        max_tokens=args.max_tokens if args.max_tokens is not None else int(gen.get("max_tokens", 100)),
        sampling=SamplingParams(
            temperature=args.temp if args.temp is not None else float(gen.get("temp", 0.0)),
            top_p=args.top_p if args.top_p is not None else float(gen.get("top_p", 1.0)),
            top_k=args.top_k if args.top_k is not None else int(gen.get("top_k", 0)),
            min_p=args.min_p if args.min_p is not None else float(gen.get("min_p", 0.0)),
            seed=args.seed if args.seed is not None else gen.get("seed"),
        ),
    )
    if args.json:
        result = host.generate(target, prompt, params)
        spec = result.report.get("speculative")
        print(json.dumps({
            "text": result.text,
            "tokens": result.tokens,
            "prompt_tokens": result.prompt_tokens,
            "generation_tokens": len(result.tokens),
            "generation_tps": round(result.generation_tps, 3),
            "finish_reason": result.finish_reason,
            "speculative": spec.to_dict() if spec is not None else None,
        }))
        return 0
    holder: list = []
    n = 0
    import time

    start = time.perf_counter()
    for event in host.stream(target, prompt, params, state_out=holder):
        n += int(event.emitted)
        print(event.text, end="", flush=True)
    elapsed = time.perf_counter() - start
    print()
    spec = holder[0].report.get("speculative") if holder else None
    line = f"[mlx-spec] prompt {len(prompt)} tokens, generated {n} tokens, {n / elapsed if elapsed else 0:.1f} tok/s"
    if spec is not None:
        line += (f", speculative {spec.kind}: rounds {spec.rounds}, tau {spec.mean_acceptance_length:.2f}, "
                 f"acceptance {spec.acceptance_rate:.0%}")
        if spec.fallback:
            line += f", fell back: {spec.fallback}"
    else:
        line += ", speculative off"
    print(line, file=sys.stderr)
    return 0


def add_serve(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (speculative when configured)")
    p.add_argument("--config", help="host YAML file (model, server: ..., speculative: ...)")
    p.add_argument("--model", help="target: path or HF repo id (default: the config's, else the tiny demo)")
    p.add_argument("--model-name", help="the model id clients send (default: the --model/config value)")
    p.add_argument("--host", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 8080; 0 picks a free one)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer <key>' on every route but /health "
                   "(also $MLX_SPEC_API_KEY or server.api_key)")
    p.add_argument("--max-tokens", type=int, help="default max_tokens of a request (default 512)")
    p.add_argument("--context-length", type=int, help="prompt + completion limit (default: the model config's)")
    p.add_argument("--max-active", type=int, help="requests interleaved on the generation thread (default 8)")
    p.add_argument("--max-queue", type=int, help="requests waiting beyond those; more get 503 (default 64)")
    p.add_argument("--draft-model", help="drafter: path or HF repo id")
    p.add_argument("--draft-kind", help="auto or a registered kind (see `mlx-spec drafters`)")
    p.add_argument("--draft-block-size", help="positions verified per round, or 'auto'")
    p.add_argument("--no-speculative", action="store_true", help="plain one-token decoding")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from .server import cmd_serve as serve

    return serve(args, _overrides(args)["speculative"])


def build_parser(pm: Any) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlx-spec", description="Lossless speculative decoding for mlx-lm.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the plugins decide")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate(sub)
    add_serve(sub)
    pm.hook.host_add_commands(subparsers=sub)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    pm = make_plugin_manager()
    parser = build_parser(pm)
    args = parser.parse_args(argv)
    args.pm = pm
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="[%(name)s] %(levelname)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, OSError) as e:
        # Every expected failure (bad config, missing/corrupt checkpoint, incompatible drafter)
        # is a ValueError/OSError subclass with a message that says what to fix.
        print(f"mlx-spec: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
