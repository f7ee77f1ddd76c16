"""One-off experiments behind docs/benchmarks.md's results; not part of the preheat package (see README.md here)."""
