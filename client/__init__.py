"""tracestore.client — see design.md."""
