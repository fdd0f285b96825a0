#!/usr/bin/env python3
"""The latest-releases check: the test suite against the newest releases pyproject.toml allows,
and which upstream release broke which tests (docs/dependencies.md).

    python .ci/latest.py                       # whole suite; ~12 min on 2 cores, plus attribution
    python .ci/latest.py -- tests/client       # a part of it
    python .ci/latest.py --lock /tmp/old.txt   # compare with another lock

1. A fresh venv gets torch (TORCH, as CI) and `.[dev,demo]` without the lock: the newest releases.
2. The suite runs there (pytest, as .ci/run); failing and erroring tests are collected.
3. Every distribution whose version differs from the lock is put back to its locked version alone
   (`pip install --no-deps`; a distribution the lock lacks is uninstalled), the failures run
   again, and the tests that pass then are attributed to that release. The venv is restored.
4. A table: package, locked, newest, the failing tests its release breaks. Exit 0 when nothing
   fails, 1 when something does. Not part of .ci/run: its answer changes with every release.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TORCH = "torch==2.13.0"
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)\s*(?:;\s*(.*))?$")
NOT_DEPENDENCIES = {"pip", "setuptools", "wheel", "tracestore"}


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def locked_pins(lock: Path, python: str) -> dict[str, str]:
    """{name: version} of the lock's pins that apply to this Python version."""
    pins = {}
    for line in lock.read_text().splitlines():
        m = PIN.match(line.strip())
        if not m:
            continue
        marker = m.group(3)
        if marker:
            want = re.fullmatch(r'python_version\s*==\s*"([\d.]+)"', marker.strip())
            if want is None or want.group(1) != python:
                continue
        pins[normalize(m.group(1))] = m.group(2)
    return pins


def run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=ROOT, text=True, **kw)  # type: ignore[call-overload,no-any-return]


class Venv:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.python = str(path / "bin" / "python")

    def create(self) -> None:
        run([sys.executable, "-m", "venv", "--clear", str(self.path)], check=True)
        self.pip("install", "-q", "--upgrade", "pip")
        self.pip("install", "-q", TORCH)
        self.pip("install", "-q", "-e", ".[dev,demo]")

    def pip(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
        return run([self.python, "-m", "pip", *args], check=check, env=env, capture_output=not check)

    def installed(self) -> dict[str, str]:
        out = run([self.python, "-m", "pip", "list", "--format", "json"], check=True, capture_output=True).stdout
        return {normalize(d["name"]): d["version"] for d in json.loads(out)}

    def failing(self, args: list[str], junit: Path, quiet: bool = False) -> list[str]:
        """Node ids of the tests that failed or errored (``quiet``: pytest's output goes to a file
        beside ``junit`` instead of the terminal)."""
        env = {**os.environ, "PATH": f"{self.path / 'bin'}{os.pathsep}{os.environ['PATH']}"}
        cmd = [self.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "junit_family=xunit1",
               f"--junitxml={junit}", *args]  # fmt: skip
        if quiet:
            with open(junit.with_suffix(".log"), "w") as log:
                run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        else:
            run(cmd, env=env)
        bad = []
        for case in ET.parse(junit).getroot().iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                bad.append(node_id(case.attrib))
        return bad


def node_id(case: dict[str, str]) -> str:
    """pytest's node id of a junit (xunit1) testcase; a module that failed to collect: its path."""
    file, classname, name = case.get("file"), case.get("classname", ""), case.get("name", "")
    if not file:
        return name.replace(".", "/") + ".py"
    module = file[:-3].replace("/", ".")
    inner = classname[len(module) + 1 :].replace(".", "::") if classname.startswith(module + ".") else ""
    return "::".join(p for p in (file, inner, name) if p)


def differing(locked: dict[str, str], newest: dict[str, str]) -> dict[str, tuple[str | None, str | None]]:
    names = (set(locked) | set(newest)) - NOT_DEPENDENCIES - {"torch"}
    out: dict[str, tuple[str | None, str | None]] = {}
    for name in sorted(names):
        a, b = locked.get(name), newest.get(name)
        if b is None:
            continue  # pinned for another platform or extra, not installed here
        if a is None or a.split("+")[0] != b.split("+")[0]:
            out[name] = (a, b)
    return out


def attribute(venv: Venv, changed: dict[str, tuple[str | None, str | None]], failures: list[str],
              scratch: Path) -> dict[str, list[str]]:  # fmt: skip
    """{package: failing tests that pass with that package alone at its locked version}."""
    blame: dict[str, list[str]] = {}
    for name, (locked, newest) in changed.items():
        if locked is None:
            back = venv.pip("uninstall", "-y", "-q", name, check=False)
        else:
            back = venv.pip("install", "-q", "--no-deps", f"{name}=={locked}", check=False)
        if back.returncode == 0:
            still = set(venv.failing(failures, scratch / f"{name}.xml", quiet=True))
            fixed = [t for t in failures if t not in still]
            if fixed:
                blame[name] = fixed
        venv.pip("install", "-q", "--no-deps", f"{name}=={newest}")
        print(f"   {name}: {locked or '(not locked)'} -> {newest}: {len(blame.get(name, []))} failures pass at locked")
    return blame


def table(changed: dict[str, tuple[str | None, str | None]], blame: dict[str, list[str]]) -> str:
    rows = [("package", "locked", "newest", "failing tests it breaks")]
    for name, (locked, newest) in changed.items():
        tests = blame.get(name, [])
        shown = ", ".join(sorted({t.split("::")[0] for t in tests})) if tests else "none"
        rows.append((name, locked or "(new)", newest or "", f"{len(tests)}: {shown}" if tests else shown))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lock", type=Path, default=ROOT / "constraints.txt")
    ap.add_argument("--venv", type=Path, default=ROOT / ".ci" / "latest-venv")
    ap.add_argument("--reuse", action="store_true", help="use the venv as it is (a previous run's)")
    ap.add_argument("--json", type=Path, help="also write the result here")
    ap.add_argument("pytest_args", nargs="*", help="after --: what pytest runs (default: the whole suite)")
    args = ap.parse_args(argv)
    venv = Venv(args.venv)
    if not args.reuse:
        print(f"== fresh venv {args.venv}: {TORCH}, .[dev,demo] at the newest releases")
        venv.create()
    python = run([venv.python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                 check=True, capture_output=True).stdout.strip()  # fmt: skip
    changed = differing(locked_pins(args.lock, python), venv.installed())
    print(f"== {len(changed)} distributions newer than (or missing from) {os.path.relpath(args.lock, ROOT)}")
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        print("== the suite at the newest releases")
        failures = venv.failing(args.pytest_args, scratch / "all.xml")
        print(f"== {len(failures)} tests fail at the newest releases")
        blame = attribute(venv, changed, failures, scratch) if failures else {}
    print()
    print(table(changed, blame))
    unexplained = sorted(set(failures) - {t for tests in blame.values() for t in tests})
    if unexplained:
        print(f"\n{len(unexplained)} failures no single release explains:")
        print("\n".join("  " + t for t in unexplained[:50]))
    if args.json:
        result = {"python": python, "lock": str(args.lock), "changed": changed, "failures": failures, "blame": blame}
        args.json.write_text(json.dumps(result, indent=1))
    print("\nresult:", "green at the newest releases: refresh the lock (docs/dependencies.md)"
          if not failures else f"{len(failures)} tests fail at the newest releases")  # fmt: skip
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
