"""Choosing the next token: sampling parameters, the sampler, grammars."""
