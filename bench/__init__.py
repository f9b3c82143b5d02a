"""Benchmarks and end-to-end checks for the trt-batcher inference server."""
