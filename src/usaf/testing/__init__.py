"""Tiny models built from configs, for tests, benchmarks and the demo."""
