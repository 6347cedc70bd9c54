"""The host's API: the only host module that plugins (plugin/) and drafters (drafters/, third-party ones) import.

Everything here is a re-export: the same object as in its home module, so importing it from here or
from there is the same thing. The headings below document the contract; a name that a plugin or a
drafter needs and that is not listed here gets added here first (tests/test_host_api.py enforces it).

Four host modules are exported whole, as namespaces read by attribute (``knobs.value(...)``):
``knobs``, ``loading``, ``validate`` and ``taps``; the members the plugin and drafters read are listed next to
each. Names from modules that import the plugin manager
(``Host``, ``Scheduler``, ``make_plugin_manager``...) or that only commands need are loaded on first
use (``__getattr__`` below), so importing this module stays as cheap as importing the plugin was.
"""

from __future__ import annotations

import importlib
from typing import Any, Dict, Tuple

# -- types: what the host hands to plugins and what they hand back (hooks/state.py, hooks/specs.py)
from .specs import DecodeReport, DemoPart, Description, Metric, PlainTokens, RowSnapshot, hookimpl
from .state import (
    CaptureRequest,  # decoder layers whose outputs the ordinary forward must expose
    DecodeState,  # one request's row: tokens, caches, sampler
    GeneratedToken,  # one token of a StepOutput
    HostConfig,  # YAML sections + CLI overrides
    LoadedTarget,  # the loaded target model, tokenizer and config
    StepOutput,  # a row's tokens from one decode step
    WARMUP_CONTINUATION,  # the request option of the server's warm-up: the target's continuation (teacher drafts)
)

# -- the backend seam: how a target's caches are made and its forwards run, per device (hooks/backend.py)
from .backend import (
    Backend,  # the typed contract (host_cache_policy's answer): caches, dispatchers, decode forward, widths, prepare
    CachePolicy,  # the host's default backend (mlx-lm's caches, neutral values); plugins subclass it
    CompiledCalls,  # a backend's compiled calls of drafters' own functions over its caches
    DraftBackend,  # what a drafter may use of its target's backend (DraftTarget.backend)
    draft_backend,  # the DraftBackend of a backend
)

# -- batches: a decode step's rows and the forwards over them (hooks/batch.py)
from .batch import (
    DecodeBatch,  # the rows one host_decode_step advances
    add_row,  # batched caches with one more row's own caches after them
    extract_row,  # one row's caches out of batched caches
    forward,  # the target's ordinary forward: logits [B, W, V] and the tapped layers' outputs
    keep_rows,  # only the listed rows stay (batched caches filtered in place)
    mergeable,  # whether rows with these caches can share a batch
    replay,  # feed the first n positions of inputs [B, W] again (n per row: a list)
)

# -- cache transactions: exact rollback of every cache type (hooks/transaction.py, hooks/cache_ops.py)
from .cache_ops import (
    Lengths,  # int or per-row lengths
    check_range,  # ValueError unless 0 <= each length <= the positions written
    zeroed,  # zero buffers of a given length (prewarms)
)
from .transaction import (
    BatchTrimHandler,  # rollback handler: per-row trim of batched KV caches
    CacheTransaction,  # begin / commit(n) / abort over a list of caches
    TrimHandler,  # rollback handler: trim a KV cache
    UnsupportedCache,  # raised for a cache that cannot be rolled back exactly
    check_supported,  # raise UnsupportedCache naming the first cache no transaction can roll back
)

# -- cache helpers: copies, sizes and trims of prompt caches (hooks/prompt_cache.py, hooks/kv_view.py)
from .kv_view import KVView  # a cache's stored K/V and the position of each slot (shared-KV drafters)
from .prompt_cache import (
    arrays,  # every array the caches hold, once each
    cache_bytes,  # the bytes a cache list holds
    copy_caches,  # deep copies of caches
    trim_caches,  # trim every cache by n positions
    trimmable,  # mlx-lm's rule: every cache can drop positions now
)

# -- attention and model scoping (hooks/attention.py, hooks/recurrent.py)
from .attention import (
    MaskSpec,  # what a mask means (offsets, lengths), for attention kernels
    describe,  # record on the cache a mask is made for what the mask holds (a MaskSpec); returns the mask
    described,  # the MaskSpec a cache recorded for this very mask, or None
    project_all,  # [layer(x) for layer in layers], routed projections at once
    route_policy,  # route a model's attention and projections through a backend's dispatchers (CUDA), if any
    route_projections,  # route a model's projections through a dispatcher
    unroute_projections,  # undo route_projections
)
from .recurrent import scope_model  # give a model's recurrent layers their recording subclass (this instance only)

# -- settings, checkpoints and hidden-state taps: namespaces (members used: see each line)
from . import knobs  # runtime knobs: value, setting, resolved, table_markdown, cache_root, SECTION
# checkpoints: read_config, resolve_path, safetensors_headers, check_safetensors, TensorHeader, CheckpointError,
# load_target, DEMO_DRAFTER
from . import loading
from . import taps  # hidden-state taps: decoder_layers, install_taps, record
from . import validate  # setting checks: check, choice, flag, block_size, MAX_BLOCK, SettingError, HostConfigError
from .config import load_host_config  # a HostConfig from a YAML file
from .loading import read_config, resolve_path  # a checkpoint's checked config.json; a model spec -> a local directory
from .taps import decoder_layers  # the target's decoder layer list

# -- commands and benchmarks, loaded on first use: name -> (home module, attribute; None: the module)
_LAZY: Dict[str, Tuple[str, Any]] = {
    # CLI helpers of the plugin's commands (mlx-spec config)
    "GENERATION_DEFAULTS": ("generate_cmd", "GENERATION_DEFAULTS"),  # generation settings' defaults
    "GENERATION_KEYS": ("validate", "GENERATION_KEYS"),  # keys of the generation section
    "generation_section": ("validate", "generation_section"),  # the checked generation section
    "SERVER_KEYS": ("server_settings", "SERVER_KEYS"),  # keys of the server section
    "server_settings": ("server_settings", "server_settings"),  # the resolved server section
    "DISTRIBUTED_KEYS": ("distributed", "KEYS"),  # keys of the distributed section
    "distributed_settings": ("distributed", "settings"),  # the resolved distributed section
    # a target sharded over ranks (namespace; members used: start, shard, failed, Cluster, all_sums, exchanged)
    "distributed": ("distributed", None),
    "encode_prompt": ("generate_cmd", "encode_prompt"),  # a prompt (the chat template applied when asked) -> token ids
    # the host itself, for benchmarks that drive it (benchmarks/)
    "GenerationParams": ("host", "GenerationParams"),
    "Host": ("host", "Host"),
    "Scheduler": ("scheduler", "Scheduler"),
    "make_plugin_manager": ("manager", "make_plugin_manager"),
    "blas_in_use": ("blas", "in_use"),  # the library MLX's float32 matmuls call (benchmark reports)
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = _LAZY[name]
    home = importlib.import_module(f".{module}", __package__)
    return home if attr is None else getattr(home, attr)  # not cached here: this module's globals stay as imported


__all__ = [
    # types
    "CaptureRequest", "DecodeReport", "DecodeState", "DemoPart", "Description", "GeneratedToken", "HostConfig",
    "LoadedTarget", "Metric", "PlainTokens", "RowSnapshot", "StepOutput", "WARMUP_CONTINUATION", "hookimpl",
    # the backend seam
    "Backend", "CachePolicy", "CompiledCalls", "DraftBackend", "draft_backend",
    # batches
    "DecodeBatch", "add_row", "extract_row", "forward", "keep_rows", "mergeable", "replay",
    # cache transactions
    "BatchTrimHandler", "CacheTransaction", "Lengths", "TrimHandler", "UnsupportedCache", "check_range",
    "check_supported", "zeroed",
    # cache helpers
    "KVView", "arrays", "cache_bytes", "copy_caches", "trim_caches", "trimmable",
    # attention and model scoping
    "MaskSpec", "describe", "described", "project_all", "route_policy", "route_projections",
    "scope_model", "unroute_projections",
    # settings, checkpoints, taps
    "decoder_layers", "knobs", "load_host_config", "loading", "read_config", "resolve_path", "taps",
    "validate",
    # loaded on first use
    *_LAZY,
]
