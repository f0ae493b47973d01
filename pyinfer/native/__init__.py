"""The Python face of the native engine (`ggml/` computes, `native/` schedules): `binding` loads the compiled
cffi module and turns C statuses into exceptions; `ggml` gives contexts, tensors, ops, graphs and thread pools."""
