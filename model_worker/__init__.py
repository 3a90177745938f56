"""The model worker: a torch runner for Llama-family models with a paged L1 KV pool and continuous batching."""
