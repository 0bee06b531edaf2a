"""The autograd runtime: a compiled forward trace run as one torch.autograd.Function whose backward runs the backward
trace, and the outputs it hands back as eager would (views, distinct objects, grads of outputs)."""
