"""Reading an installed engine's source: the calls and imports a function makes (contract tests)."""

from __future__ import annotations

import ast
import importlib
import inspect
from collections.abc import Iterator


def source_tree(module: str) -> ast.Module:
    return ast.parse(inspect.getsource(importlib.import_module(module)))


def functions(tree: ast.AST, name: str) -> list[ast.FunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name]


def dotted(node: ast.AST) -> str:
    """``a.b.c`` for an attribute chain / name, else ''."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def calls(tree: ast.AST, callee: str) -> Iterator[ast.Call]:
    """Calls whose callee is spelled ``callee`` (a dotted name or a bare name)."""
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and dotted(n.func) == callee:
            yield n


def keywords(call: ast.Call) -> set[str]:
    return {k.arg for k in call.keywords if k.arg is not None}


def from_imports(tree: ast.AST) -> set[tuple[str, str]]:
    """``(module, name)`` of every ``from module import name`` in ``tree`` (functions included)."""
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.module:
            out |= {(n.module, a.name) for a in n.names}
    return out
