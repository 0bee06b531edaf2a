"""torch.func's functional transforms on traces (`fulmen.grad`, `vjp`, `jvp`, `vmap`), and the forward-mode and
batching engines that only they run."""
