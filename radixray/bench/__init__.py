"""Benchmarks: offline engine throughput, the serving client (bench serve, cache-experiment), the naive baseline server."""
