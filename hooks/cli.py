"""``mlx-spec``: the host's command line. Plugins add subcommands through ``host_add_commands``."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any, List, Optional

from .generate_cmd import DEFAULT_PROMPT, MODEL_HELP, add_distributed_flags, add_generate, encode_prompt

__all__ = ["DEFAULT_PROMPT", "build_parser", "encode_prompt", "main"]


def add_serve(subparsers: Any) -> argparse.ArgumentParser:
    """``serve`` and the host's flags; plugins add theirs (``host_add_arguments``)."""
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
    p.add_argument("--warmup-rows", help="decode batches of 1..N rows before serving, so that no client waits on a "
                   "shape compiling (default: --max-active on CUDA, 0 elsewhere)")
    p.add_argument("--warmup-tokens", help="keys the warm-up reaches: one batch per cache bucket up to this many "
                   "(default 2048), so that longer prompts meet no new shape")
    p.add_argument("--max-queue", help="requests waiting beyond those; more get 503 (default 64)")
    p.add_argument("--prompt-cache-bytes", help="bytes of finished requests' caches kept for later requests "
                   "sharing a prefix, e.g. 8GB (0: off; default: (device memory - model weights) / 4)")
    p.add_argument("--prompt-cache-size", help="at most this many prompt cache entries (0: off; default: no limit "
                   "but the bytes)")
    p.add_argument("--prefill-step-size", help="prompt tokens fed per forward (default 2048)")
    # mlx-lm's server flags: the defaults of requests that leave them out, and its chat/HTTP options
    p.add_argument("--temp", help="default temperature (0: greedy)")
    p.add_argument("--top-p", help="default top_p, (0, 1]")
    p.add_argument("--top-k", help="default top_k (0: off)")
    p.add_argument("--min-p", help="default min_p, [0, 1] (0: off)")
    p.add_argument("--chat-template", help="a chat template (Jinja text, or a file holding it) instead of the "
                   "tokenizer's")
    p.add_argument("--chat-template-args", help='JSON arguments of apply_chat_template, e.g. \'{"enable_thinking": '
                   "false}'")
    p.add_argument("--allowed-origins", help="CORS: '*' (default) or comma-separated origins")
    p.add_argument("--log-level", help="DEBUG, INFO (default), WARNING, ERROR or CRITICAL")
    add_distributed_flags(p)
    p.set_defaults(func=cmd_serve)
    return p


def cmd_serve(args: argparse.Namespace) -> int:
    from .serve_cmd import cmd_serve as serve

    return serve(args)


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
    for command, p in (("generate", add_generate(sub)), ("serve", add_serve(sub))):
        pm.hook.host_add_arguments(parser=p, command=command)
    add_convert(sub)
    pm.hook.host_add_commands(subparsers=sub)
    return parser


def blas_hint(args: argparse.Namespace) -> None:
    """One line on stderr when a CPU run would use MLX's reference BLAS (hooks/blas.py)."""
    import mlx.core as mx

    from . import blas

    if args.command in BLAS_HINT_COMMANDS and (mx.default_device().type == mx.cpu or getattr(args, "cpu", False)):
        used = blas.in_use()
        logging.getLogger("mlx_speculative").info("BLAS of MLX's CPU matmuls: %s (%s)%s", used.kind, used.path,
                                                  f", preloaded by {blas.ENV}" if used.preloaded else "")
        line = blas.hint(getattr(args, "config", None))
        if line:
            print(line, file=sys.stderr)


BLAS_HINT_COMMANDS = ("generate", "serve", "bench")


def main(argv: Optional[List[str]] = None) -> int:
    own = argv is None  # this process's own command line: MLX_SPEC_BLAS may re-execute it (the console script did)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("-V", "--version"):  # without loading the plugins (and mlx with them)
        print(version_line())
        return 0
    if own:
        from . import blas

        try:
            blas.reexec_if_asked()
        except ValueError as e:
            print(f"mlx-spec: error: {e}", file=sys.stderr)
            return 2
    from .manager import make_plugin_manager

    pm = make_plugin_manager()
    parser = build_parser(pm)
    args = parser.parse_args(argv)
    args.pm = pm
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="[%(name)s] %(levelname)s: %(message)s")
    try:
        blas_hint(args)
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("mlx-spec: interrupted", file=sys.stderr)
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
