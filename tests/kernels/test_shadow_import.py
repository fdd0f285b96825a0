"""Importing ``kernels`` with the repository root on ``sys.path`` (``python -m pytest`` from a
checkout) must never execute ``kernels/guided.py`` a second time: torch would re-define
``tracestore::guided_fp4``, destroy the first definition (``get_library_allowing_overwrite``) and
``tracestore.kernels.guided_fp4`` would call a freed operator (``std::bad_alloc`` or a segfault).
The name ``kernels`` yields Hugging Face's kernel-hub package when it is installed
(tests/core/test_import_names.py)."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]

CODE = f"""
import importlib, sys
import torch
from torch._library.custom_ops import OPDEFS
import tracestore.kernels.guided as kg
from tracestore.formats import NVFP4
from tracestore.fp4 import quantize
from tracestore.guidance import Guidance
from tracestore.packing import pack_bits

ops = {{name: OPDEFS[name] for name in ("tracestore::guided_fp4", "tracestore::rtn_fp4")}}
sys.path.insert(0, {str(ROOT)!r})
shadow = importlib.import_module("kernels")  # what transformers' is_kernels_available() does
assert not hasattr(shadow, "guided_fp4"), "the source tree's kernels/ ran as a second copy of tracestore.kernels"
for sub in ("guided", "record"):
    try:
        importlib.import_module("kernels." + sub)
    except ImportError:
        pass
    else:
        raise AssertionError("kernels." + sub + " was importable beside tracestore.kernels." + sub)
for name, opdef in ops.items():
    assert OPDEFS[name] is opdef, name + " was re-defined by a second import of kernels/guided.py"
x = torch.linspace(-1, 1, 64).reshape(4, 16)
q = quantize(x, NVFP4, None)
gd = Guidance(pack_bits(q.codes, 1), q.scales, float(q.global_scale), 1, NVFP4, "bracket")
for _ in range(20):
    assert kg.guided_fp4(x, gd).shape == x.shape
    assert kg.rtn_fp4(x, "nvfp4").shape == x.shape
"""


def test_source_tree_kernels_dir_does_not_redefine_the_ops():
    subprocess.run([sys.executable, "-c", CODE], check=True, timeout=120, cwd=ROOT)


def test_transformers_probe_leaves_the_ops_alone():
    """The import that hit the test suite: transformers' probe for the kernel-hub package."""
    code = (
        "import sys, torch\n"
        "from torch._library.custom_ops import OPDEFS\n"
        "import tracestore.kernels.guided as kg\n"
        "before = OPDEFS['tracestore::guided_fp4']\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "try:\n"
        "    from transformers.utils import is_kernels_available\n"
        "except ImportError:\n"
        "    sys.exit(0)\n"
        "import importlib.metadata\n"
        "try:\n"
        "    importlib.metadata.version('kernels')\n"
        "    hub = True\n"
        "except importlib.metadata.PackageNotFoundError:\n"
        "    hub = False\n"
        "assert is_kernels_available() == hub\n"
        "assert 'kernels.guided' not in sys.modules\n"
        "assert OPDEFS['tracestore::guided_fp4'] is before\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=ROOT)
