"""Test stand-in package (tests/vllm_stub)."""
