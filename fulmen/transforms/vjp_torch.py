"""Empty: its grad rules moved to fulmen/ops/nn.py and fulmen/ops/factories.py, next to their symbols (issue 46)."""
