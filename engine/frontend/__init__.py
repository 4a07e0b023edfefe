"""The front door into the engine (``door.FrontDoor``): the one way a request gets in,
from the HTTP server and from ``LLM``. It owns the engine's request rules in one order,
the one admission line, the hand-off of each reservation to the engine and its give-back,
and the line's wake-up after every engine step. Refusals are the engine's errors
(``kvledger.engine.errors``); the server maps them to HTTP."""
