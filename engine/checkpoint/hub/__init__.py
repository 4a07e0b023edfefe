"""Hugging Face Hub models (``hf://``): listings, Range reads, the header mirror, the cache."""
