"""Every setting of the engine and of ``kvledger serve``, each declared once (``declare``),
with the kinds of value they take (``kinds``), and how vLLM's launch lines map onto them."""
