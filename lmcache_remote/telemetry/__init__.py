"""What the cache counts: `metrics` (counters and histograms, the sources `stats()` reads) and
`prometheus` (their collector and HTTP exporter). The engine's reporting of them
(`engine.reporting`) sits a layer up."""
