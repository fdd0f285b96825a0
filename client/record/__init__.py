"""The recording hall: what a rollout engine uses to record (``RolloutRecorder``, ``record_slab``,
``slab_stage`` inside a CUDA graph), the staging pool, the Write session to the sidecar and the
TraceRefs of recorded trajectories. Imports the core and ``tracestore.client.transport`` only."""
