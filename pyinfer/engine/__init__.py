"""The engine that runs a model: `driver` (pyinfer.Model: load, KV cache, prompt batches, one native graph call
per token), `placement` (the solver: which layers' attention and how many hot neurons go to the GPU under a
budget), `machine` (this machine's speeds, which the solver plans with), `offload` (puts a plan's parts on the
GPU), `threads` (the CPU thread count), `sampling`, and `completions` (OpenAI-shaped results)."""
