"""PyInfer: a PowerInfer-style LLM runtime on a native ggml-style engine."""
__version__ = "0.1.0"
