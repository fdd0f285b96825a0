"""tracestore.server — the sidecar (``tracestore serve``); see docs/operations.md and docs/protocol.md."""
