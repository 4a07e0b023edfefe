"""The KV cache's books: the reservation ledger and the block pool (prefix cache)."""
