"""Named launch arguments: one frozen, keyword-only record per CUDA kernel in ``_source.py``.

A raw kernel takes its arguments as one positional tuple, 13 to 17 of them for the record and
guided kernels, and a swapped pair of strides would go unnoticed until the GPU tests. Here a call
site names every argument (``RecordKV(pool=..., pool_page=..., ...)``); the record's fields are
the kernel's parameter names in the kernel's order, checked once, when this module is imported,
against the signature parsed from ``SOURCE``; and each value is converted by the C type declared
there (pointer -> uint64 device address of a tensor, 0 for None; ``i64`` -> int64; ``u32`` ->
uint32; ``int`` -> int32), so the tuple :meth:`KernelParams.astuple` builds cannot disagree with
the kernel in order, count or width. Template arguments stay in the launch's name expression
(``_launch.launch``), which must name the record's kernel.
"""

from __future__ import annotations

import dataclasses
import operator
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import numpy as np

from ._source import SOURCE

if TYPE_CHECKING:
    from torch import Tensor

_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)
_KERNEL = re.compile(r"__global__\s+void\s+(\w+)\s*\(([^)]*)\)")


@dataclasses.dataclass(frozen=True)
class Param:
    """One kernel parameter as declared in the CUDA source: ``const u8* __restrict__ x`` is
    ``Param("u8", "x", pointer=True)``."""

    ctype: str
    name: str
    pointer: bool


def parse_signatures(source: str) -> dict[str, tuple[Param, ...]]:
    """Every ``__global__`` kernel of a CUDA source and its parameters, in declaration order."""
    out: dict[str, tuple[Param, ...]] = {}
    for m in _KERNEL.finditer(_COMMENT.sub(" ", source)):
        kernel, params = m.group(1), []
        for text in m.group(2).split(","):
            tokens = text.replace("*", " * ").split()
            words = [t for t in tokens if t not in ("*", "const", "__restrict__")]
            if len(words) != 2:
                raise ValueError(f"cannot read parameter {text.strip()!r} of kernel {kernel}")
            params.append(Param(words[0], words[1], "*" in tokens))
        if kernel in out:
            raise ValueError(f"kernel {kernel} is declared twice")
        out[kernel] = tuple(params)
    return out


SIGNATURES = parse_signatures(SOURCE)


def _ptr(t: Tensor | None) -> np.uint64:
    return np.uint64(0 if t is None else t.data_ptr())


_SCALARS: dict[str, Callable[[Any], Any]] = {"i64": np.int64, "u32": np.uint32, "int": np.int32}


class KernelParams:
    """Base of the parameter records: :meth:`astuple` is the kernel's argument tuple."""

    __slots__ = ()
    KERNEL: ClassVar[str]
    _FIELDS: ClassVar[Callable[[Any], tuple[Any, ...]]]  # the field values in order
    _CONVERT: ClassVar[tuple[Callable[[Any], Any], ...]]  # one converter per field

    def astuple(self) -> tuple[Any, ...]:
        return tuple([convert(v) for convert, v in zip(self._CONVERT, type(self)._FIELDS(self), strict=True)])


RECORDS: dict[str, type[KernelParams]] = {}
P = TypeVar("P", bound=KernelParams)


def kernel_params(kernel: str) -> Callable[[type[P]], type[P]]:
    """Class decorator: bind a dataclass of fields to ``kernel``, refusing fields that are not the
    kernel's parameters by name and order, and a C type without a converter."""

    def bind(cls: type[P]) -> type[P]:
        if kernel not in SIGNATURES:
            raise TypeError(f"{cls.__name__}: no __global__ kernel {kernel} in kernels/_source.py")
        sig = SIGNATURES[kernel]
        fields = tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]
        want = tuple(p.name for p in sig)
        if fields != want:
            raise TypeError(f"{cls.__name__} fields {fields} are not {kernel}'s parameters {want}, in order")
        unknown = [p for p in sig if not p.pointer and p.ctype not in _SCALARS]
        if unknown:
            raise TypeError(f"{kernel}: no argument conversion for C type {unknown[0].ctype} ({unknown[0].name})")
        cls.KERNEL = kernel
        get = operator.attrgetter(*want)  # one C call for all fields; a bare value for one field
        cls._FIELDS = staticmethod(get if len(want) > 1 else lambda obj: (get(obj),))  # type: ignore[assignment]
        cls._CONVERT = tuple(_ptr if p.pointer else _SCALARS[p.ctype] for p in sig)
        RECORDS[kernel] = cls
        return cls

    return bind


# ------------------------------------------------------------------------------------ rollout side


@kernel_params("amax_abs")
@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class AmaxAbs(KernelParams):
    x: Tensor
    n16: int
    amax_bits: Tensor


@kernel_params("finalize_g")
@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class FinalizeG(KernelParams):
    g: Tensor


@kernel_params("record_act")
@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RecordAct(KernelParams):
    x: Tensor
    x_stride: int
    n_rows: int
    ng: int
    div_m: int
    div_sh: int
    g_ptr: Tensor | None
    codes_out: Tensor
    c_stride: int
    scales_out: Tensor
    s_stride: int
    g_out: Tensor
    g_stride: int
    fp4_out: Tensor | None
    f_stride: int


@kernel_params("record_codes")
@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RecordCodes(KernelParams):
    packed: Tensor
    p_stride: int
    scales: Tensor
    s_stride: int
    n_rows: int
    ng: int
    div_m: int
    div_sh: int
    codes_out: Tensor
    c_stride: int
    scales_out: Tensor
    so_stride: int
    g_ptr: Tensor | None
    g_in_stride: int
    g_out: Tensor
    g_stride: int


@kernel_params("record_kv")
@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RecordKV(KernelParams):
    pool: Tensor
    pool_page: int
    pool_slot: int
    spool: Tensor
    spool_page: int
    spool_slot: int
    page_table: Tensor
    pt64: int
    page_size: int
    token_start: int
    n_tokens: int
    nb: int
    codes_out: Tensor
    c_stride: int
    scales_out: Tensor
    so_stride: int
    g_ptr: Tensor | None
    g_in_stride: int
    g_out: Tensor
    g_stride: int


@kernel_params("stage_rows")
@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StageRows(KernelParams):
    src: Tensor
    n16: int
    ring: Tensor
    slot_bytes: int
    slot: Tensor


# ----------------------------------------------------------------------------------- training side


@kernel_params("guided_b1")
@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class GuidedB1(KernelParams):
    x: Tensor
    x_stride: int
    n_rows: int
    ng: int
    div_m: int
    div_sh: int
    codes: Tensor
    c_stride: int
    scales: Tensor
    s_stride: int
    g: Tensor
    g_per_row: int
    ts: Tensor | None
    valid: Tensor | None
    rows: Tensor | None
    mask: Tensor | None
    y: Tensor
    y_stride: int


@kernel_params("guided_fwd")
@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class GuidedFwd(KernelParams):
    x: Tensor
    x_stride: int
    n_rows: int
    nb: int
    codes: Tensor | None  # None for RTN (MODE 1): no records
    c_stride: int
    scales: Tensor | None
    s_stride: int
    g: Tensor
    g_per_row: int
    ts: Tensor | None
    valid: Tensor | None
    rows: Tensor | None
    mask: Tensor | None
    lut: Tensor | None
    y: Tensor
    y_stride: int
