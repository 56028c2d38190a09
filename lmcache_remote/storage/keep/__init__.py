"""The keep policy (docs/keep.md): which chunks Redis holds and which go first.

- `policy`: the judgment, free of I/O (classes, the learned figures, scores, admission);
- `scripts`: its state's changes, each one script on the keep keys' slot;
- `book`: `KeepBook`, that state in Redis and the calls the lookup, the store's plan and the
  writer make of it.
"""
