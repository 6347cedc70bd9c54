"""The projection kernels' CUDA sources compile for sm_90 (the H200) with nvcc, where nvcc is installed.

MLX-CUDA compiles a ``mx.fast.cuda_kernel`` with NVRTC at its first launch, on the device only; this
builds the same translation unit here (MLX's wrapper, mlx/backend/cuda/custom_kernel.cpp ``build_kernel``:
its default header's types stood in for, the kernel's signature from its inputs and outputs, the body)
so that a source edit that does not compile fails before any device time is spent. Every (dtype, row
tiles) instance the plan makes, at the default shapes, and ptxas must report no register spills.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import List, Tuple

import pytest

from mlx_speculative.plugin.cuda import cuda_matmul, cuda_qmatmul
from mlx_speculative.plugin.cuda.cuda_attention_src import compact

NVCC = shutil.which("nvcc")
pytestmark = [pytest.mark.unit, pytest.mark.skipif(NVCC is None, reason="nvcc not installed")]

# what MLX's default header (mlx/backend/cuda/device/utils.cuh) gives a kernel: 16-bit float types, Shape
PRELUDE = r"""
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
#include <cooperative_groups.h>
struct Shape { int32_t v[10]; __device__ int32_t operator[](int i) const { return v[i]; } };
"""


def kernel(name: str, source: str, inputs: List[Tuple[str, str]], outputs: List[Tuple[str, str]]) -> str:
    """A ``__global__ void`` as MLX writes it: over the inputs (with ``_shape`` / ``_ndim`` where the source
    names them) and the outputs, the source as its body."""
    args = []
    for arg, ctype in inputs:
        args.append(f"const {ctype}* {arg}")
        if f"{arg}_shape" in source:
            args.append(f"const __grid_constant__ Shape {arg}_shape")
        if f"{arg}_ndim" in source:
            args.append(f"const __grid_constant__ int {arg}_ndim")
    args += [f"{ctype}* {arg}" for arg, ctype in outputs]
    return f"__global__ void {name}({', '.join(args)}) {{\n{source}\n}}\n"


def compiles(tmp_path: Path, name: str, header: str, kernels: List[str]) -> str:
    """One translation unit (the header once, then the kernels in MLX's namespace) through nvcc for sm_90;
    ptxas must report no register spills."""
    src = tmp_path / f"{name}.cu"
    src.write_text(PRELUDE + header + "namespace mlx::core::cu {\nnamespace cg = cooperative_groups;\n"
                   + "".join(kernels) + "}\n")
    done = subprocess.run([NVCC, "-arch=sm_90", "-std=c++17", "-c", str(src), "-o", str(tmp_path / f"{name}.o"),
                           "-Xptxas", "-v"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", done.stderr)]
    assert len(spills) == len(kernels) and max(spills) == 0, done.stderr[-2000:]
    return done.stderr


def qmm_kernel(bf16: bool, row_tiles: int, gs: int, body: str = "") -> str:
    ctype = "__nv_bfloat16" if bf16 else "__half"
    source = cuda_qmatmul._consts(bf16, row_tiles, *cuda_qmatmul.SHAPE, gs) + \
        (body or compact(cuda_qmatmul.MAIN + cuda_qmatmul.REDUCE))
    return kernel(f"qmm_{int(bf16)}_{row_tiles}_{gs}", source,
                  [("x", ctype), ("w", "uint32_t"), ("scales", ctype), ("biases", ctype)], [("y", ctype)])


def mm_kernel(bf16: bool, row_tiles: int, weights: int, shape: Tuple[int, ...]) -> str:
    ctype = "__nv_bfloat16" if bf16 else "__half"
    g, s, u, *pipe = shape
    main = cuda_matmul.PIPE_MAIN if pipe and pipe[0] else cuda_matmul.MAIN
    source = (cuda_matmul.dtype_consts(bf16) + f"constexpr int MT = {row_tiles}, G = {g}, S = {s}, U = {u};\n"
              + compact(main).replace("SELECT_WEIGHT", cuda_matmul._select(weights)))
    return kernel(f"mm_{int(bf16)}_{row_tiles}_{weights}_{g}{s}{u}{''.join(map(str, pipe))}", source, [("x", ctype)] + [(f"w{i}", ctype) for i in range(weights)],
                  [(f"y{i}", ctype) for i in range(weights)])


def test_the_projection_kernels_compile(tmp_path: Path) -> None:
    """The 4-bit kernel at every (dtype, row tiles, group size) the plan makes, and the bf16 / f16 kernel that
    runs on the device today at both of its shapes (a control for the wrapper), alone and fused (up to
    MAX_WEIGHTS weights), also with its loads pipelined (PIPE)."""
    kernels = [qmm_kernel(bf16, mt, gs) for bf16 in (True, False) for mt in (1, 2) for gs in cuda_qmatmul.GROUP_SIZES]
    kernels += [mm_kernel(bf16, mt, w, shape) for bf16 in (True, False) for mt in (1, 2) for w in (1, 3, cuda_matmul.MAX_WEIGHTS)
                for shape in (cuda_matmul.NARROW, cuda_matmul.WIDE, cuda_matmul.PIPED, (*cuda_matmul.NARROW, 1))]
    assert cuda_qmatmul.HEADER == cuda_matmul.HEADER
    compiles(tmp_path, "projections", compact(cuda_matmul.HEADER), kernels)


def test_a_broken_source_fails(tmp_path: Path) -> None:
    """The check can fail: the 4-bit source with an undeclared name does not compile."""
    body = compact(cuda_qmatmul.MAIN + cuda_qmatmul.REDUCE).replace("MAGIC2", "MAGIC3", 1)
    with pytest.raises(AssertionError):
        compiles(tmp_path, "broken", compact(cuda_qmatmul.HEADER), [qmm_kernel(True, 1, 64, body)])
