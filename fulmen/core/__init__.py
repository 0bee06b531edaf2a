"""The IR: proxies, symbols, bound symbols, traces and their Python codegen."""
