"""Acquisition: the program's Python run with proxies, its torch calls recorded into a trace, in-place updates and
views made functional, and the calls fulmen answers in place of the program's (autograd Functions, torch.func
transforms, torch.compile'd functions)."""
