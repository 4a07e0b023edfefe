"""vLLM 0.32's ``--reasoning-parser`` names (``vllm/reasoning/__init__.py``'s registry):
those kvledger splits answers by (``REASONING_PARSERS``; ``server/reasoning_rules.py``
holds their rules and checks the two agree), and why each other one is refused, for the
one line ``--reasoning-parser NAME`` ends in.

A name is served where vLLM's parser is a think-tag rule the splitter can follow exactly:
single-token start and end markers (or an end marker alone), an answer that starts in
reasoning or not, chat-template switches, markers that end the reasoning implicitly. The
others read the answer's text in ways token ids cannot follow, or are not splits at all.
"""

from __future__ import annotations

REASONING_PARSERS = ("deepseek_r1", "deepseek_v3", "glm45", "glm47", "holo2", "kimi_k2",
                     "ling3", "mimo", "minimax_m2", "mistral", "poolside_v1", "qwen3",
                     "seed_oss", "step3", "step3p5")

_SEVERAL_TOKENS = "its markers are runs of several tokens ({}), which the splitter cannot see"
_SWAPS = ("it swaps the reasoning and the content when the content comes out empty, which a "
          "stream that has sent the reasoning cannot take back")
_SUFFIXED = ("its markers are spelled with the checkpoint's token_suffix "
             "(tokenizer_config.json), which kvledger does not read")

# vLLM's other names -> why kvledger refuses each
REFUSED_REASONING_PARSERS = {
    "cohere_command3": "Cohere's melody filter reads the answer's text (plan, citations, "
                       "tools), not a think-tag rule",
    "cohere_command4": "Cohere's melody filter reads the answer's text (plan, citations, "
                       "tools), not a think-tag rule",
    "deepseek_v4": "a DSML tool block, several tokens in several spellings, ends its "
                   "reasoning",
    "deepseek_v41": "a DSML tool block, several tokens in several spellings, ends its "
                    "reasoning",
    "ernie45": "it cuts the content out of <response>...</response> and strips newlines "
               "by text",
    "gemma4": "its reasoning is a channel whose 'thought' prefix is cut from the text",
    "granite": "it finds the reasoning by phrases in the text ('Here is my thought "
               "process:')",
    "granite_thinking_parser": _SWAPS,
    "hf": "it reads the chat template's response schema, not a think-tag rule",
    "hunyuan_a13b": _SEVERAL_TOKENS.format("<think>\\n ... \\n</think>\\n<answer>\\n"),
    "hy_v3": _SUFFIXED,
    "hy_v4": _SUFFIXED,
    "inkling": "its reasoning is a typed message block closed by a marker that also closes "
               "text and tool blocks",
    "k2_horizon": "it picks its markers by reasoning_effort, and a whole answer without an "
                  "end is content where a stream sends it as reasoning",
    "kimi_k3": _SEVERAL_TOKENS.format("<|open|>think<|sep|>"),
    "minicpmv": "it rewrites the decoded text (MiniCPM-V's escaped newlines)",
    "minimax_m2_append_think": "it does not split: the whole answer is content with <think> "
                               "put back in front",
    "minimax_m3": "it matches <mm:think> and </mm:think> as text, which the model may write "
                  "in pieces",
    "muse_glimmer": "it reads to=self channels from the text with regular expressions",
    "nemotron_v3": _SWAPS,
    "olmo3": _SEVERAL_TOKENS.format("<think> and </think> in ordinary tokens"),
    "openai_gptoss": "gpt-oss's reasoning is Harmony's analysis channel, not a think-tag "
                     "rule",
    "plamo3": _SEVERAL_TOKENS.format("<|plamo:begin_think:plamo|>"),
}

VLLM_REASONING_PARSERS = frozenset(REASONING_PARSERS) | frozenset(REFUSED_REASONING_PARSERS)
