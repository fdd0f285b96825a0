"""Helpers for tests and benches: comparing kernel output with the reference bit for bit, and
capturing a CUDA graph the way capture needs it."""

from __future__ import annotations

from collections.abc import Callable

import torch

_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def bits_mismatch(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """None if ``a`` and ``b`` are bit-identical (any NaN matches any NaN), else a description."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"dtype/shape differ: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
    a, b = a.detach().cpu(), b.detach().cpu()
    if a.dtype in _INT_VIEW:
        same = (a.view(_INT_VIEW[a.dtype]) == b.view(_INT_VIEW[a.dtype])) | (torch.isnan(a) & torch.isnan(b))
    else:
        same = a == b
    if bool(same.all()):
        return None
    bad = (~same).nonzero()
    first = tuple(int(i) for i in bad[0])
    return (
        f"{bad.shape[0]} of {a.numel()} elements differ; first at {first}: {a[first].item()!r} vs {b[first].item()!r}"
    )


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    msg = bits_mismatch(a, b)
    if msg is not None:
        raise AssertionError(f"{what}: {msg}" if what else msg)


def capture_graph(fn: Callable[[], object], *, warmup: int = 1, inner: int = 1) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``inner`` calls of ``fn``, captured after ``warmup`` calls on a side stream
    (kernels compiled and loaded, the allocator's pool warmed: what capture requires)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    return graph
