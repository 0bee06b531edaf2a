"""The callables symbols run: fulmen's own functional helpers (`impls`, as traces print them), eager's fused backward
kernels as symbols (`backward_kernels`), and which of torch's attention kernels eager picks (`sdpa_kernels`)."""
