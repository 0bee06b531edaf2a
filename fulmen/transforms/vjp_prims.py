"""Empty: the prims' grad rules moved to fulmen/ops/prims/ (elementwise, reductions, shapes, indexing, factories)."""
