"""tracestore.kernels — see design.md."""
