"""Keep the repository's source folders from shadowing other distributions' top-level packages.

``client/`` and ``server/`` at the repository root are the sources of ``tracestore.client`` and
``tracestore.server`` (pyproject's ``package-dir``). Whenever the repository root is on ``sys.path``
(``python -m ...`` from a checkout, a Ray job whose working_dir is the checkout) Python would also
find them as top-level ``client`` and ``server``. Each folder's ``__init__`` calls
:func:`step_aside` when it is imported under any name but its ``tracestore.`` one: the import then
yields the package of that name found elsewhere on the path, exactly as if the folder were not
there, or fails with ``ModuleNotFoundError`` when there is none.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType


def _inside(spec: importlib.machinery.ModuleSpec, folder: str) -> bool:
    for place in [spec.origin, *(spec.submodule_search_locations or [])]:
        real = os.path.realpath(place) if place else ""
        if real == folder or real.startswith(folder + os.sep):
            return True
    return False


def _find_elsewhere(name: str, folder: str) -> importlib.machinery.ModuleSpec | None:
    root = os.path.dirname(folder)
    path = [p for p in sys.path if os.path.realpath(p or os.curdir) != root]
    for finder in sys.meta_path:
        if finder is importlib.machinery.PathFinder:
            spec = importlib.machinery.PathFinder.find_spec(name, path)
        else:
            find = getattr(finder, "find_spec", None)
            spec = find(name, None) if find is not None else None
        if spec is not None and not _inside(spec, folder):
            return spec
    return None


def step_aside(name: str, init_file: str) -> None:
    """Make the running import of ``name`` (the folder of ``init_file``) yield another package.

    Replaces ``sys.modules[name]`` with the package of that name found on ``sys.path`` outside the
    repository root, executed in place; raises ``ModuleNotFoundError`` when no other exists.
    """
    folder = os.path.dirname(os.path.realpath(init_file))
    spec = _find_elsewhere(name, folder)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(
            f"No module named {name!r} (the repository's {os.path.basename(folder)}/ folder is the source "
            f"of tracestore.{os.path.basename(folder)} and is imported under that name only)",
            name=name,
        )
    module: ModuleType = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # the import system returns what sys.modules holds after this __init__
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise


class _HidingFinder:
    """The path-entry finder of the repository root, without the source folders' top-level names."""

    def __init__(self, inner: object, names: frozenset[str]) -> None:
        self._inner = inner
        self._names = names

    def find_spec(self, fullname: str, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if fullname in self._names:
            return None
        find = getattr(self._inner, "find_spec", None)
        return find(fullname, target) if find is not None else None

    def invalidate_caches(self) -> None:
        inv = getattr(self._inner, "invalidate_caches", None)
        if inv is not None:
            inv()


_HIDDEN: set[str] = set()


def hide_source_folders(root: str, names: frozenset[str] = frozenset({"client", "server"})) -> None:
    """Make the path finder skip ``root``'s ``client/`` and ``server/`` as top-level packages, so
    that ``importlib.util.find_spec`` of those names sees only a real installation, not the
    checkout's folders.

    Installs a path hook for ``root`` (a checkout: the parent of the ``tracestore`` package with
    those folders in it) and drops the finders already cached for it. Idempotent; a no-op where
    ``root`` has none of the folders (an installed wheel keeps them inside ``tracestore/``)."""
    root = os.path.realpath(root)
    if root in _HIDDEN or not any(os.path.isfile(os.path.join(root, n, "__init__.py")) for n in names):
        return
    _HIDDEN.add(root)

    def hook(entry: str) -> _HidingFinder:
        if os.path.realpath(entry or os.curdir) != root:
            raise ImportError("not the repository root")
        for other in sys.path_hooks:
            if other is hook:
                continue
            try:
                return _HidingFinder(other(entry), names)
            except ImportError:
                continue
        raise ImportError(f"no path hook handles {entry!r}")

    sys.path_hooks.insert(0, hook)
    for entry in list(sys.path_importer_cache):
        if os.path.realpath(entry or os.curdir) == root:
            del sys.path_importer_cache[entry]
