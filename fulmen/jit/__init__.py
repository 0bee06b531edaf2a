"""`fulmen.jit`'s driver: the jitted callables, their cache of traces, the pipeline from acquisition to execution, and
what a jitted module adds (its parameters and buffers as inputs, its hooks)."""
