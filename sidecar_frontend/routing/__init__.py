"""KV-cache-aware routing (docs/frontend.md, "Routing"): the block index (``index``), the
choice weighing cached prefix against load (``policy``), and the router over both (``router``),
all pure; the workers' cache streams feed the index from the I/O side."""
