"""``mlx-spec bench``, a host plugin of its own: registered under ``mlx_speculative.host`` like any plugin, it adds
its command (``host_add_commands``) and nothing else."""

from __future__ import annotations

from typing import Any

from ..hooks.api import hookimpl


@hookimpl
def host_add_commands(subparsers: Any) -> None:
    from . import add_command

    add_command(subparsers)
