"""The ``mlx-spec`` console script: the BLAS choice (hooks/blas.py) before MLX is imported, then the CLI."""

from __future__ import annotations

import sys


def main() -> int:
    try:
        from . import blas

        try:
            blas.reexec_if_asked()  # returns unless it replaced this process
        except ValueError as e:
            print(f"mlx-spec: error: {e}", file=sys.stderr)
            return 2
        from .cli import main as cli_main

        return cli_main()
    except KeyboardInterrupt:  # Ctrl-C while mlx and the plugins import, before cli.main's own handler
        print("mlx-spec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
