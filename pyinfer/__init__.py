"""PyInfer: a PowerInfer-style LLM runtime on a native ggml-style engine.

    import pyinfer
    model = pyinfer.Model("model.gguf")
    print(model.generate("Once upon a time", n_predict=32))
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    # the native module loads on first use, so `pyinfer --help` works even before a build
    if name == "Model":
        from pyinfer.engine.driver import Model

        return Model
    raise AttributeError(f"module 'pyinfer' has no attribute {name!r}")
