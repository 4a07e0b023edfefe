"""The engine loop: requests admitted against the ledger, scheduled, run, sampled, finished."""
