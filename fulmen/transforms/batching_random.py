"""Empty: the random ops' vmap randomness rules moved to fulmen/ops/factories.py, next to their symbols (issue 46)."""
