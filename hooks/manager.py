"""The host's plugin manager: hookspecs plus every plugin found through entry points."""

from __future__ import annotations

import argparse
from typing import Iterable, Optional

import pluggy

from . import specs

ENTRY_POINT_GROUP = "mlx_speculative.host"


def make_plugin_manager(
    load_entry_points: bool = True, plugins: Optional[Iterable[object]] = None
) -> pluggy.PluginManager:
    """A plugin manager with the host contract; plugins from the entry-point group by default."""
    pm = pluggy.PluginManager(specs.PROJECT)
    pm.add_hookspecs(specs)
    if load_entry_points:
        pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
    for plugin in plugins or ():
        pm.register(plugin)
    return pm


def plugins(args: argparse.Namespace) -> pluggy.PluginManager:
    """The plugin manager ``mlx-spec`` parsed ``args`` with (``args.pm``), else one from the entry points."""
    pm = getattr(args, "pm", None)
    return pm if pm is not None else make_plugin_manager()
