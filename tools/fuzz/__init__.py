"""The fuzzer of model loading and the converter (docs/FUZZING.md): `campaign` runs the cases
(`python -m tools.fuzz`), `seeds` makes the valid inputs, `image`, `gguf_mutations` and `hf_mutations` break
them, `targets` runs one case in its child process."""
