"""tracestore.client.engines — recording inside serving engines (docs/integration.md, "vLLM", "SGLang").

Engine-independent parts shared by the plugins:

- :mod:`.setting`: the one setting that enables recording (``TRACESTORE_RECORD``) and the version
  gate every plugin passes before it touches an engine;
- :mod:`.codes`: an engine's packed NVFP4 codes and block scales (linear, swizzled 128×4 or 8×4) to
  the store's record rows, bit for bit;
- :mod:`.routing`: a MoE layer's routed expert ids to ``routed_experts`` record rows (eager, and
  static rows for graph-safe capture);
- :mod:`.rows`: per-step scheduler facts (request, computed tokens, scheduled tokens, draft tokens)
  to record segments, prefix links, seals and gaps.

The plugins themselves are :mod:`tracestore.client.engines.vllm` and
:mod:`tracestore.client.engines.sglang`. Nothing here imports an engine, torch is imported only by
:mod:`.codes`.
"""
