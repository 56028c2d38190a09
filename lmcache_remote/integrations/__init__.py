"""Engine adapters (transformers, vLLM, SGLang); each imports its engine only when used."""
