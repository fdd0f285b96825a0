"""Lets PyPI's torchvision wheel import beside torch's CPU build (engine venv only, .ci/engines-venv).

PyPI's torchvision 0.28.0 is a CUDA build: its ``_C`` extension cannot load against torch 2.13.0+cpu,
after which ``torchvision._meta_registrations`` fails on its two unguarded ``register_fake`` calls
(``torchvision::nms``, ``torchvision::qnms``: "operator ... does not exist"). vLLM and SGLang import
torchvision at module level (SGLang through its multimodal configs), so neither imports. This finder
defines those two schemas, without kernels, right before torchvision is first imported, only when
the extension did not define them; every torchvision op then raises if called (neither engine's
text path calls one). Installed as a ``.pth`` line in the engine venv's site-packages.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys


class _Finder(importlib.abc.MetaPathFinder):
    done = False

    def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
        if name != "torchvision" or _Finder.done:
            return None
        _Finder.done = True
        import glob
        import os

        import torch

        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or not spec.submodule_search_locations:
            return None
        libs = glob.glob(os.path.join(list(spec.submodule_search_locations)[0], "_C*.so"))
        try:
            for lib in libs:
                torch.ops.load_library(lib)
            if libs:
                return None  # the extension loads: it defines the ops itself
        except OSError:
            pass
        for op in ("nms", "qnms"):
            torch.library.define(f"torchvision::{op}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        return None


sys.meta_path.insert(0, _Finder())
