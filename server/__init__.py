"""tracestore.server — see design.md."""
