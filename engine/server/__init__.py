"""HTTP layer: OpenAI-compatible aiohttp server with reservation admission."""
