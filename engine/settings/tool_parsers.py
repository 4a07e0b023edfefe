"""vLLM 0.32's ``--tool-call-parser`` names (``vllm/tool_parsers/__init__.py``'s
registry): those kvledger reads calls in (``TOOL_PARSERS``; ``server/tools/formats.py``
holds their readers and checks the two agree), and why each other one is refused, for the
one line ``--tool-call-parser NAME`` ends in.

A name is served once kvledger reads its format exactly as vLLM's parser reads a whole
answer (checked against vLLM's own parser on generated texts), streams it so the pieces
add up to that whole answer, and writes ``tool_choice: "required"`` or a named function
in it. The others are refused until a reader of their format is written.
"""

from __future__ import annotations

TOOL_PARSERS = ("deepseek_v3", "deepseek_v31", "glm45", "glm47", "granite", "granite-20b-fc",
                "granite4", "hermes", "hunyuan_a13b", "internlm", "jamba", "k2_horizon",
                "kimi_k2", "lfm2", "llama3_json", "llama4_json", "llama4_pythonic", "longcat",
                "minimax_m2", "mistral", "olmo3", "phi4_mini_json", "poolside_v1", "pythonic",
                "qwen3_coder", "qwen3_json", "qwen3_xml", "seed_oss", "step3", "xlam")


def _unread(fmt: str) -> str:
    return f"kvledger has no reader yet for {fmt}"


_DSML = _unread("DeepSeek's DSML calls (<｜DSML｜invoke name=...> and its parameters)")
_COHERE = _unread("Cohere Command's action blocks")
_SUFFIXED = ("its markers are spelled with the checkpoint's token_suffix "
             "(tokenizer_config.json), which kvledger does not read")

# vLLM's other names -> why kvledger refuses each
REFUSED_TOOL_PARSERS = {
    "apertus": _unread("Apertus' <|tools_prefix|> JSON lists"),
    "cohere_command3": _COHERE,
    "cohere_command4": _COHERE,
    "deepseek_v32": _DSML,
    "deepseek_v4": _DSML,
    "deepseek_v41": _DSML,
    "dots": _unread("dots.llm's <dots_function_call> calls"),
    "ernie45": _unread("ERNIE 4.5's calls, read beside its <response> blocks"),
    "functiongemma": _unread("FunctionGemma's <start_function_call>call:NAME{...} calls"),
    "gemma4": _unread("Gemma 4's tool-call channel"),
    "gigachat3": _unread("GigaChat 3's 'function call' JSON"),
    "hf": "it reads the chat template's response schema, not a fixed call format",
    "hy_v3": _SUFFIXED,
    "hy_v4": _SUFFIXED,
    "inkling": _unread("Inkling's typed tool blocks"),
    "kimi_k3": _unread("Kimi K3's <|open|>...<|close|> blocks"),
    "ling3": _unread("Ling 3's tool calls"),
    "mimo": _unread("MiMo's tool calls"),
    "minicpm5": _unread("MiniCPM 5's XML calls"),
    "minimax_m3": _unread("MiniMax-M3's tool calls"),
    "muse_glimmer": _unread("Muse Glimmer's <atem:function_calls> blocks"),
    "openai": "gpt-oss's calls are Harmony channel messages, which kvledger does not parse",
    "plamo3": _unread("PLaMo 3's <|plamo:begin_tool_requests:plamo|> calls"),
    "step3p5": _unread("Step 3.5's tool calls"),
}

VLLM_TOOL_PARSERS = frozenset(TOOL_PARSERS) | frozenset(REFUSED_TOOL_PARSERS)
