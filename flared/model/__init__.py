"""Model runtime: decoder families in torch over a paged KV cache, weight loading (HF, GGUF),
batched sampling, and an offline runner. docs/model.md describes the pieces and the serving layout."""

