"""trt-batcher: a dynamic-batching inference server speaking the KServe v2 (Triton-compatible) HTTP protocol."""

__version__ = "0.1.0"
