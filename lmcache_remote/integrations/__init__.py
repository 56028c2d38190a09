"""Engine adapters (transformers, vLLM). Each submodule imports its engine only when used."""
