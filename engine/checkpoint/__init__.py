"""What a checkpoint directory declares, read without torch and without tensor data:
config.json as the engine reads it, the safetensors headers, the attention layout, the
model's shape and the weight formats the engine loads (fp8, 4-bit). The planner and the
model both ask it; it asks neither."""
