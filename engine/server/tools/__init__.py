"""OpenAI tool calling: the tools a request offers (protocol), the prompt and grammar of a
call (calls), each model family's call format (formats, call_json), and the calls read
back from the model's text as it streams (parsers)."""
