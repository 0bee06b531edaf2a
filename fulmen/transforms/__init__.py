"""Passes over traces; each returns a new trace stamped with its provenance."""
