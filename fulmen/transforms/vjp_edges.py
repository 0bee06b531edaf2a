"""Grad rules that keep eager's gradients at the edges, where differentiating a decomposition would not.

A decomposition computes the op's values, but its chain rule can disagree with eager's backward at edge values:
a zero deviation (std: sqrt's infinite slope times a zero), a NaN against a clamp bound, a zero divisor under a
rounding division, a NaN maximum. Each rule here states eager's formula for the op, or runs eager's own backward
where eager has none worth restating (it raises, or its degenerate cases are its own).
"""
