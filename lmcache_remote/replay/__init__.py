"""Replaying request traces through the cache (issue 54): a trace's requests (`trace`), what
caches of a given size would hit on them (`offline`, `published`), and the replay of the same
requests through the real engine against a real Redis (`driver`), with the report that puts
them side by side (`report`). docs/replay.md says how to run it."""
