"""Offline steps (profiling, neuron reorder, predictor training, sparsify) and benchmarks."""
