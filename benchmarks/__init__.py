"""Throughput and latency runs that print figures (not tests); `python -m benchmarks.run`."""
