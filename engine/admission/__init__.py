"""Admission: who runs, and when. The context cap (``cap``), the FIFO line that admits each
request once the KV ledger reserves ``prompt + cap`` for it (``line``), and when the blocks
of running requests come back (``due_back``), for backfilling and Retry-After. Refusals are
domain errors (``kvledger.engine.errors``); the server maps them to HTTP."""
