"""The OpenAI-compatible HTTP server (``pagedllm serve``)."""
