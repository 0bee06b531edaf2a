"""Short dtype names for trace comments (`f32`, `bf16`, ...)."""

import torch

SHORT_NAMES: dict[torch.dtype, str] = {
    torch.float64: "f64",
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.complex64: "c64",
    torch.complex128: "c128",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "b8",
}


def short_name(dtype: torch.dtype) -> str:
    return SHORT_NAMES.get(dtype, str(dtype).removeprefix("torch."))
