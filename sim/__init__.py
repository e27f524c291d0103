"""kvsim: a discrete-event simulator of vLLM's KV-cache block allocation."""
