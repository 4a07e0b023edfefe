"""The torch model: config, transformer (and MoE), loader, tokenizer, runner, built-in checkpoints."""
