"""``python -m mlx_speculative.benchmarks``: the bench without the console script or entry points."""

from __future__ import annotations

import argparse
import sys

from . import add_command


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m mlx_speculative.benchmarks")
    sub = parser.add_subparsers(dest="command")
    add_command(sub)
    args = parser.parse_args(["bench", *sys.argv[1:]])
    try:
        return int(args.func(args) or 0)
    except (ValueError, OSError) as e:
        print(f"mlx-spec bench: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
