"""Named launch arguments: one frozen, keyword-only record per CUDA kernel in ``_source.py``.

A raw kernel takes its arguments as one positional tuple, 13 to 17 of them for the record and
guided kernels, and a swapped pair of strides would go unnoticed until the GPU tests. Here a call
site names every argument (``RecordKV(pool=..., pool_page=..., ...)``). A record's fields are its
kernel's parameter names in the kernel's order, where a :class:`ParamGroup` field (such as
:class:`RowsOut`) stands for a run of parameters that several kernels share; this is checked once,
when the module is imported, against the signatures parsed from ``SOURCE``. Each value is
converted by the C type declared there (pointer -> uint64 device address of a tensor, 0 for None;
``i64`` -> int64; ``u32`` -> uint32; ``int`` -> int32), so the tuple :meth:`KernelParams.astuple`
builds cannot disagree with the kernel in order, count or width. Template arguments stay in the
launch's name expression (``_launch.launch``), which must name the record's kernel.
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


class _Fields:
    __slots__ = ()


class ParamGroup(_Fields):
    """A run of consecutive parameters that several kernels share (decorate with
    :func:`param_group`): a record's field of this type stands for all of them, in the group's field
    order."""

    __slots__ = ()


GROUPS: dict[str, type[ParamGroup]] = {}
G = TypeVar("G", bound=ParamGroup)


def param_group(cls: type[G]) -> type[G]:
    GROUPS[cls.__name__] = cls
    return cls


def flat_fields(cls: type[_Fields]) -> tuple[tuple[str, str], ...]:
    """(attribute path, annotation) of each kernel parameter a record holds, groups expanded, in
    order: ``RecordKV`` gives ``("pool", "Tensor"), ..., ("out.codes_out", "Tensor"), ...``."""
    out: list[tuple[str, str]] = []
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        group = GROUPS.get(f.type) if isinstance(f.type, str) else None
        if group is None:
            out.append((f.name, str(f.type)))
        else:
            out += [(f"{f.name}.{path}", t) for path, t in flat_fields(group)]
    return tuple(out)


class KernelParams(_Fields):
    """Base of the parameter records: :meth:`astuple` is the kernel's argument tuple."""

    __slots__ = ()
    KERNEL: ClassVar[str]
    _FIELDS: ClassVar[Callable[[Any], tuple[Any, ...]]]  # the parameter values in order
    _CONVERT: ClassVar[tuple[Callable[[Any], Any], ...]]  # one converter per parameter

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
        paths = tuple(path for path, _ in flat_fields(cls))
        fields = tuple(path.rpartition(".")[2] for path in paths)
        want = tuple(p.name for p in sig)
        if fields != want:
            raise TypeError(f"{cls.__name__} fields {fields} are not {kernel}'s parameters {want}, in order")
        unknown = [p for p in sig if not p.pointer and p.ctype not in _SCALARS]
        if unknown:
            raise TypeError(f"{kernel}: no argument conversion for C type {unknown[0].ctype} ({unknown[0].name})")
        cls.KERNEL = kernel
        get = operator.attrgetter(*paths)  # one C call for all values; a bare value for one path
        cls._FIELDS = staticmethod(get if len(paths) > 1 else lambda obj: (get(obj),))  # type: ignore[assignment]
        cls._CONVERT = tuple(_ptr if p.pointer else _SCALARS[p.ctype] for p in sig)
        RECORDS[kernel] = cls
        return cls

    return bind


def fastdiv(d: int) -> tuple[int, int]:
    """(m, sh) for the kernels' ``fast_div``: ``idx // d == umulhi(idx, m) >> sh`` for idx < 2^31
    (round-up multiplier, Granlund & Montgomery 1994); m = 0 stands for d = 1."""
    if d < 1 or d >= 1 << 31:
        raise ValueError(f"divisor must be in [1, 2^31), got {d}")
    if d == 1:
        return 0, 0
    shift = (d - 1).bit_length()
    return (1 << (31 + shift)) // d + 1, shift - 1


# ------------------------------------------------------------------------------------------ groups


@param_group
@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RowDiv(ParamGroup):
    """``ng`` threads per row, and ``fast_div``'s constants for ``row = idx / ng`` (:meth:`of`)."""

    ng: int
    div_m: int
    div_sh: int

    @classmethod
    def of(cls, ng: int) -> RowDiv:
        div_m, div_sh = fastdiv(ng)
        return cls(ng=ng, div_m=div_m, div_sh=div_sh)


@param_group
@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RowsOut(ParamGroup):
    """Where ``record_codes`` and ``record_kv`` write: code and scale rows, g in (one value, or one
    per row with ``g_in_stride`` 1) and g out (strided: a RecordSlab interleaves its sites)."""

    codes_out: Tensor
    c_stride: int
    scales_out: Tensor
    so_stride: int
    g_ptr: Tensor | None
    g_in_stride: int
    g_out: Tensor
    g_stride: int


@param_group
@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class GuidedRows(ParamGroup):
    """The record rows ``guided_b1`` and ``guided_fwd`` round toward (all None for RTN), their g,
    token scales, and the valid / row-gather / mask vectors."""

    codes: Tensor | None
    c_stride: int
    scales: Tensor | None
    s_stride: int
    g: Tensor
    g_per_row: int
    ts: Tensor | None
    valid: Tensor | None
    rows: Tensor | None
    mask: Tensor | None


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
    div: RowDiv
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
    div: RowDiv
    out: RowsOut


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
    out: RowsOut


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
    div: RowDiv
    records: GuidedRows
    y: Tensor
    y_stride: int


@kernel_params("guided_fwd")
@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class GuidedFwd(KernelParams):
    x: Tensor
    x_stride: int
    n_rows: int
    nb: int
    records: GuidedRows
    lut: Tensor | None  # None for RTN (MODE 1)
    y: Tensor
    y_stride: int
