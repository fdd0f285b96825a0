"""The reading hall: ``GuidanceReader`` and the row sources it reads from (storage directly, read
processes, or a sidecar). Imports the core, storage and ``tracestore.client.transport`` only."""
