"""IceCache harness: KV-cache selection methods for long-context LLM inference on one shared core."""

__version__ = "0.1.0"
