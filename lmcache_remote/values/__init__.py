"""What a chunk is stored as, byte by byte (docs/value-format.md): `value_format` (the header
that makes each value self-describing), `codecs` (one segment to stored bytes and back),
`sizing` (part sizes that fill Redis's allocation classes), `serde` (`Serde`: a chunk tensor
into its values and back, checked) and `integrity` (the integrity key and the MAC)."""
