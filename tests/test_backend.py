"""The backend seam (hooks/backend.py): every backend has every member of ``Backend`` (the host's default with neutral
values), drafters see one only through ``DraftBackend``, no code reads a backend through ``getattr``, and where
nothing of the CUDA backend is on, the plugin loads none of plugin/cuda/ but its selector (and the round's
verify-ahead logic, which imports no kernel)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest
from mlx_lm.models.cache import KVCache

from mlx_speculative.hooks import attention as host_attention
from mlx_speculative.testing import tiny_models as tm
from mlx_speculative.hooks.api import Backend, CachePolicy, DraftBackend, draft_backend
from mlx_speculative.plugin.cuda import attention
from mlx_speculative.plugin.cuda.backend import PaddedKVCache, RoutedKVCache, RoutedPolicy, ShapeStablePolicy
from mlx_speculative.plugin.cuda.compiled import CompiledForward

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]


def test_every_backend_has_every_member() -> None:
    model = tm.build_model(tm.llama_config())
    default = CachePolicy()
    for backend in (default, ShapeStablePolicy(8, prewarm_tokens=0), RoutedPolicy(None)):
        assert isinstance(backend, Backend), type(backend).__name__
    assert (default.name, default.shape_stable, default.bucket, default.prewarm_tokens, default.block_size,
            tuple(default.capture_layers)) == ("mlx-lm", False, None, 0, None, ())
    assert default.attention is None and default.projections is None and default.forward is None
    assert default.calls is None and [default.verify_width(n) for n in (1, 3, 5)] == [1, 3, 5]
    assert type(default.kv_cache()) is KVCache and {type(c) for c in default.make_cache(model)} == {KVCache}
    default.prepare(model)  # nothing to warm
    padded = ShapeStablePolicy(8, prewarm_tokens=0)
    assert padded.shape_stable and padded.bucket == 8 and padded.verify_width(5) == 8 and padded.calls is None
    padded.forward = CompiledForward(PaddedKVCache)
    assert padded.calls is padded.forward  # its compiled forward serves drafters' calls too
    assert RoutedPolicy(None).kv_cache().__class__ is KVCache and RoutedPolicy(None).bucket is None
    assert {type(c) for c in RoutedPolicy(None).make_cache(model)} == {RoutedKVCache}


def test_drafters_see_a_backend_through_its_draft_backend() -> None:
    model = tm.build_model(tm.llama_config())
    plain = draft_backend()
    assert plain == DraftBackend() and not plain.shape_stable and plain.bucket is None and plain.calls is None
    assert type(plain.kv_cache()) is KVCache and {type(c) for c in plain.make_cache(model)} == {KVCache}
    assert plain.route(model) == 0  # no dispatcher: nothing routed
    fwd = CompiledForward(PaddedKVCache)
    view = draft_backend(ShapeStablePolicy(16, prewarm_tokens=32, forward=fwd))
    assert view.shape_stable and view.bucket == 16 and view.prewarm_tokens == 32 and view.calls is fwd
    assert type(view.kv_cache()) is PaddedKVCache and view.kv_cache().bucket == 16
    assert {type(c) for c in view.make_cache(model)} == {PaddedKVCache}
    disp = attention.Dispatcher(attention.Kernel("stand-in", lambda *a, **k: None, None, None))
    routed = draft_backend(RoutedPolicy(disp))
    assert routed.route(model) == host_attention.routed(model) > 0  # the model's attention runs under it
    assert host_attention.unroute(model) > 0


def _getattr_on_backend(path: Path) -> List[str]:
    """``file:line`` of each getattr / hasattr whose object names a policy or a backend."""
    text = path.read_text()
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") \
                and node.args:
            what = ast.get_source_segment(text, node.args[0]) or ""
            if "polic" in what or "backend" in what:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.func.id}({what}, ...)")
    return found


def test_no_backend_member_is_read_through_getattr() -> None:
    """Every backend has every member (``Backend``), so callers read them as typed attributes."""
    files = sorted(p for d in ("hooks", "plugin", "drafters", "bench") for p in (ROOT / d).rglob("*.py"))
    found = [f for p in files for f in _getattr_on_backend(p)]
    assert not found, found


def test_the_plugin_loads_no_cuda_module_where_nothing_is_on() -> None:
    """On the CPU with the default settings the selector answers None from the settings alone: the backend, the
    dispatchers, the compiled forwards and the kernels' sources are never imported."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_SPEC_")}
    code = ("import sys\nimport mlx_speculative.plugin.hookimpls\nfrom mlx_speculative.plugin import cuda\n"
            "assert cuda.backend_for() is None\n"
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('mlx_speculative.plugin.cuda'))))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["mlx_speculative.plugin.cuda", "mlx_speculative.plugin.cuda.probe",
                                  "mlx_speculative.plugin.cuda.verify_ahead"]
