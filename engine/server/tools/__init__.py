"""OpenAI tool calling: the tools a request offers (protocol), the prompt and grammar of a
call (calls; param_grammars, step3_grammar, raw_strings and lark_text for the formats
that write arguments one by one), each model family's call format (formats: json_formats,
xml_format with xml_arguments and schema_types, pythonic_format, deepseek_format,
kimi_format, glm_format, minimax_format with minimax_params, step3_format, xlam_format,
jamba_format, hunyuan_format, internlm_format, longcat_format, granite_format,
granite3_format, phi4_format; call_pieces and call_json their shared parts), and the calls
read back from the model's
text as it streams (parsers)."""
