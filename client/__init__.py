"""tracestore.client — the rollout recorder and the trainer's guidance reader (docs/integration.md).

``import tracestore.client`` loads neither torch nor grpc: the recorder and reader import them
lazily where a GPU tensor or a sidecar connection needs them.

    from tracestore.client import RolloutRecorder, SiteOutput, GuidanceReader
    from tracestore.client import TraceRef, attempt_id   # handles an RL framework carries
    from tracestore.client import GuidedFP4Hooks         # guided FP4 fake-quant of a model in training
    from tracestore.client import FP4SiteRecorder, HFSiteHooks   # transformers models
    from tracestore.client import RoutingCapture, RoutingReplayHooks   # MoE routing capture, replay (R3)

Three halls: ``record/`` (the engine side), ``read/`` (the trainer's reads) and ``hf/``
(transformers hooks), which never import each other; they share ``transport.py`` and the core.
"""

from __future__ import annotations

if __name__ != "tracestore.client":  # imported as a top-level `client` from a checkout
    import pathlib
    import runpy

    # by path: importing the tracestore package would need its dependencies in this interpreter
    _shadow = runpy.run_path(str(pathlib.Path(__file__).parents[1] / "tracestore" / "_shadow.py"))
    _shadow["step_aside"](__name__, __file__)
else:
    import importlib
    from typing import Any

    _LAZY = {
        "RolloutRecorder": "tracestore.client.record.recorder",
        "RecorderConfig": "tracestore.client.record.config",
        "SiteOutput": "tracestore.site_output",
        "SlabStage": "tracestore.client.record.slab",
        "Segments": "tracestore.client.record.slab",
        "StagingPool": "tracestore.client.record.staging",
        "GuidanceReader": "tracestore.client.read.reader",
        "ReaderConfig": "tracestore.client.read.config",
        "GuidedFP4Hooks": "tracestore.client.hf.train_hooks",
        "HFSiteHooks": "tracestore.client.hf.hooks",
        "FP4SiteRecorder": "tracestore.client.hf.recorder",
        "RoutingCapture": "tracestore.client.hf.routing",
        "RoutingReplayHooks": "tracestore.client.hf.routing",
        "TraceRef": "tracestore.traceref",
        "attempt_id": "tracestore.traceref",
    }

    __all__ = list(_LAZY)

    def __getattr__(name: str) -> Any:
        module = _LAZY.get(name)
        if module is None:
            raise AttributeError(f"module 'tracestore.client' has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value
