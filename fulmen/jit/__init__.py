"""Acquisition (torch-function interception), functionalization, guards, the cache and the jitted callables."""
