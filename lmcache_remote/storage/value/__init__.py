"""One stored value's path, the same for a chunk (`chunks`) and a page (`pages`).

- `path`: `ValuePath`, encode-and-seal on the way out and check-and-decode on the way in
  (the header, the identity its key names, every part there, lengths, checksums, the MAC
  bound to the value's name), and `Verdicts`, what a foreign or a damaged value costs (a
  miss left in place and counted apart, or a miss deleted and counted); built once per tier
  or store from its configuration, with the integrity key read once;
- `checks`: the checks of one received part and of the MAC, and the signer a write uses.

It stands on `wire` (seals, the incomplete-value error); chunks and pages stand on it.
"""
