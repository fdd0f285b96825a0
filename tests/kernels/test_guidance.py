import subprocess
import sys

import pytest
import torch

from tracestore.errors import ConfigError, DTypeError, ShapeError
from tracestore.formats import MXFP4, NVFP4, get_format
from tracestore.guidance import Guidance


def _g(n=3, width=64, bits=1, fmt=NVFP4, **kw):
    fmt = get_format(fmt)
    return Guidance(
        torch.zeros(n, width * bits // 8, dtype=torch.uint8),
        torch.zeros(n, width // fmt.block, dtype=torch.uint8),
        kw.pop("global_scale", torch.ones(n)),
        bits,
        fmt,
        **kw,
    )


def test_valid_guidance_properties():
    g = _g(bits=3, fmt="mxfp4")
    assert g.fmt == MXFP4 and g.width == 64 and g.n_rows == 3 and g.bits == 3
    assert _g(global_scale=2).global_scale == 2.0
    moved = _g(valid=torch.ones(3, dtype=torch.bool)).to("cpu")
    assert moved.valid is not None and moved.valid.dtype == torch.bool


@pytest.mark.parametrize(
    "kw, err",
    [
        ({"bits": 5}, ConfigError),
        ({"rule": "nearest"}, ConfigError),
        ({"global_scale": torch.ones(4)}, ShapeError),
        ({"global_scale": torch.ones(3, dtype=torch.float64)}, DTypeError),
        ({"token_scales": torch.ones(2)}, ShapeError),
        ({"valid": torch.ones(3)}, ShapeError),
    ],
)
def test_bad_guidance_raises(kw, err):
    with pytest.raises(err):
        _g(**kw)


def test_codes_width_must_match_scales():
    with pytest.raises(ShapeError, match="codes must be"):
        Guidance(torch.zeros(2, 7, dtype=torch.uint8), torch.zeros(2, 4, dtype=torch.uint8), 1.0, 1, NVFP4)
    with pytest.raises(DTypeError):
        Guidance(torch.zeros(2, 8), torch.zeros(2, 4, dtype=torch.uint8), 1.0, 1, NVFP4)


def test_guidance_module_does_not_import_torch():
    code = "import sys, tracestore.guidance; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
