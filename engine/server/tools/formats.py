"""Each ``--tool-call-parser`` name: the reader of its calls (``READERS``: the JSON family
in ``json_formats``, qwen3_coder's XML in ``xml_format``, the Python lists in
``pythonic_format``, DeepSeek's in ``deepseek_format``, Kimi's in ``kimi_format``, GLM's
in ``glm_format``, MiniMax-M2's in ``minimax_format``, Step-3's in ``step3_format``,
xLAM's in ``xlam_format``, Jamba's in ``jamba_format``, Hunyuan-A13B's in
``hunyuan_format``, InternLM's in ``internlm_format``, LongCat's in ``longcat_format``,
Poolside's in ``poolside_format``, K2 Horizon's in ``k2_horizon_format``, LFM2's in
``lfm2_format``, Granite's in ``granite_format`` and ``granite3_format``, Phi-4-mini's in
``phi4_format``), the ids its calls get (Kimi's reader gives its own), and the markers its
tokenizers may hold as special tokens.

vLLM 0.32's other names for the same reader are served as such: ``qwen3_json`` is
hermes, ``llama4_json`` is llama3_json, ``qwen3_xml`` is qwen3_coder (one class each in
its registry), and ``glm47`` is glm45 (vLLM maps both names to one parser);
``seed_oss`` is qwen3_coder's reader with Seed-OSS's wrapper tags, ``olmo3`` and ``lfm2``
read pythonic's calls in OLMo 3's and LFM2's, and ``poolside_v1`` and ``k2_horizon`` read
GLM's pairs (in IFM's tags for K2 Horizon) with glm45's reader.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvledger.engine.server.tools.call_pieces import (
    Arguments,
    OpenCall,
    Piece,
    ToolCall,
    mistral_call_id,
    openai_call_id,
    vllm_call_id,
)
from kvledger.engine.server.tools.deepseek_format import MARKERS as DEEPSEEK_MARKERS
from kvledger.engine.server.tools.deepseek_format import deepseek_v3, deepseek_v31
from kvledger.engine.server.tools.glm_format import MARKERS as GLM_MARKERS
from kvledger.engine.server.tools.glm_format import glm45
from kvledger.engine.server.tools.granite3_format import TOOL_TOKEN, granite
from kvledger.engine.server.tools.granite_format import (
    TOOL_CALL,
    TOOL_CALL_END,
    granite4,
    granite_20b_fc,
)
from kvledger.engine.server.tools.hunyuan_format import MARKERS as HUNYUAN_MARKERS
from kvledger.engine.server.tools.hunyuan_format import hunyuan_a13b
from kvledger.engine.server.tools.internlm_format import MARKERS as INTERNLM_MARKERS
from kvledger.engine.server.tools.internlm_format import internlm
from kvledger.engine.server.tools.jamba_format import MARKERS as JAMBA_MARKERS
from kvledger.engine.server.tools.jamba_format import jamba
from kvledger.engine.server.tools.json_formats import (
    ARGS,
    HERMES_END,
    HERMES_START,
    PYTHON_TAG,
    TOOL_CALLS,
    hermes,
    llama3_json,
    mistral,
)
from kvledger.engine.server.tools.k2_horizon_format import MARKERS as K2_MARKERS
from kvledger.engine.server.tools.k2_horizon_format import k2_horizon
from kvledger.engine.server.tools.kimi_format import MARKERS as KIMI_MARKERS
from kvledger.engine.server.tools.kimi_format import kimi_k2
from kvledger.engine.server.tools.lfm2_format import CALL_END as LFM2_END
from kvledger.engine.server.tools.lfm2_format import CALL_START as LFM2_START
from kvledger.engine.server.tools.lfm2_format import lfm2
from kvledger.engine.server.tools.longcat_format import MARKERS as LONGCAT_MARKERS
from kvledger.engine.server.tools.longcat_format import longcat
from kvledger.engine.server.tools.minimax_format import MARKERS as MINIMAX_MARKERS
from kvledger.engine.server.tools.minimax_format import minimax_m2
from kvledger.engine.server.tools.phi4_format import phi4_mini_json
from kvledger.engine.server.tools.poolside_format import poolside_v1
from kvledger.engine.server.tools.pythonic_format import (
    FUNCTION_CALLS,
    FUNCTION_CALLS_END,
    llama4_pythonic,
    olmo3,
    pythonic,
)
from kvledger.engine.server.tools.step3_format import MARKERS as STEP3_MARKERS
from kvledger.engine.server.tools.step3_format import step3
from kvledger.engine.server.tools.xlam_format import xlam
from kvledger.engine.server.tools.xml_format import (
    SEED,
    TOOL_END,
    TOOL_START,
    qwen3_coder,
    seed_oss,
)

__all__ = ["ARGS", "CALL_IDS", "CONTROL_TOKENS", "READERS", "Arguments", "OpenCall",
           "Piece", "ToolCall"]

Reader = Callable[[Any, str, bool], list[Piece]]

READERS: dict[str, Reader] = {
    "hermes": hermes, "qwen3_json": hermes,
    "llama3_json": llama3_json, "llama4_json": llama3_json,
    "mistral": mistral,
    "qwen3_coder": qwen3_coder, "qwen3_xml": qwen3_coder, "seed_oss": seed_oss,
    "pythonic": pythonic, "llama4_pythonic": llama4_pythonic, "olmo3": olmo3, "lfm2": lfm2,
    "deepseek_v3": deepseek_v3, "deepseek_v31": deepseek_v31,
    "kimi_k2": kimi_k2,
    "glm45": glm45, "glm47": glm45, "poolside_v1": poolside_v1, "k2_horizon": k2_horizon,
    "minimax_m2": minimax_m2,
    "step3": step3,
    "xlam": xlam,
    "jamba": jamba,
    "hunyuan_a13b": hunyuan_a13b,
    "internlm": internlm,
    "longcat": longcat,
    "granite": granite, "granite4": granite4, "granite-20b-fc": granite_20b_fc,
    "phi4_mini_json": phi4_mini_json,
}
# kvledger's first parsers kept OpenAI's shape of id; vLLM 0.32 gives every parser's
# calls chatcmpl-tool-<16 hex> (Mistral's its own 9 characters).
CALL_IDS: dict[str, Callable[[], str]] = {
    name: {hermes: openai_call_id, llama3_json: openai_call_id,
           mistral: mistral_call_id}.get(reader, vllm_call_id)
    for name, reader in READERS.items()}
# The markers of each format that tokenizers may hold as special tokens (which decoding
# drops): the engine keeps these in the text it gives the reader. Llama 4's
# <|python_start|> is not among them: vLLM's decoding drops it before its parser reads.
CONTROL_TOKENS: dict[str, tuple[str, ...]] = {
    "hermes": (HERMES_START, HERMES_END), "qwen3_json": (HERMES_START, HERMES_END),
    "llama3_json": (PYTHON_TAG,), "llama4_json": (PYTHON_TAG,),
    "mistral": (TOOL_CALLS, ARGS),
    "qwen3_coder": (TOOL_START, TOOL_END), "qwen3_xml": (TOOL_START, TOOL_END),
    "seed_oss": (SEED.tool_start, SEED.tool_end),
    "pythonic": (), "llama4_pythonic": (), "olmo3": (FUNCTION_CALLS, FUNCTION_CALLS_END),
    "lfm2": (LFM2_START, LFM2_END),
    "deepseek_v3": DEEPSEEK_MARKERS, "deepseek_v31": DEEPSEEK_MARKERS,
    "kimi_k2": KIMI_MARKERS,
    "glm45": GLM_MARKERS, "glm47": GLM_MARKERS, "poolside_v1": GLM_MARKERS,
    "k2_horizon": K2_MARKERS,
    "minimax_m2": MINIMAX_MARKERS,
    "step3": STEP3_MARKERS,
    "xlam": (),  # (vLLM's decoding drops them, if special, before xLAM's parser reads)
    "jamba": JAMBA_MARKERS,
    "hunyuan_a13b": HUNYUAN_MARKERS,
    "internlm": INTERNLM_MARKERS,
    "longcat": LONGCAT_MARKERS,
    # Granite 3.0's is special, Granite 4's are in some checkpoints (vLLM keeps them for
    # its parsers)
    "granite": (TOOL_TOKEN,), "granite4": (TOOL_CALL, TOOL_CALL_END),
    "granite-20b-fc": (), "phi4_mini_json": (),  # (as xlam's)
}
