"""Benchmarks: offline engine throughput with roofline ratios (serving client comes later)."""
