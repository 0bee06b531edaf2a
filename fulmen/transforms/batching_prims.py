"""Empty: the prims' batching rules moved to fulmen/ops/prims/ (elementwise, reductions, shapes, indexing)."""
