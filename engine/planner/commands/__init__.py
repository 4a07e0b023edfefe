"""The planner's commands: ``kvledger plan``, ``preflight`` and ``fetch``."""
