"""Every minimum pyproject.toml declares is true: the project installs with each direct requirement
at its declared minimum (uv's `--resolution lowest-direct`), and every module imports there.

Covers the base requirements and the `client`, `server` and `s3` extras. The torch-based extras
(`torch`, `demo`, `framework`) are not covered: their minimums would download multi-GB CUDA builds
of old torch releases (docs/dependencies.md).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[2]
EXTRAS = ("client", "server", "s3")
# Imports that belong to extras not installed here; a module needing one of them is skipped.
OTHER_EXTRAS = {"torch", "transformers", "ray", "torchao", "cupy", "triton", "matplotlib", "tqdm"}
MUST_IMPORT = ("tracestore", "tracestore.storage", "tracestore.client.record.recorder", "tracestore.client.read.reader",
               "tracestore.server.rpc.service", "tracestore.cli")  # fmt: skip

IMPORT_ALL = textwrap.dedent(
    """
    import importlib, json, pkgutil, sys
    import tracestore
    done, needs_extra, broken = [], {}, {}
    names = ["tracestore"] + [m.name for m in pkgutil.walk_packages(tracestore.__path__, "tracestore.",
                                                                   onerror=lambda name: None)
                            if not m.name.endswith(".__main__")]
    for name in names:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            root = (e.name or "").split(".")[0]
            (needs_extra if root in OTHER else broken)[name] = repr(e)
        except Exception as e:
            broken[name] = repr(e)
        else:
            done.append(name)
    print(json.dumps({"done": done, "needs_extra": needs_extra, "broken": broken}))
    """
)


def _direct_minimums() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    texts = list(project["dependencies"])
    for extra in EXTRAS:
        texts += [t for t in project["optional-dependencies"][extra] if not t.startswith("tracestore")]
    out = {}
    for text in texts:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate():
            continue
        lows = [s.version for s in req.specifier if s.operator in (">=", "==")]
        assert lows, f"{text}: no declared minimum"
        out[canonicalize_name(req.name)] = max(lows, key=Version)
    return out


def _clean_copy(dest: Path) -> Path:
    """The checkout's files (tracked, and untracked ones git does not ignore) copied to ``dest``:
    what a fresh clone builds, without the checkout's ``build/`` (setuptools reuses it, so a module
    moved or deleted since the last build would still be packaged)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            check=True, capture_output=True).stdout.decode().split("\0")  # fmt: skip
    for rel in filter(None, listed):
        path = ROOT / rel
        if path.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dest / rel)
    return dest


@pytest.mark.slow
def test_the_declared_minimums_install_and_every_module_imports(tmp_path: Path) -> None:
    uv = shutil.which("uv") or shutil.which("uv", path=str(Path(sys.executable).parent))
    if uv is None:
        pytest.skip("uv (the [dev] extra) resolves the declared minimums")
    venv = tmp_path / "venv"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UV_", "VIRTUAL_ENV"))}
    subprocess.run([uv, "venv", "-q", "--python", sys.executable, str(venv)], check=True, env=env, timeout=120)
    python = str(venv / "bin" / "python")
    src = _clean_copy(tmp_path / "src")
    proc = subprocess.run(
        [uv, "pip", "install", "--python", python, "--resolution", "lowest-direct", f"{src}[{','.join(EXTRAS)}]"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    listed = subprocess.run([uv, "pip", "list", "--python", python, "--format", "json"], env=env,
                            check=True, capture_output=True, text=True).stdout  # fmt: skip
    installed = {canonicalize_name(d["name"]): d["version"] for d in json.loads(listed)}
    for name, minimum in _direct_minimums().items():
        assert Version(installed[name]) == Version(minimum), (
            f"{name}>={minimum} is declared, but the lowest version that installs with the rest is "
            f"{installed[name]}: raise the minimum in pyproject.toml"
        )
    code = f"OTHER = {sorted(OTHER_EXTRAS)!r}\n" + IMPORT_ALL
    proc = subprocess.run([python, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.splitlines()[-1])
    assert not result["broken"], result["broken"]
    for name in MUST_IMPORT:
        assert name in result["done"], (name, result["needs_extra"].get(name))
