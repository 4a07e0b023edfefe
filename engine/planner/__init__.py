"""The memory planner: torch-free, runs in the init container and inside the engine."""
