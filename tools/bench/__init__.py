"""Benchmarks: offline throughput, an online load generator, and single-stream latency."""
