"""Dense (no sparsity) bf16 tensor-core peaks from NVIDIA's datasheets, for the MFU pretraining and the benchmarks
report; the first name contained in the device name wins."""

from __future__ import annotations

import torch

PEAK_BF16_DENSE_FLOPS = (
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # SXM ("NVIDIA H100 80GB HBM3")
    ("A100", 312e12),
)


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """None on CPU, for a dtype other than bf16 and for a GPU not in the table."""
    if device.type != "cuda" or dtype != torch.bfloat16:
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_DENSE_FLOPS if key in name), None)
