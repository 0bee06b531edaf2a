"""The program seeing `torch.compiler.is_compiling()` as True while fulmen acquires it, as under Dynamo.

Libraries branch on it to keep tensor-value reads out of traced code: Hugging Face transformers' masking skips
`if padding_mask.all(): drop the mask` (a data-dependent branch) when it knows it is being traced, and keeps the
mask, which gives the same attention. fulmen.jit acquires a program as eager runs it, and again under this flag
only when eager's path reads a tensor value. torch's own session flag is used (the one Dynamo sets while it
compiles).
"""

from __future__ import annotations

import contextlib

import torch

# torch 2.6+: a private context manager around the documented flag behind torch.compiler.is_compiling().
seen_as_compiling = getattr(torch.compiler, "_compile_session_context", contextlib.nullcontext)
