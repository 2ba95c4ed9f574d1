"""shardctl: plan, reshard and verify LLM checkpoints."""

__version__ = "0.1.0"
