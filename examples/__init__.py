"""Example programs built on fulmen (run them from the repository root: python -m examples.NAME.MODULE)."""
