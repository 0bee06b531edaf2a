"""`fulmen.dynamo`: torch.compile's Dynamo captures the graphs, fulmen compiles them (see fulmen.dynamo.backend)."""

from fulmen.dynamo.backend import Fallback, FulmenBackend, GraphRecord, Piece, backend

__all__ = ["Fallback", "FulmenBackend", "GraphRecord", "Piece", "backend"]
