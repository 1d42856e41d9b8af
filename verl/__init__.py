"""verl overlay focused on trustworthy Megatron checkpointing for RL training."""

__version__ = "0.1.0"
