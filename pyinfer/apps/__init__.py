"""The user's doors: the `pyinfer` command (`cli`, its shared flags in `flags`), the chat REPL (`chat`, `repl`),
`bench`, `perplexity`, and the OpenAI-compatible server (`server/`)."""
