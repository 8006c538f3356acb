"""HTTP server, tokenizer manager and detokenizer processes."""
