"""Empty: the random ops' grad rules moved to fulmen/ops/factories.py, next to their symbols (issue 46)."""
