"""``mlx-spec``: the host's command line. Plugins add subcommands through ``host_add_commands``."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any, Dict, List, Optional

from . import validate
from .config import load_host_config, model_or_demo
from .host import GenerationParams, Host
from .manager import make_plugin_manager
from .state import SamplingParams

# The demo target writes Python (it learnt the standard library's source): a function to continue.
DEFAULT_PROMPT = ('import argparse\n\n\ndef parse_args(argv):\n    """Parse the command line."""\n'
                  '    parser = argparse.ArgumentParser(description=__doc__)')  # no newline: BPE merges it with the indent


MODEL_HELP = "target: path (a folder or a .gguf file), HF repo id, or 'demo' (default: the config's, else the demo pair)"
DRAFT_HELP = "drafter: path (a folder or a .gguf file), HF repo id, or 'demo-drafter'"
# generate's sampling flags: argparse dest -> (generation: key, help). Values are checked by
# hooks/validate.py (before any model loads), so the error names the flag and what is allowed.
GENERATION_FLAGS = {
    "max_tokens": ("max_tokens", "tokens to generate (default 100)"),
    "temp": ("temp", "sampling temperature (0: greedy)"),
    "top_p": ("top_p", "nucleus sampling, (0, 1] (1: off)"),
    "top_k": ("top_k", "keep the k most likely tokens (0: off)"),
    "min_p": ("min_p", "drop tokens below min_p x the top probability, [0, 1] (0: off)"),
    "seed": ("seed", "seed of this request's random streams"),
    "repetition_penalty": ("repetition_penalty", "mlx-lm's repetition penalty (0: off; 1: no change)"),
    "repetition_context_size": ("repetition_context_size", "tokens the repetition penalty looks back (default 20)"),
    "logit_bias": ("logit_bias", 'additive logit bias as JSON, e.g. \'{"12": -100}\''),
}
GENERATION_DEFAULTS = {"max_tokens": 100, "temp": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "seed": None,
                       "repetition_penalty": 0.0, "repetition_context_size": 20, "logit_bias": None}


def add_generate(subparsers: Any) -> None:
    p = subparsers.add_parser("generate", help="generate text (speculative when configured)")
    p.add_argument("--config", help="host YAML file (model, speculative: ...)")
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument("--draft-model", help=DRAFT_HELP)
    p.add_argument("--draft-kind", help="auto or a registered kind (see `mlx-spec drafters`)")
    p.add_argument("--draft-block-size", help="positions verified per round, or 'auto'")
    p.add_argument("--no-speculative", action="store_true", help="plain one-token decoding")
    p.add_argument("--prompt", "-p", default=None, help="prompt text ('-' reads stdin)")
    for dest, (_, help_) in GENERATION_FLAGS.items():
        flags = ["--" + dest.replace("_", "-")] + (["-m"] if dest == "max_tokens" else [])
        p.add_argument(*flags, dest=dest, default=None, help=help_)
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
        validate.block_size(args.draft_block_size, "--draft-block-size")  # before any model loads
        spec["block_size"] = args.draft_block_size
    if args.no_speculative:
        spec["enabled"] = False
    return {"speculative": spec}


def generation_settings(args: argparse.Namespace, config: Any) -> Dict[str, Any]:
    """Flags over ``generation:`` over the defaults, every value checked."""
    out = dict(GENERATION_DEFAULTS)
    out.update({k: v for k, v in validate.generation_section(config.section("generation")).items() if v is not None})
    for dest, (key, _) in GENERATION_FLAGS.items():
        value = getattr(args, dest)
        if value is not None:
            out[key] = validate.generation_value(key, value, "--" + dest.replace("_", "-"))
    return out


def encode_prompt(tokenizer: Any, text: str, chat: bool) -> List[int]:
    if chat and getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True))
    return list(tokenizer.encode(text, add_special_tokens=False)) or list(tokenizer.encode(text))


def cmd_generate(args: argparse.Namespace) -> int:
    from mlx_lm.sample_utils import make_logits_processors

    overrides = _overrides(args)
    config = load_host_config(args.config, overrides)
    gen = generation_settings(args, config)
    model = model_or_demo(args.model, config, overrides["speculative"])
    host = Host(config, pm=getattr(args, "pm", None))
    target = host.load(model)
    if gen["logit_bias"]:  # token ids against this model's vocabulary
        vocab = target.model_config.get("vocab_size") or (target.model_config.get("text_config") or {}).get("vocab_size")
        if args.logit_bias is not None:
            validate.logit_bias(args.logit_bias, "--logit-bias", vocab)
        else:
            validate.logit_bias(config.section("generation").get("logit_bias"), "generation.logit_bias", vocab)
    prompt_text = args.prompt if args.prompt is not None else DEFAULT_PROMPT
    if prompt_text == "-":
        prompt_text = sys.stdin.read()
    prompt = encode_prompt(target.tokenizer, prompt_text, chat=not args.ignore_chat_template)
    params = GenerationParams(
        max_tokens=gen["max_tokens"],
        sampling=SamplingParams(temperature=gen["temp"], top_p=gen["top_p"], top_k=gen["top_k"], min_p=gen["min_p"],
                                seed=gen["seed"]),
        logits_processors=make_logits_processors(logit_bias=gen["logit_bias"],
                                                 repetition_penalty=gen["repetition_penalty"],
                                                 repetition_context_size=gen["repetition_context_size"]),
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
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument("--model-name", help="the model id clients send (default: the --model/config value)")
    p.add_argument("--host", help="address to bind (default 127.0.0.1)")
    # Numbers stay text here: hooks/server_settings.py checks them (error: flag, value, allowed).
    p.add_argument("--port", help="port (default 8080; 0 picks a free one)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer <key>' on every route but /health "
                   "(also $MLX_SPEC_API_KEY or server.api_key)")
    p.add_argument("--max-tokens", help="default max_tokens of a request (default 512)")
    p.add_argument("--context-length", help="prompt + completion limit (default: the model config's)")
    p.add_argument("--max-active", help="requests decoded together on the generation thread (default 8)")
    p.add_argument("--max-queue", help="requests waiting beyond those; more get 503 (default 64)")
    p.add_argument("--prompt-cache-bytes", help="bytes of finished requests' caches kept for later requests "
                   "sharing a prefix, e.g. 8GB (0: off; default: (device memory - model weights) / 4)")
    p.add_argument("--draft-model", help=DRAFT_HELP)
    p.add_argument("--draft-kind", help="auto or a registered kind (see `mlx-spec drafters`)")
    p.add_argument("--draft-block-size", help="positions verified per round, or 'auto'")
    p.add_argument("--no-speculative", action="store_true", help="plain one-token decoding")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from .server import cmd_serve as serve

    return serve(args, _overrides(args)["speculative"])


def add_convert(subparsers: Any) -> None:
    p = subparsers.add_parser("convert", help="write a GGUF checkpoint as an mlx-lm folder (mlx_lm.load reads it)")
    p.add_argument("gguf", help="a .gguf file, the first shard of a split one, or a folder holding one")
    p.add_argument("out_dir", help="the folder to write (config.json, model.safetensors, tokenizer files)")
    p.add_argument("--dtype", default="keep", help="keep (Q4_0/Q4_1/Q8_0 stay quantized, other blocks become "
                   "float16), f32, bf16 or f16 (every weight dense in that dtype); default keep")
    p.set_defaults(func=cmd_convert)


def cmd_convert(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .gguf import DTYPES, is_gguf
    from .gguf_convert import convert

    source, out = Path(args.gguf).expanduser(), Path(args.out_dir).expanduser()
    if args.dtype not in DTYPES:
        raise ValueError(f"--dtype {args.dtype!r}: expected one of {', '.join(DTYPES)}")
    if not source.exists() or not is_gguf(source):
        raise ValueError(f"{args.gguf!r} is not a GGUF checkpoint: expected a .gguf file (magic bytes 'GGUF'), "
                         "the first shard of a split one, or a folder holding one")
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{args.out_dir!r} exists and is not empty: expected a new or empty folder")
    config = convert(source, out, args.dtype)
    quantized = config.get("quantization")
    print(f"[mlx-spec] wrote {out}: {config['model_type']}, {config['num_hidden_layers']} layers, vocabulary "
          f"{config['vocab_size']}, " + (f"quantized layers at {quantized['bits']} bits (group 32)" if quantized
                                         else f"dense weights ({args.dtype})"))
    return 0


def version_line() -> str:
    """``mlx-spec <version>`` from the installed package's metadata, with mlx's and mlx-lm's."""
    from importlib.metadata import PackageNotFoundError, version

    def v(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    return f"mlx-spec {v('mlx-speculative')} (mlx {v('mlx')}, mlx-lm {v('mlx-lm')})"


def build_parser(pm: Any) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlx-spec", description="Lossless speculative decoding for mlx-lm.")
    parser.add_argument("-V", "--version", action="version", version=version_line())
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the plugins decide")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate(sub)
    add_serve(sub)
    add_convert(sub)
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
    except BrokenPipeError:
        # The reader went away (`mlx-spec drafters | head -1`): no error message; stdout is closed
        # for good so that the interpreter's final flush does not fail too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (ValueError, OSError) as e:
        # Every expected failure (bad config, missing/corrupt checkpoint, incompatible drafter)
        # is a ValueError/OSError subclass with a message that says what to fix.
        print(f"mlx-spec: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
