"""Environment variables are read in one place: ``tracestore.settings``.

A subcommand's settings come from flag > ``TRACESTORE_<FLAG>`` > config file > default
(``resolve``); every other variable the library reads is declared with ``env_var`` and read with
``read_env``. The scan below fails on any other read of ``os.environ`` / ``os.getenv`` in the
product's source (copying the environment for a child process, and setting a variable, stay
allowed).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

from tests.core.test_layers import PACKAGES, ROOT, module_name, source_files
from tracestore.errors import ConfigError
from tracestore.settings import (
    ENVIRONMENT,
    FAULT,
    GUIDED_TABLE,
    RECORDER_COPY,
    SERVE_PORT,
    TOKEN,
    EnvVar,
    integer,
    read_env,
)

SETTINGS_MODULE = "tracestore.settings"
# reads that only copy the environment (for a child process) or write it
ALLOWED_ATTRS = {"items", "copy", "keys", "values"}


def _is_environ(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "environ"
        and isinstance(node.value, ast.Name)
        and node.value.id == "os"
    )


def _reads(node: ast.AST) -> bool:
    """Whether ``node`` reads the environment by key."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        f = node.func
        getenv = f.attr == "getenv" and isinstance(f.value, ast.Name) and f.value.id == "os"
        return getenv or (_is_environ(f.value) and f.attr not in ALLOWED_ATTRS)
    if isinstance(node, ast.Subscript):
        return _is_environ(node.value) and isinstance(node.ctx, ast.Load)
    if isinstance(node, ast.Compare):
        return any(_is_environ(c) for c in node.comparators)
    return False


def env_reads(tree: ast.AST) -> list[int]:
    """Line numbers of keyed reads of the environment in ``tree``."""
    return [node.lineno for node in ast.walk(tree) if _reads(node)]  # type: ignore[attr-defined]


def product_files():
    roots = [d for name, d in PACKAGES.items() if "." not in name or name.count(".") == 1]
    for path in source_files():
        if any(path.is_relative_to(r) for r in roots) and not path.is_relative_to(ROOT / "tests"):
            name = module_name(path)
            if name.startswith("tracestore") and not name.startswith("tracestore.v1"):
                yield path, name


def test_only_the_settings_layer_reads_the_environment():
    found = []
    seen = 0
    for path, name in product_files():
        seen += 1
        if name == SETTINGS_MODULE:
            continue
        for line in env_reads(ast.parse(path.read_text(), str(path))):
            found.append(f"{path.relative_to(ROOT)}:{line}")
    assert seen > 100  # the scan saw the package
    assert not found, "environment read outside tracestore.settings (declare it with env_var): " + ", ".join(found)


@pytest.mark.parametrize(
    "src, n",
    [
        ("import os\nx = os.environ.get('A')", 1),
        ("import os\nx = os.getenv('A')", 1),
        ("import os\nx = os.environ['A']", 1),
        ("import os\nx = 'A' in os.environ", 1),
        ("import os\nos.environ.setdefault('A', '1')", 1),
        ("import os\nos.environ['A'] = '1'", 0),
        ("import os\nenv = {k: v for k, v in os.environ.items()}", 0),
    ],
)
def test_the_scan_finds_reads(src, n):
    assert len(env_reads(ast.parse(src))) == n


def test_read_env_defaults_converts_and_names_the_variable():
    assert read_env(SERVE_PORT, {}) == 7433
    assert read_env(SERVE_PORT, {"TRACESTORE_PORT": " 9000 "}) == 9000
    assert read_env(SERVE_PORT, {"TRACESTORE_PORT": "  "}) == 7433  # blank: unset
    with pytest.raises(ConfigError, match=r"TRACESTORE_PORT='http': expected an integer in 1\.\.65535"):
        read_env(SERVE_PORT, {"TRACESTORE_PORT": "http"})
    assert read_env(GUIDED_TABLE, {"TRACESTORE_GUIDED_TABLE": "1"}) is True
    assert read_env(GUIDED_TABLE, {"TRACESTORE_GUIDED_TABLE": "0"}) is False
    with pytest.raises(ConfigError, match="TRACESTORE_GUIDED_TABLE='maybe': expected true or false"):
        read_env(GUIDED_TABLE, {"TRACESTORE_GUIDED_TABLE": "maybe"})
    assert read_env(RECORDER_COPY, {"TRACESTORE_RECORDER_COPY": "Torch"}) == "torch"
    with pytest.raises(ConfigError, match="TRACESTORE_RECORDER_COPY='cupy': expected one of auto, driver, torch"):
        read_env(RECORDER_COPY, {"TRACESTORE_RECORDER_COPY": "cupy"})
    assert read_env(FAULT, {"TRACESTORE_FAULT": "wal.synced:2"}) == "wal.synced:2"


def test_a_secret_is_never_shown():
    assert read_env(TOKEN, {"TRACESTORE_TOKEN": " abc "}) == "abc"
    with pytest.raises(ConfigError) as err:
        read_env(TOKEN, {"TRACESTORE_TOKEN": "two words"})
    assert "two words" not in str(err.value) and "<redacted>" in str(err.value)


def test_only_declared_variables_are_read():
    with pytest.raises(KeyError, match="not a declared library variable"):
        read_env(EnvVar("TRACESTORE_UNDECLARED", integer(), 0, "x"), {})
    assert all(name == var.name for name, var in ENVIRONMENT.items())


def test_every_declared_variable_is_documented():
    ops = (ROOT / "docs" / "operations.md").read_text()
    missing = [name for name in ENVIRONMENT if name.startswith("TRACESTORE_") and f"`{name}`" not in ops]
    assert not missing, f"docs/operations.md does not list {missing}"


def test_a_bad_variable_fails_where_it_is_read():
    """A kernel-module variable that does not convert fails the import with the variable's name,
    instead of being taken as 'off'."""
    env = {**os.environ, "TRACESTORE_FAULT": "", "TRACESTORE_GUIDED_TABLE": "yes please"}
    code = "import tracestore.faults, tracestore.settings as s; s.read_env(s.GUIDED_TABLE)"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "TRACESTORE_GUIDED_TABLE='yes please'" in r.stderr
