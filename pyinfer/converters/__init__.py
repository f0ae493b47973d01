"""Converters: HF checkpoints and llama.cpp GGUFs -> PowerGGUF."""
