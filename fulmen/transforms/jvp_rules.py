"""The JVP rules: every prim with floating outputs, and the torch-level leaves that are linear or common in
backward traces. Symbols not here are differentiated through their decomposition, or by torch's forward-mode AD.
"""
