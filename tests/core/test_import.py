"""The sidecar image has no torch: importing tracestore (and server/client) must not load it."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["tracestore", "tracestore.server", "tracestore.client", "tracestore.formats"])
def test_import_does_not_load_torch(module):
    code = (
        f"import sys, {module}\n"
        "bad = [m for m in ('torch', 'cupy', 'triton') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_lazy_names_resolve():
    import tracestore

    assert callable(tracestore.guided_round) and callable(tracestore.quantize)
    with pytest.raises(AttributeError):
        tracestore.no_such_name  # noqa: B018
