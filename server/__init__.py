"""tracestore.server: the sidecar (``tracestore serve``); docs/operations.md, docs/protocol.md."""

if __name__ != "tracestore.server":  # imported as a top-level `server` from a checkout
    import pathlib
    import runpy

    # by path: importing the tracestore package would need its dependencies in this interpreter
    _shadow = runpy.run_path(str(pathlib.Path(__file__).parents[1] / "tracestore" / "_shadow.py"))
    _shadow["step_aside"](__name__, __file__)
