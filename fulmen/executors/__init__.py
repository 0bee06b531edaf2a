"""Executors: who runs each symbol of a final trace."""
