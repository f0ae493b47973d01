"""Files and texts from elsewhere: GGUF reading (`gguf_reader`, `gguf_schema`, `gguf_file`) and writing
(`gguf_writer`), the model's hyperparameters (`model_config`), its tokenizer and its chat template. Nothing
here computes on tensors."""
