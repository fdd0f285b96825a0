import pytest
import torch


def _gpu_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA GPU on this machine (the GPU kernels are tested on an H200 via the device runs)"
    try:
        import cupy  # noqa: F401
    except ImportError:
        return "CuPy is not installed (pip install 'tracestore[gpu]')"
    return None


GPU_REASON = _gpu_reason()


_HERE = str(__import__("pathlib").Path(__file__).resolve().parent)


def pytest_collection_modifyitems(config, items):
    for item in items:
        mine = str(item.path).startswith(_HERE)
        if mine and item.get_closest_marker("gpu") is not None and GPU_REASON is not None:
            item.add_marker(pytest.mark.skip(reason=GPU_REASON))


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)
