"""The Redis wire: bytes to and from one server, under one deadline per call.

- `resp`: RESP packing, scatter/gather sends, the Python reply reader;
- `bulk`: `BulkPipeline`, batches over redis-py's own connections, values sent as views and
  received into their places (native `_wire` loop or Python), each command's reply or error
  its own;
- `deadline`: one deadline for a whole call; `arena`: reused receive memory;
- `commands`: the atomic chunk write (whole or absent), its routing key, the checks of its
  replies; `windows`: how a batch is cut into windows, the read-ahead, the byte budget of
  writes in flight;
- `lanes`: read lanes that serve the engine's step first.

It knows commands and bytes, not chunks, pages, health or clusters: those are above.
"""
