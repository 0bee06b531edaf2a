"""Empty: the activations' grad rules moved to fulmen/ops/activations.py, next to their symbols (issue 46)."""
