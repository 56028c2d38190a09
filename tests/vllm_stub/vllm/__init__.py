"""Test stand-in for vLLM (see tests/vllm_stub/README.md). Not the real package."""

__version__ = "0.0.0+lmcr-stub"
IS_LMCR_STUB = True
