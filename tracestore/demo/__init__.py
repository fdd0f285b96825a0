"""``tracestore demo``: TRACE end to end on a randomly initialised Hugging Face MoE model.

Rollout (KV-cache generation with NVFP4 fake-quant at every MoE-block input and FP4 K/V entering
the cache) → records → teacher-forced training forward in five modes → per-layer fidelity report.
Needs the ``demo`` extra (transformers, matplotlib, tqdm) and torch; nothing here is imported by
``import tracestore``.
"""
