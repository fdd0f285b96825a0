"""The package's floors, checked statically on the source (every ``import``, also inside functions
and under ``TYPE_CHECKING``, relative ones resolved; ``importlib.import_module("...")`` literals too).

- The core (``tracestore/`` but its top floor ``tracestore/cli/``, ``tracestore/demo/`` and
  ``tracestore/__main__.py``) imports neither ``tracestore.client`` nor ``tracestore.server``, nor
  the top floor. Only the top floor may import client and server.
- ``tracestore.client`` and ``tracestore.server`` never import each other (they meet on the wire),
  nor the top floor, but for the commands that live in ``server/`` (``SERVER_COMMANDS``), which
  declare their options with the CLI's settings layer (``tracestore.cli``).
- ``tracestore.kernels`` builds on the core only: no client, server, top floor or storage.
- ``tracestore/storage/`` is private: imported from itself, the core modules named in
  ``STORAGE_IN_CORE``, client, server, the top floor, ``bench/`` and ``tests/``.
- ``tracestore/v1/`` holds generated code only.
- ``import tracestore`` loads no torch: ``test_import.py`` runs that in a fresh interpreter.

``KNOWN`` lists the imports that break these rules today, each with its reason; it must stay
exact, so fixing one means deleting its line here.
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
SKIP_DIRS = {"__pycache__", "build", "dist", "node_modules"}
TOP = ("tracestore.cli", "tracestore.demo", "tracestore.__main__")
CLIENT, SERVER, KERNELS, STORAGE = "tracestore.client", "tracestore.server", "tracestore.kernels", "tracestore.storage"

# `tracestore serve` and `tracestore health`: commands kept beside the sidecar they run or probe.
SERVER_COMMANDS = {"tracestore.server.cli", "tracestore.server.cli_health"}
# Core modules that read or re-export storage: the package's public CHUNK_SCHEMA/chunks_to_table,
# and a rank's plan read through a StoreReader (annotations).
STORAGE_IN_CORE = {"tracestore", "tracestore.rank_plan", "tracestore.traceref"}
# (importer module, imported module) pairs that break a rule today (none at this commit; a new one
# is listed here with its reason, and the test fails once it is gone so the list stays exact).
KNOWN: set[tuple[str, str]] = set()


def package_dirs() -> dict[str, Path]:
    """Package name -> source directory, from pyproject's package-dir (client/ is tracestore.client ...)."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        setuptools = tomllib.load(f)["tool"]["setuptools"]
    dirs = {name: ROOT / d for name, d in setuptools["package-dir"].items()}
    for name in setuptools["packages"]:  # subpackages that follow their parent's directory
        if name not in dirs:
            parent, _, leaf = name.rpartition(".")
            dirs[name] = dirs[parent] / leaf
    return dirs


PACKAGES = package_dirs()


def module_name(path: Path) -> str:
    """Dotted name of a source file: by the deepest package directory holding it, else by its path."""
    best = max(
        ((name, d) for name, d in PACKAGES.items() if path.is_relative_to(d)),
        key=lambda item: len(item[1].parts),
        default=None,
    )
    if best is None:
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
    else:
        parts = [best[0], *path.relative_to(best[1]).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_files() -> Iterator[Path]:
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).parts
        if any(p.startswith(".") or p in SKIP_DIRS or "venv" in p or p.endswith(".egg-info") for p in rel[:-1]):
            continue
        yield path


def imports(tree: ast.AST, module: str, is_package: bool) -> Iterator[str]:
    """Every module a file imports (``from a import b`` yields ``a`` and ``a.b``: b may be a module)."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            yield target
            yield from (f"{target}.{a.name}" for a in node.names if a.name != "*")
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield node.args[0].value


def under(name: str, *prefixes: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in source_files():
        module = module_name(path)
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        graph.setdefault(module, set()).update(imports(tree, module, path.name == "__init__.py"))
    return graph


def violations(graph: dict[str, set[str]]) -> set[tuple[str, str, str]]:
    """(rule, importer, imported) for every import that breaks a rule of the module docstring."""
    out = set()
    for module, targets in graph.items():
        top = under(module, *TOP)
        core = under(module, "tracestore") and not top and not under(module, CLIENT, SERVER, KERNELS)
        for t in targets:
            if core and under(t, CLIENT, SERVER, *TOP):
                out.add(("core imports client, server or the top floor", module, t))
            if under(module, CLIENT) and under(t, SERVER) or under(module, SERVER) and under(t, CLIENT):
                out.add(("client and server import each other", module, t))
            command = module in SERVER_COMMANDS and under(t, "tracestore.cli")
            if under(module, CLIENT, SERVER) and under(t, *TOP) and not command:
                out.add(("client or server imports the top floor", module, t))
            if under(module, KERNELS) and under(t, CLIENT, SERVER, STORAGE, *TOP):
                out.add(("kernels import past the core", module, t))
            if under(t, STORAGE) and not (
                under(module, STORAGE, CLIENT, SERVER, *TOP, "bench", "tests") or module in STORAGE_IN_CORE
            ):
                out.add(("storage imported from outside its users", module, t))
    return out


GRAPH = import_graph()


def test_the_scan_sees_the_packages_and_their_imports():
    # the scan reads what it should: the four packages' files, function-level and relative imports
    assert {"tracestore.records", "tracestore.client.recorder", "tracestore.server.engine"} <= set(GRAPH)
    assert "tracestore.kernels._params" in GRAPH["tracestore.kernels._launch"]  # from ._params import ...
    assert "tracestore.cli.main" in GRAPH["tracestore.__main__"]
    assert "cupy" in GRAPH["tracestore.kernels._launch"]  # imported inside a function
    assert "tracestore.storage.reader" in GRAPH["tracestore.rank_plan"]  # under TYPE_CHECKING


def test_layers_hold_but_for_the_known_exceptions():
    found = violations(GRAPH)

    def known(module: str, target: str) -> set[tuple[str, str]]:  # "from m import name" is under m
        return {(m, t) for m, t in KNOWN if m == module and under(target, t)}

    new = sorted(v for v in found if not known(v[1], v[2]))
    assert not new, "imports that break the package's layering:\n" + "\n".join(f"{m} -> {t}: {r}" for r, m, t in new)
    fixed = sorted(KNOWN - set().union(*(known(m, t) for _, m, t in found)))
    assert not fixed, f"these known exceptions are gone: delete them from KNOWN: {fixed}"


@pytest.mark.parametrize(
    ("module", "target", "rule"),
    [
        ("tracestore.records", "tracestore.server.engine", "core imports"),
        ("tracestore.storage.fs", "tracestore.client", "core imports"),
        ("tracestore.plan", "tracestore.cli.settings", "core imports"),
        ("tracestore.client.recorder", "tracestore.server.ingest", "each other"),
        ("tracestore.server.engine", "tracestore.cli.settings", "imports the top floor"),
        ("tracestore.server.cli", "tracestore.demo.run", "imports the top floor"),
        ("tracestore.client.reader", "tracestore.cli", "imports the top floor"),
        ("tracestore.kernels.record", "tracestore.storage.store", "kernels import"),
        ("examples.other", "tracestore.storage.fs", "storage imported"),
        ("tracestore.guided", "tracestore.storage.reader", "storage imported"),
    ],
)
def test_a_planted_import_is_a_violation(module, target, rule):
    assert any(rule in r for r, _, _ in violations({module: {target}}))


def test_allowed_imports_are_not_violations():
    allowed = {
        "tracestore.cli.inspect": {"tracestore.server.cli", "tracestore.client", "tracestore.storage.store"},
        "tracestore.demo.run": {"tracestore.server", "tracestore.client.recorder"},
        "tracestore.client.reader": {"tracestore.storage.reader", "tracestore.records", "tracestore.kernels"},
        "tracestore.server.service": {"tracestore.storage.store", "tracestore.wire"},
        "tracestore.server.cli_health": {"tracestore.cli", "tracestore.cli.resolve"},
        "tracestore": {"tracestore.storage.arrow"},
        "bench.bench_storage": {"tracestore.storage.shard_write"},
        "tests.storage.test_x": {"tracestore.storage.fs"},
    }
    assert violations({m: set(t) for m, t in allowed.items()}) == set()


def test_relative_imports_resolve():
    tree = ast.parse("from . import a\nfrom .. import errors\nfrom ..storage.fs import Storage\n")
    assert set(imports(tree, "tracestore.cli.check", False)) == {
        "tracestore.cli",
        "tracestore.cli.a",
        "tracestore",
        "tracestore.errors",
        "tracestore.storage.fs",
        "tracestore.storage.fs.Storage",
    }
    tree = ast.parse("from .fs import x\nimportlib.import_module('tracestore.server.cli')\n")
    assert set(imports(tree, "tracestore.storage", True)) == {
        "tracestore.storage.fs",
        "tracestore.storage.fs.x",
        "tracestore.server.cli",
    }


GENERATED = re.compile(r"\w+_pb2(\.py|\.pyi|_grpc\.py)")


def test_v1_holds_generated_code_only():
    v1 = PACKAGES["tracestore.v1"]
    files = sorted(p.name for p in v1.iterdir() if p.is_file() and p.suffix in (".py", ".pyi"))
    assert "__init__.py" in files and any(f.endswith("_pb2.py") for f in files)
    hand_written = [f for f in files if f != "__init__.py" and not GENERATED.fullmatch(f)]
    assert not hand_written, f"tracestore/v1/ is generated code only (protoc output), found {hand_written}"
    for f in files:
        text = (v1 / f).read_text(encoding="utf-8")
        if f.endswith(".py") and f != "__init__.py":
            assert "DO NOT EDIT" in text[:300], f"{f} does not carry the compiler's generated-code header"
    body = ast.parse((v1 / "__init__.py").read_text(encoding="utf-8")).body
    code = [n for n in body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    assert not code, "tracestore/v1/__init__.py holds a docstring only"


def test_the_architecture_map_names_files_that_exist():
    """docs/architecture.md's table: a path names its folder, a bare file name is in the last folder."""
    missing = []
    for line in (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8").splitlines():
        if not line.startswith("| ") or line.startswith("| room"):
            continue
        folder = ROOT
        for token in re.findall(r"`([^`]+)`", line.split("|")[2]):
            if "/" in token:
                path = ROOT / token.rstrip(":")
                folder = path if token.endswith("/") or token.endswith("/:") else path.parent
            elif token.endswith(".py"):
                path = folder / token
            else:
                continue
            if not path.exists():
                missing.append(str(path.relative_to(ROOT)))
    assert not missing, f"docs/architecture.md names files that do not exist: {missing}"
