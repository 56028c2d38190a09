"""What a chunk is called: `keys` (every Redis key the project builds or parses), `hashing`
(token ids to chained chunk hashes, `TokenDatabase`), `identity` (`RequestIdentity`: what a
chunk's KV depends on beyond its tokens) and `fingerprint` (a model's and a LoRA adapter's
fingerprint, the keys' model field). The spec is docs/key-schema.md."""
