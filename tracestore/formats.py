"""FP4 formats as frozen objects, the E2M1 table and the scale-byte tables (numpy only, no torch).

Everything here is normative per ``docs/numerics.md``; the torch reference in
:mod:`tracestore.fp4` and the GPU kernels build on these constants.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np

from tracestore.errors import ConfigError

# docs/numerics.md §1: magnitude code k = code & 7 -> m_k. Code bit 3 is the sign; code 8 is -0.
E2M1_MAGNITUDES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# RTN boundaries between neighbouring magnitudes (docs/numerics.md §2); a tie goes to the even code.
E2M1_BOUNDARIES: tuple[float, ...] = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
E2M1_MAX = 6.0
SIGN_BIT = 8
MAGNITUDE_MASK = 7
NAN_CODE = 7  # docs/numerics.md §2 [choice]: NaN -> code 7 (+6)

E4M3_MAX = 448.0
E4M3_MAX_BYTE = 0x7E
E4M3_NAN_BYTE = 0x7F
E8M0_NAN_BYTE = 0xFF
E8M0_BIAS = 127
NVFP4_GLOBAL_DIVISOR = 6.0 * 448.0  # 2688: decode-side g = amax / (6 * 448)
FLT_MAX = float(np.finfo(np.float32).max)

ScaleRule = Literal["floor", "rceil"]
FormatName = Literal["nvfp4", "mxfp4"]


GUIDED_RULES = ("bracket", "paper")  # the guided-rounding rules (docs/numerics.md; tracestore.guided)


def sane_global_scale(g: float) -> float:
    """The decode-side NVFP4 g as the records store and the trainer uses it (docs/numerics.md §3):
    ``g`` rounded to float32, or 1.0 where that is not a positive finite number (0, -0, negative,
    ±inf, NaN). Positive subnormals are kept. ``sane_global_scale(float("nan")) == 1.0``."""
    with np.errstate(over="ignore"):
        v = float(np.float32(g))
    return v if 0.0 < v <= FLT_MAX else 1.0


def e2m1_values() -> np.ndarray:
    """All 16 codes' values as float32 (index = code)."""
    mags = np.asarray(E2M1_MAGNITUDES, dtype=np.float32)
    return np.concatenate([mags, -mags]).astype(np.float32)


def _e4m3_table() -> np.ndarray:
    out = np.empty(256, dtype=np.float32)
    for byte in range(256):
        sign = -1.0 if byte & 0x80 else 1.0
        exp = (byte >> 3) & 0xF
        man = byte & 0x7
        if exp == 0xF and man == 0x7:
            out[byte] = np.nan
        elif exp == 0:
            out[byte] = sign * man * 2.0**-9  # subnormal: 2^(1-7) * man/8
        else:
            out[byte] = sign * (1.0 + man / 8.0) * 2.0 ** (exp - 7)
    return out


def _e8m0_table() -> np.ndarray:
    out = np.full(256, np.nan, dtype=np.float32)  # byte 0xFF (2^128) is NaN
    out[:E8M0_NAN_BYTE] = [np.ldexp(np.float32(1.0), e - E8M0_BIAS) for e in range(E8M0_NAN_BYTE)]
    return out


E4M3_TO_FLOAT: np.ndarray = _e4m3_table()
"""float32[256]: the value of each E4M3 ("fn": bias 7, max 448, 0x7F/0xFF NaN) byte."""
E8M0_TO_FLOAT: np.ndarray = _e8m0_table()
"""float32[256]: 2^(e-127); 0xFF is NaN."""


@dataclasses.dataclass(frozen=True)
class FP4Format:
    """An FP4 block format: E2M1 elements sharing one scale per ``block`` values.

    ``NVFP4``: block 16, E4M3 scales plus a float32 decode-side global scale per tensor.
    ``MXFP4``: block 32, E8M0 scales, shared exponent by ``scale_rule`` (``floor`` = OCP MX spec,
    ``rceil`` = TE/FlashInfer/cuBLAS recipe), see docs/numerics.md §4.
    """

    name: FormatName
    block: int
    scale_rule: ScaleRule = "floor"

    def __post_init__(self) -> None:
        expected = {"nvfp4": 16, "mxfp4": 32}
        if self.name not in expected:
            raise ConfigError(f"format name must be 'nvfp4' or 'mxfp4', got {self.name!r}")
        if self.block != expected[self.name]:
            raise ConfigError(f"{self.name} uses blocks of {expected[self.name]}, got block={self.block}")
        if self.scale_rule not in ("floor", "rceil"):
            raise ConfigError(f"scale_rule must be 'floor' or 'rceil', got {self.scale_rule!r}")
        if self.name == "nvfp4" and self.scale_rule != "floor":
            raise ConfigError("scale_rule applies to MXFP4 only; NVFP4 scales are E4M3 round-to-nearest")

    @property
    def scale_dtype(self) -> Literal["e4m3", "e8m0"]:
        return "e4m3" if self.name == "nvfp4" else "e8m0"

    @property
    def has_global_scale(self) -> bool:
        return self.name == "nvfp4"

    @property
    def nan_scale_byte(self) -> int:
        return E4M3_NAN_BYTE if self.name == "nvfp4" else E8M0_NAN_BYTE

    def with_rule(self, scale_rule: ScaleRule) -> FP4Format:
        """This format with another MX scale rule, e.g. ``MXFP4.with_rule("rceil")``."""
        return dataclasses.replace(self, scale_rule=scale_rule)

    def scale_bytes_to_float(self, scales: np.ndarray) -> np.ndarray:
        """Decode raw scale bytes (uint8) to float32 (NaN bytes -> NaN)."""
        table = E4M3_TO_FLOAT if self.name == "nvfp4" else E8M0_TO_FLOAT
        return table[np.asarray(scales, dtype=np.uint8)]

    def is_nan_scale(self, scales: np.ndarray) -> np.ndarray:
        """True where a scale byte is NaN (such a record falls back to RTN, docs/numerics.md §8)."""
        s = np.asarray(scales, dtype=np.uint8)
        if self.name == "nvfp4":
            return (s & 0x7F) == E4M3_NAN_BYTE
        return s == E8M0_NAN_BYTE

    def __str__(self) -> str:
        return self.name if self.name == "nvfp4" else f"{self.name}({self.scale_rule})"


NVFP4 = FP4Format("nvfp4", 16)
MXFP4 = FP4Format("mxfp4", 32, "floor")
MXFP4_RCEIL = FP4Format("mxfp4", 32, "rceil")


def get_format(fmt: FP4Format | str) -> FP4Format:
    """Accept a format object or its name (``"nvfp4"``, ``"mxfp4"``, ``"mxfp4-rceil"``)."""
    if isinstance(fmt, FP4Format):
        return fmt
    names = {"nvfp4": NVFP4, "mxfp4": MXFP4, "mxfp4-floor": MXFP4, "mxfp4-rceil": MXFP4_RCEIL}
    if isinstance(fmt, str) and fmt.lower() in names:
        return names[fmt.lower()]
    raise ConfigError(f"unknown FP4 format {fmt!r}; expected one of {sorted(names)} or an FP4Format")


def check_bits(bits: int) -> int:
    """Validate b, the number of low code bits recorded per value (1..4)."""
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or not 1 <= int(bits) <= 4:
        raise ConfigError(f"bits must be an integer in 1..4 (b=1 keeps the mantissa bit), got {bits!r}")
    return int(bits)


def packed_row_bytes(width: int, bits: int) -> int:
    """Bytes of one token's packed low-b code bits: ceil(width * bits / 8)."""
    return (width * bits + 7) // 8
