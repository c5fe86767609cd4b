"""Benchmarks: the engine-vs-vLLM comparison harness (`specpipe compare`) and its statistics."""
