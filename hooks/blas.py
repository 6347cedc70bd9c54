"""Which BLAS MLX's CPU matmuls run on, and ``MLX_SPEC_BLAS``: run the CLI on OpenBLAS instead.

MLX's Linux CPU wheel (``mlx-cpu``) bundles the reference BLAS (``mlx_cpu.libs/libblas-*.so``, Netlib
3.10) and calls ``cblas_sgemm`` from it for every float32 matmul: a 16-position forward then costs
~15x a one-position one, and verifying a block costs nearly what decoding it does. libmlx.so is
loaded privately (RTLD_LOCAL), so a ``cblas_sgemm`` in the process's global scope, which an
``LD_PRELOAD`` of an LP64 OpenBLAS puts there, binds first. ``update-alternatives`` does not reach
the bundled copy, and SciPy's OpenBLAS wheels (``scipy-openblas32``) export ``scipy_``-prefixed
symbols, which bind nothing.

Nothing here changes the running process: ``in_use`` only looks (``dlsym``/``dladdr``, the wheel's
files), and ``reexec_if_asked`` runs in the CLI's entry point only, replacing the process by itself
with ``LD_PRELOAD`` set once, before any model loads.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import importlib.util
import os
import sys
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

ENV = "MLX_SPEC_BLAS"
MARK = "MLX_SPEC_BLAS_PRELOADED"  # set in the re-executed process: the library preloaded; never re-executes twice
MODES = ("auto", "openblas", "off")
ALLOWED = ("auto (OpenBLAS where installed), openblas (OpenBLAS or an error), off (neither, and no hint), "
           "or the path of an LP64 BLAS library, e.g. /usr/lib/x86_64-linux-gnu/libopenblas.so.0")
INSTALL = "apt-get install libopenblas0-pthread (Debian/Ubuntu; dnf install openblas on Fedora)"
OPTIMISED = ("openblas", "blis", "mkl", "atlas", "accelerate", "armpl", "nvpl")


@dataclass
class BlasInUse:
    kind: str  # reference | openblas | blis | mkl | ... | unknown
    path: Optional[str]  # the library whose cblas_sgemm MLX's matmuls call
    preloaded: Optional[str] = None  # what MLX_SPEC_BLAS preloaded (re-executed process), else None

    @property
    def reference(self) -> bool:
        return self.kind == "reference"

    def to_dict(self) -> Dict[str, Any]:
        return dict(asdict(self), ld_preload=os.environ.get("LD_PRELOAD") or None)


def mode(config: Optional[str] = None) -> str:
    """``MLX_SPEC_BLAS``, else ``runtime.blas`` of the YAML file ``config``: '' (unset: hint only), auto, openblas,
    off, or a library path."""
    from . import knobs

    layers = knobs.Layers(yaml=_from_yaml(config), where=lambda key: f"{config}: ")
    value, _, field = knobs.setting("blas", layers=layers)
    if value.lower() in MODES:
        return value.lower()
    if value and ("/" not in value or not os.path.isfile(value)):
        raise ValueError(f"{field}: got {value!r}" + (" (no such file)" if "/" in value else "") + f"; allowed: {ALLOWED}")
    return value


def config_path(argv: List[str]) -> Optional[str]:
    """The ``--config`` file of a command line (read here before the CLI parses it: MLX must not load first)."""
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return None


def _from_yaml(config: Optional[str]) -> Dict[str, Any]:
    """``{"blas": value}`` from the YAML's ``runtime:`` section, checked; {} without one. A file that does not read
    is left to the configuration's own load, which says what is wrong with it."""
    if not config:
        return {}
    import yaml

    from . import knobs

    try:
        sections = yaml.safe_load(Path(config).read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return {}
    runtime = sections.get(knobs.SECTION) if isinstance(sections, dict) else None
    if not isinstance(runtime, dict) or runtime.get("blas") is None:
        return {}
    return {"blas": knobs.KNOBS["blas"].from_yaml(runtime["blas"], f"{config}: runtime.blas")}


def classify(path: str) -> str:
    real = os.path.realpath(path).lower()
    for name in OPTIMISED:
        if name in real:
            return name
    return "reference" if os.path.basename(real).startswith(("libblas", "libcblas")) else "other"


def _global_symbol(name: str) -> Optional[str]:
    """The file that defines ``name`` in the process's global scope (where LD_PRELOAD puts it), else None."""
    try:
        scope = ctypes.CDLL(None)
        addr = ctypes.cast(getattr(scope, name), ctypes.c_void_p).value
    except (AttributeError, OSError):
        return None

    class DlInfo(ctypes.Structure):
        _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                    ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]

    info = DlInfo()
    if not scope.dladdr(ctypes.c_void_p(addr), ctypes.byref(info)) or not info.dli_fname:
        return None
    return info.dli_fname.decode(errors="replace")


def bundled_blas() -> Optional[str]:
    """The BLAS that MLX's wheel ships beside libmlx.so (mlx-cpu: the reference one), found without importing MLX."""
    spec = importlib.util.find_spec("mlx")
    roots = list(spec.submodule_search_locations or []) if spec else []
    for root in roots:
        site = Path(root).parent
        found = sorted(glob.glob(str(site / "mlx*.libs" / "libblas*.so*")) + glob.glob(str(Path(root) / "lib" / "libblas*.so*")))
        if found:
            return found[0]
    return None


def _mapped_blas() -> Optional[str]:
    """A BLAS that a loaded library linked privately (an MLX built against the system's libblas.so.3)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "blas" in line.lower()}
    except OSError:
        return None
    found = sorted(p for p in paths if os.path.basename(p).startswith(("libblas", "libcblas", "libopenblas")))
    return found[0] if found else None


def in_use() -> BlasInUse:
    """The library MLX's float32 matmuls call ``cblas_sgemm`` from in this process."""
    preloaded = os.environ.get(MARK) or None
    path = _global_symbol("cblas_sgemm")
    if path:
        return BlasInUse(classify(path), path, preloaded)
    local = bundled_blas() or _mapped_blas()
    return BlasInUse(classify(local) if local else "unknown", local, preloaded)


def openblas_candidates() -> List[str]:
    arch = sysconfig.get_config_var("MULTIARCH") or f"{os.uname().machine}-linux-gnu"
    names = ("libopenblas.so.0", "libopenblasp.so.0")
    dirs = [f"/usr/lib/{arch}", "/usr/lib64", "/usr/lib", "/usr/local/lib"]
    # pip install cmeel-openblas (plain symbols; needs the system's libgfortran.so.5)
    dirs += [str(Path(p) / "cmeel.prefix" / "lib") for p in {sysconfig.get_paths()["platlib"], sysconfig.get_paths()["purelib"]}]
    return [os.path.join(d, n) for d in dirs for n in names]


def find_openblas() -> Optional[str]:
    """An installed LP64 OpenBLAS (plain ``cblas_sgemm``), or None."""
    for path in openblas_candidates():
        if os.path.isfile(path):
            return path
    return ctypes.util.find_library("openblas")  # a soname from the loader's cache: LD_PRELOAD takes it too


def reexec_if_asked(argv: Optional[List[str]] = None) -> None:
    """The CLI entry point's step: with ``MLX_SPEC_BLAS`` (or the ``--config`` file's ``runtime.blas``) asking for
    it and the reference BLAS about to be used, replace this process by itself with ``LD_PRELOAD`` naming OpenBLAS
    (once: ``MARK``).

    Raises ValueError (a one-line message) for a bad value or ``openblas`` with none installed."""
    want = mode(config_path(sys.argv[1:] if argv is None else argv))
    if want in ("", "off") or os.environ.get(MARK) or not sys.platform.startswith("linux"):
        return
    current = in_use()
    if current.kind not in ("reference", "unknown"):
        return  # already optimised (the user's own LD_PRELOAD)
    lib = want if want not in MODES else find_openblas()
    if lib is None:
        if want == "openblas":
            raise ValueError(f"{ENV}=openblas: no OpenBLAS found (looked for {', '.join(openblas_candidates()[:2])}, ...); "
                             f"allowed: install it ({INSTALL}), or {ENV}=auto|off or a library path")
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = lib + (":" + env["LD_PRELOAD"] if env.get("LD_PRELOAD") else "")
    env[MARK] = lib
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def hint(config: Optional[str] = None) -> Optional[str]:
    """One line for the CLI's start on the CPU when MLX uses the reference BLAS (None otherwise)."""
    if not sys.platform.startswith("linux") or mode(config) == "off":
        return None
    used = in_use()
    if not used.reference:
        return None
    if used.preloaded:
        return (f"[mlx-spec] note: {ENV} preloaded {used.preloaded}, but MLX still calls the reference BLAS "
                f"({used.path}): the library did not load or lacks cblas_sgemm; {ENV}=off hides this line")
    lib = find_openblas()
    todo = f"OpenBLAS is installed ({lib}): {ENV}=auto runs on it" if lib else f"{INSTALL}, then {ENV}=auto runs on it"
    return (f"[mlx-spec] note: MLX's CPU matmuls use the reference BLAS, so a 16-token forward costs up to ~15x a one-token one "
            f"and speculation rarely pays; {todo} ({ENV}=off hides this line)")
