"""Compile-once cache and launcher for the CUDA kernels in ``_source.py`` (CuPy, imported lazily).

Each template instantiation is compiled by NVRTC on first use (CuPy also caches the binary on
disk) and launched on torch's *current* stream with raw pointers as arguments (named in a
parameter record of ``_params.py``, which builds the positional tuple): no CuPy arrays, no
allocation, no synchronization, so launches can be captured in a ``torch.cuda.CUDAGraph``.
Compile every kernel a graph will use *before* capturing it (call the op once, or ``warmup``):
loading a module is not a capturable operation.
"""

from __future__ import annotations

import threading
from typing import Any

from tracestore.errors import ConfigError, MissingExtraError

from ._params import KernelParams
from ._source import SOURCE

# -fmad=false: the reference rounds after every multiply; a contracted a*b+c would not (docs/numerics.md §3).
# --ftz=false: subnormal scales (E8M0 2^-127) and activations must not be flushed to zero; the first
# device run without it lost them in the MX guided tests. IEEE division and square root throughout.
_OPTIONS = ("--std=c++17", "-fmad=false", "--ftz=false", "--prec-div=true", "--prec-sqrt=true")
_BLOCK = 256
_lock = threading.Lock()
_modules: dict[tuple[str, int], Any] = {}
_streams: dict[tuple[int, int], Any] = {}


def cupy_module() -> Any:
    """Import CuPy or raise :class:`MissingExtraError` naming the ``gpu`` extra."""
    try:
        import cupy
    except ImportError as exc:  # pragma: no cover - exercised only without CuPy
        raise MissingExtraError(
            "the tracestore GPU kernels need CuPy: install it with `pip install 'tracestore[gpu]'` "
            "(cupy-cuda12x or cupy-cuda13x matching your CUDA driver)"
        ) from exc
    return cupy


def have_cupy() -> bool:
    try:
        cupy_module()
    except MissingExtraError:
        return False
    return True


def _compile(name_expr: str, device_index: int) -> Any:
    """NVRTC -> cubin for this device -> a loaded CuPy ``Function``.

    Not ``cupy.RawModule(code=...)``: CuPy appends ``-ftz=true`` after the caller's options, and a
    flushed subnormal (an E8M0 scale of 2^-127, a tiny activation) breaks bit-exactness with the
    reference (MX guided outputs -0.0 instead of -3.5e-38)."""
    cupy = cupy_module()
    from cupy.cuda import function
    from cupy_backends.cuda.libs import nvrtc

    dev = cupy.cuda.Device(device_index)
    with dev:
        cc = dev.compute_capability
        has_cubin = hasattr(nvrtc, "getCUBIN")
        arch = f"--gpu-architecture={'sm' if has_cubin else 'compute'}_{cc}"
        prog = nvrtc.createProgram(SOURCE, "tracestore_kernels.cu", (), ())
        try:
            nvrtc.addNameExpression(prog, name_expr)
            try:
                nvrtc.compileProgram(prog, (*_OPTIONS, arch))
            except Exception as exc:
                raise RuntimeError(f"NVRTC failed on {name_expr}: {nvrtc.getProgramLog(prog)}") from exc
            lowered = nvrtc.getLoweredName(prog, name_expr)
            image = nvrtc.getCUBIN(prog) if has_cubin else nvrtc.getPTX(prog)
        finally:
            nvrtc.destroyProgram(prog)
        mod = function.Module()
        mod.load(image)
        return mod, mod.get_function(lowered)


def get_kernel(name_expr: str, device_index: int) -> Any:
    """The compiled kernel for e.g. ``"record_act<1,0,1,0>"`` on a device (compiled once)."""
    key = (name_expr, device_index)
    fn = _modules.get(key)
    if fn is None:
        with _lock:
            fn = _modules.get(key)
            if fn is None:
                _modules[key] = _compile(name_expr, device_index)  # (module, function): keep both alive
                fn = _modules[key]
    return fn[1]


def _stream(device_index: int, ptr: int) -> Any:
    key = (device_index, ptr)
    s = _streams.get(key)
    if s is None:
        cupy = cupy_module()
        with cupy.cuda.Device(device_index):
            s = cupy.cuda.ExternalStream(ptr)
        _streams[key] = s
    return s


def _args(name_expr: str, params: KernelParams) -> tuple[Any, ...]:
    if name_expr.partition("<")[0] != params.KERNEL:
        raise ConfigError(f"{type(params).__name__} holds the arguments of {params.KERNEL}, not of {name_expr}")
    return params.astuple()


def launch(name_expr: str, device: Any, n_threads: int, params: KernelParams) -> None:
    """Launch ``n_threads`` threads (blocks of 256) of a kernel on torch's current stream of
    ``device`` with the arguments of ``params`` (the record of the kernel that ``name_expr``
    instantiates)."""
    import torch

    args = _args(name_expr, params)
    if n_threads <= 0:
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    fn = get_kernel(name_expr, index)
    cupy = cupy_module()
    stream = _stream(index, torch.cuda.current_stream(device).cuda_stream)
    grid = ((n_threads + _BLOCK - 1) // _BLOCK,)
    with cupy.cuda.Device(index), stream:
        fn(grid, (_BLOCK,), args)


def launch_grid(name_expr: str, device: Any, grid: int, params: KernelParams) -> None:
    """Launch ``grid`` blocks of 256 threads (grid-stride kernels) on torch's current stream."""
    import torch

    args = _args(name_expr, params)
    index = device.index if device.index is not None else torch.cuda.current_device()
    fn = get_kernel(name_expr, index)
    cupy = cupy_module()
    stream = _stream(index, torch.cuda.current_stream(device).cuda_stream)
    with cupy.cuda.Device(index), stream:
        fn((grid,), (_BLOCK,), args)
