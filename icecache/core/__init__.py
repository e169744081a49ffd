"""The shared core every method runs on: transformers integration, KV storage, attention, generation, timing."""
