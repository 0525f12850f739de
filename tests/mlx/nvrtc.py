"""Compile an MLX CUDA kernel's source the way mx.fast.cuda_kernel assembles it (the signature from
the input and output names, the template constants, the body), with NVRTC for sm_90, on a machine
without a GPU. MLX's device header is replaced by the few declarations the kernels use from it;
NVRTC, the CUDA headers and libcu++ come from the nvidia-cuda-* wheels (dev extra, Linux x86-64)."""

from __future__ import annotations

import ctypes
import importlib.util
from pathlib import Path

HEADER = r"""
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
#include <cuda/std/limits>
#include <cooperative_groups.h>
namespace mlx::core::cu {
using Shape = cuda::std::array<int32_t, 10>;
using Strides = cuda::std::array<int64_t, 10>;
}
"""

C_TYPES = {
    "bfloat16": "__nv_bfloat16",
    "float16": "__half",
    "float32": "float",
    "int32": "int32_t",
    "uint32": "uint32_t",
}


def _pkg(name: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(f"nvidia.{name}")
    except ModuleNotFoundError:
        return None
    return Path(next(iter(spec.submodule_search_locations))) if spec else None


def available() -> str | None:
    """None when NVRTC and the headers are installed, else why not."""
    for name in ("cuda_nvrtc", "cuda_runtime", "cuda_cccl"):
        if _pkg(name) is None:
            pkg = f"nvidia-{name.replace('_', '-')}-cu12"
            return f"{pkg} is not installed (dev extra, Linux x86-64)"
    return None


def source(name, inputs, outputs, body, header, template) -> str:
    """inputs / outputs: [(name, dtype)]; template: [(name, int | bool | dtype string)]."""
    args = []
    for n, dt in inputs:
        args.append(f"const {C_TYPES[dt]}* {n}")
        if n + "_shape" in body:
            args.append(f"const __grid_constant__ Shape {n}_shape")
    args += [f"{C_TYPES[dt]}* {n}" for n, dt in outputs]
    consts = []
    for n, v in template:
        if isinstance(v, bool):
            consts.append(f"  constexpr bool {n} = {'true' if v else 'false'};")
        elif isinstance(v, int):
            consts.append(f"  constexpr int {n} = {v};")
        else:
            consts.append(f"  using {n} = {C_TYPES[v]};")
    return (
        HEADER
        + header
        + "namespace mlx::core::cu {\nnamespace cg = cooperative_groups;\n"
        + f"__global__ void {name}(\n    "
        + ",\n    ".join(args)
        + ") {\n"
        + "\n".join(consts)
        + "\n"
        + body
        + "\n}\n}\n"
    )


def compile_log(src: str, name: str = "kernel") -> tuple[int, str]:
    """(NVRTC's result code, its log); 0 is success."""
    lib = ctypes.CDLL(str(_pkg("cuda_nvrtc") / "lib" / "libnvrtc.so.12"))
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(
        ctypes.byref(prog), src.encode(), f"{name}.cu".encode(), 0, None, None
    )
    if rc:
        return rc, "nvrtcCreateProgram failed"
    opts = [
        f"-I{_pkg('cuda_runtime') / 'include'}",
        f"-I{_pkg('cuda_cccl') / 'include'}",
        "--gpu-architecture=compute_90",
        "-std=c++17",
        "-default-device",
    ]
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, log)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc, log.value.decode(errors="replace")
