"""Training-side guidance: the rows of records a trainer hands to ``tracestore.kernels.guided_fp4``.

No torch import at runtime (only under ``TYPE_CHECKING``): ``GuidanceReader`` builds these from
storage rows, and the sidecar image imports this module without torch. Tensors are checked by
duck typing (``.shape``, ``.dtype``), so the class also accepts anything tensor-like.

Example::

    g = Guidance(codes, scales, global_scale, bits=1, fmt=NVFP4)      # codes uint8[N, D*b/8]
    y = tracestore.kernels.guided_fp4(x, g)                            # x [N, D]
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Literal

from tracestore.errors import ConfigError, DTypeError, ShapeError
from tracestore.formats import FP4Format, check_bits, get_format, packed_row_bytes

if TYPE_CHECKING:  # pragma: no cover
    import torch

RULES = ("bracket", "paper")


def _dtype_name(t: Any) -> str:
    return str(getattr(t, "dtype", type(t).__name__)).replace("torch.", "")


def _shape(t: Any, name: str) -> tuple[int, ...]:
    shape = getattr(t, "shape", None)
    if shape is None:
        raise DTypeError(f"{name} must be a tensor, got {type(t).__name__}")
    return tuple(int(s) for s in shape)


@dataclasses.dataclass(frozen=True)
class Guidance:
    """Records aligned row-for-row to a training microbatch (one site).

    ``codes`` uint8[N, width*bits/8] packed low-b code bits (docs/numerics.md §6), ``scales``
    uint8[N, width/block] raw rollout scale bytes (row-major), ``global_scale`` the rollout's
    decode-side g: float32[N] (one per row: rows come from different forwards) or a float,
    ``token_scales`` optional float32[N], ``valid`` optional bool[N] (False: no record, the row
    falls back to RTN, docs/numerics.md §8). ``rule`` is "bracket" (default) or "paper" (§7).
    """

    codes: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor | float
    bits: int
    fmt: FP4Format
    rule: Literal["bracket", "paper"] = "bracket"
    token_scales: torch.Tensor | None = None
    valid: torch.Tensor | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "fmt", get_format(self.fmt))
        object.__setattr__(self, "bits", check_bits(self.bits))
        if self.rule not in RULES:
            raise ConfigError(f"rule must be one of {RULES}, got {self.rule!r}")
        cshape = _shape(self.codes, "codes")
        sshape = _shape(self.scales, "scales")
        for name, t in (("codes", self.codes), ("scales", self.scales)):
            if _dtype_name(t) != "uint8":
                raise DTypeError(f"{name} must be uint8, got {_dtype_name(t)}")
        if len(cshape) != 2 or len(sshape) != 2:
            raise ShapeError(f"codes and scales must be 2-D [rows, bytes], got {cshape} and {sshape}")
        n, nblocks = sshape
        width = nblocks * self.fmt.block
        if cshape != (n, packed_row_bytes(width, self.bits)):
            raise ShapeError(
                f"codes must be [{n}, {packed_row_bytes(width, self.bits)}] for {nblocks} {self.fmt} scale "
                f"blocks per row (width {width}) at bits={self.bits}, got {list(cshape)}"
            )
        if isinstance(self.global_scale, (int, float)) and not isinstance(self.global_scale, bool):
            object.__setattr__(self, "global_scale", float(self.global_scale))
        else:
            gshape = _shape(self.global_scale, "global_scale")
            if gshape not in ((), (n,)):
                raise ShapeError(f"global_scale must be a float, a scalar tensor or float32[{n}], got {list(gshape)}")
            if _dtype_name(self.global_scale) != "float32":
                raise DTypeError(f"global_scale must be float32, got {_dtype_name(self.global_scale)}")
        if self.token_scales is not None and (
            _shape(self.token_scales, "token_scales") != (n,) or _dtype_name(self.token_scales) != "float32"
        ):
            raise ShapeError(
                f"token_scales must be float32[{n}], got {_dtype_name(self.token_scales)}"
                f"{list(_shape(self.token_scales, 'token_scales'))}"
            )
        if self.valid is not None and (_shape(self.valid, "valid") != (n,) or _dtype_name(self.valid) != "bool"):
            raise ShapeError(
                f"valid must be bool[{n}], got {_dtype_name(self.valid)}{list(_shape(self.valid, 'valid'))}"
            )

    @property
    def n_rows(self) -> int:
        return int(self.scales.shape[0])

    @property
    def width(self) -> int:
        """Values per row: scale blocks × block size."""
        return int(self.scales.shape[1]) * self.fmt.block

    def to(self, device: Any, non_blocking: bool = False) -> Guidance:
        """The same guidance with every tensor moved to ``device`` (e.g. pinned CPU -> cuda)."""

        def mv(t: Any) -> Any:
            return t if t is None or isinstance(t, float) else t.to(device, non_blocking=non_blocking)

        return dataclasses.replace(
            self,
            codes=mv(self.codes),
            scales=mv(self.scales),
            global_scale=mv(self.global_scale),
            token_scales=mv(self.token_scales),
            valid=mv(self.valid),
        )
