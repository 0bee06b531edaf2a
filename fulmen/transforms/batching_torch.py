"""The batching rules of torch-level leaves (symbols without a prim decomposition, or whose decomposition declines
some arguments): elementwise ops, ops along a dim, scatters, losses, convolutions, matmul variants. They are written
with fulmen.ops.rules.batch.
"""
