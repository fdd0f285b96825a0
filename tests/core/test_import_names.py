"""No folder of the repository shadows another distribution's top-level package, whatever the
working directory: ``client/`` and ``server/`` are importable only as ``tracestore.client`` and
``tracestore.server``; the kernels live inside the package (``tracestore/kernels/``); ``proto/``, ``bench/``,
``tests/`` and ``examples/`` have no ``__init__.py``, so a package of that name elsewhere wins.

Each check runs a fresh interpreter with the repository root first on ``sys.path`` (``python -c``
and ``python -m`` from the root do that; so does a Ray job whose working_dir is the checkout).
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NAMES = ("kernels", "client", "server", "proto", "bench", "tests", "examples")
SOURCE_PACKAGES = ("client", "server")


def _python(code: str, *args: str, env: dict[str, str] | None = None, timeout: float = 120) -> str:
    proc = subprocess.run(
        [sys.executable, *args, "-c", textwrap.dedent(code)],
        cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def _hub_kernels() -> str:
    try:
        return importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("Hugging Face's `kernels` package is not installed (transformers >= 5.25 installs it)")


@pytest.mark.parametrize("name", NAMES)
def test_a_package_of_that_name_elsewhere_wins_from_the_repository_root(name: str, tmp_path: Path) -> None:
    other = tmp_path / "site" / name
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("WHO = 'elsewhere'\n")
    (other / "sub.py").write_text("WHAT = 'theirs'\n")
    out = _python(
        f"""
        import sys
        assert sys.path[0] in ('', {str(ROOT)!r}), sys.path[:2]
        import {name}, {name}.sub
        assert {name}.WHO == 'elsewhere', {name}.__file__
        assert {name}.sub.WHAT == 'theirs'
        print({name}.__file__)
        """,
        env={"PYTHONPATH": str(tmp_path / "site")},
    )
    assert str(other) in out


@pytest.mark.parametrize("name", SOURCE_PACKAGES)
def test_with_no_other_package_the_source_folder_is_not_importable(name: str) -> None:
    # -S: no site-packages, so nothing else of that name exists; the folder itself must not answer
    _python(
        f"""
        try:
            import {name}
        except ModuleNotFoundError as e:
            assert e.name == {name!r}, e
            assert 'tracestore.{name}' in str(e), e
        else:
            raise SystemExit('imported ' + {name}.__file__)
        """,
        "-S",
    )


def test_the_tracestore_names_still_work_beside_the_hub_package() -> None:
    _hub_kernels()
    pytest.importorskip("torch", reason="tracestore.kernels needs the [torch] extra")
    _python(
        """
        import kernels, tracestore.kernels, tracestore.client, tracestore.server
        assert 'site-packages' in kernels.__file__, kernels.__file__
        assert tracestore.kernels.guided_fp4.__module__.startswith('tracestore.kernels')
        assert tracestore.client.RolloutRecorder.__module__ == 'tracestore.client.record.recorder'
        """
    )


def test_transformers_builds_an_moe_model_from_the_repository_root() -> None:
    """What failed with transformers 5.25: `from kernels import CUDAProperties` got our folder."""
    _hub_kernels()
    pytest.importorskip("transformers")
    out = _python(
        """
        import transformers.activations, kernels
        from kernels import CUDAProperties
        print(kernels.__file__)
        """
    )
    assert "site-packages" in out


@pytest.mark.slow
def test_pytest_of_an_moe_hooks_test_and_the_demo_cli_from_the_repository_root() -> None:
    _hub_kernels()
    pytest.importorskip("transformers")
    test = "tests/client/hf/test_hf_hooks.py::test_key_is_seen_after_the_rotary_embedding"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    proc = subprocess.run(
        [sys.executable, "-m", "tracestore", "demo", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and "demo" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.slow
def test_a_ray_task_with_the_checkout_as_working_dir() -> None:
    _hub_kernels()
    pytest.importorskip("ray")
    pytest.importorskip("transformers")
    out = _python(
        f"""
        import ray
        ray.init(address='local', num_cpus=1, include_dashboard=False, object_store_memory=80 << 20,
                 runtime_env={{'working_dir': {str(ROOT)!r}}})

        @ray.remote
        def probe():
            import os, sys
            import transformers.activations, kernels, tracestore.kernels
            from kernels import CUDAProperties
            here = os.path.realpath(os.getcwd())
            assert any(os.path.realpath(p or '.') == here for p in sys.path), sys.path
            assert os.path.isdir(os.path.join(here, 'client')), here
            return kernels.__file__, tracestore.kernels.__name__

        hub, ours = ray.get(probe.remote(), timeout=240)
        ray.shutdown()
        print(hub, ours)
        """,
        timeout=300,
    )
    assert "site-packages" in out and "tracestore.kernels" in out, out


def test_without_the_hub_package_nothing_reports_it_installed(tmp_path: Path) -> None:
    """Where Hugging Face's `kernels` is not installed (transformers < 5.25 has it optional), the
    checkout must not answer `find_spec("kernels")`: transformers then imported it
    to read its version and every MoE model failed to import (the GPU suite, transformers 5.17)."""
    import sysconfig

    purelib = Path(sysconfig.get_paths()["purelib"])
    site = tmp_path / "site"  # this interpreter's site-packages without the hub package
    site.mkdir()
    for entry in purelib.iterdir():
        if entry.name != "kernels" and not entry.name.startswith("kernels-"):
            (site / entry.name).symlink_to(entry)
    out = _python(
        """
        import importlib.util, sys
        assert importlib.util.find_spec('kernels') is None, importlib.util.find_spec('kernels')
        import tracestore
        assert importlib.util.find_spec('kernels') is None, importlib.util.find_spec('kernels')
        try:
            from transformers.utils.import_utils import is_kernels_available
        except ImportError:
            pass
        else:
            assert not is_kernels_available()
        print('hidden')
        """,
        "-S",
        env={"PYTHONPATH": str(site)},
    )
    assert "hidden" in out
