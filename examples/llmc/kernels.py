"""The llm.c-style CUDA kernels as functions of torch tensors.

The CUDA C source (cuda_source.py) is compiled on first use with NVRTC, for the compute capability of the
tensors' device, into a CUBIN that the driver API loads into the primary context torch uses; kernels are launched
on torch's current stream, so they order with torch's own work like any torch op. cuda-python is imported only
then: importing this module needs neither a GPU nor cuda-python.

Every wrapper takes and returns torch tensors, accepts fp32 CUDA tensors only (integer targets for the
cross-entropy ones), and makes its inputs contiguous. Outputs are fresh tensors; nothing is accumulated into.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from examples.llmc.cuda_source import CUDA_SOURCE, KERNEL_NAMES, LAYERNORM_PARAMS_BLOCK

__all__ = [
    "CUDA_SOURCE", "crossentropy_forward", "crossentropy_softmax_backward", "gelu_backward", "gelu_forward",
    "layernorm_backward", "layernorm_forward", "permute_split", "permute_split_backward", "softmax_forward",
    "unpermute_backward", "unpermute_forward",
]

_INSTALL_HINT = "pip install cuda-python  (or: pip install 'fulmen[llmc]')"
_ELEMENTWISE_BLOCK = 256
# Grid-stride loops cover any size; more blocks than this only adds scheduling work.
_MAX_GRID = 65535 * 32
_INT32_MAX = 2**31 - 1


# ---- cuda-python: import, errors, compilation, loading ----------------------------------------------------


def _import_cuda() -> tuple[ModuleType, ModuleType]:
    try:
        from cuda.bindings import driver, nvrtc
    except ImportError as e:
        raise ImportError(
            f"examples.llmc compiles its kernels with NVRTC and launches them through the CUDA driver API, "
            f"which needs cuda-python: {_INSTALL_HINT}. Pick the cuda-python major version your NVIDIA driver "
            f"supports (nvidia-smi shows it as 'CUDA Version')."
        ) from e
    return driver, nvrtc


def _driver_ok(driver: ModuleType, result: tuple, what: str) -> Any:
    """Unpacks a driver call's (CUresult, *values) tuple, raising on an error."""
    err, *values = result
    if err != driver.CUresult.CUDA_SUCCESS:
        name_err, name = driver.cuGetErrorName(err)
        label = name.decode() if name_err == driver.CUresult.CUDA_SUCCESS else str(err)
        raise RuntimeError(f"llm.c kernels: {what} failed with {label}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def _nvrtc_ok(nvrtc: ModuleType, result: tuple, what: str) -> Any:
    err, *values = result
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"llm.c kernels: NVRTC {what} failed with {_nvrtc_error_string(nvrtc, err)}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def _nvrtc_error_string(nvrtc: ModuleType, err: Any) -> str:
    status, text = nvrtc.nvrtcGetErrorString(err)
    return text.decode() if status == nvrtc.nvrtcResult.NVRTC_SUCCESS else str(err)


def _program_log(nvrtc: ModuleType, program: Any) -> str:
    size = _nvrtc_ok(nvrtc, nvrtc.nvrtcGetProgramLogSize(program), "nvrtcGetProgramLogSize")
    log = bytearray(size)
    _nvrtc_ok(nvrtc, nvrtc.nvrtcGetProgramLog(program, log), "nvrtcGetProgramLog")
    return log.rstrip(b"\0").decode(errors="replace").strip()


@functools.cache
def compile_cubin(major: int, minor: int) -> bytes:
    """Compiles CUDA_SOURCE for sm_{major}{minor} with NVRTC. Needs cuda-python, not a GPU."""
    _, nvrtc = _import_cuda()
    arch = f"sm_{major}{minor}"
    program = _nvrtc_ok(
        nvrtc, nvrtc.nvrtcCreateProgram(CUDA_SOURCE.encode(), b"llmc_kernels.cu", 0, [], []), "nvrtcCreateProgram"
    )
    try:
        # No --use_fast_math: the kernels are checked against torch to 1e-5, which the approximate
        # exp/log/tanh intrinsics would not meet.
        options = [f"--gpu-architecture={arch}".encode(), b"--std=c++17"]
        (err,) = nvrtc.nvrtcCompileProgram(program, len(options), options)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(
                f"llm.c kernels: NVRTC could not compile the kernels for {arch} "
                f"({_nvrtc_error_string(nvrtc, err)}). Compiler log:\n{_program_log(nvrtc, program)}"
            )
        size = _nvrtc_ok(nvrtc, nvrtc.nvrtcGetCUBINSize(program), "nvrtcGetCUBINSize")
        cubin = bytearray(size)
        _nvrtc_ok(nvrtc, nvrtc.nvrtcGetCUBIN(program, cubin), "nvrtcGetCUBIN")
        return bytes(cubin)
    finally:
        nvrtc.nvrtcDestroyProgram(program)


@dataclass(frozen=True)
class _LoadedModule:
    driver: ModuleType
    context: Any  # the device's primary context (the one torch uses)
    functions: dict[str, Any]


_modules: dict[int, _LoadedModule] = {}
_modules_lock = threading.Lock()


def _loaded_module(device: torch.device) -> _LoadedModule:
    index = device.index if device.index is not None else torch.cuda.current_device()
    module = _modules.get(index)
    if module is None:
        with _modules_lock:
            module = _modules.get(index)
            if module is None:
                module = _modules[index] = _load_module(index)
    return module


def _load_module(index: int) -> _LoadedModule:
    driver, nvrtc = _import_cuda()
    torch.cuda.init()
    # torch creates the device's primary context lazily; make sure it exists before the driver API retains it.
    torch.empty(1, device=torch.device("cuda", index))
    cubin = compile_cubin(*torch.cuda.get_device_capability(index))
    _driver_ok(driver, driver.cuInit(0), "cuInit")
    cu_device = _driver_ok(driver, driver.cuDeviceGet(index), "cuDeviceGet")
    context = _driver_ok(driver, driver.cuDevicePrimaryCtxRetain(cu_device), "cuDevicePrimaryCtxRetain")
    with _current_context(driver, context):
        try:
            cu_module = _driver_ok(driver, driver.cuModuleLoadData(cubin), "cuModuleLoadData")
        except RuntimeError as e:
            _, driver_version = driver.cuDriverGetVersion()
            _, nvrtc_major, nvrtc_minor = nvrtc.nvrtcVersion()
            raise RuntimeError(
                f"{e} (kernels built by NVRTC {nvrtc_major}.{nvrtc_minor}; the driver supports CUDA "
                f"{driver_version // 1000}.{driver_version % 1000 // 10}: install the cuda-python major version "
                f"that matches the driver)"
            ) from e
        functions = {
            name: _driver_ok(driver, driver.cuModuleGetFunction(cu_module, name.encode()), f"get kernel {name}")
            for name in KERNEL_NAMES
        }
    return _LoadedModule(driver, context, functions)


@contextlib.contextmanager
def _current_context(driver: ModuleType, context: Any) -> Iterator[None]:
    """Makes `context` current on this thread for the block, restoring the previous one after.

    torch's threads normally have the primary context current already (then this does nothing); autograd's
    worker threads, or a tensor on another device than the thread's, may not.
    """
    current = _driver_ok(driver, driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if int(current) == int(context):
        yield
        return
    _driver_ok(driver, driver.cuCtxPushCurrent(context), "cuCtxPushCurrent")
    try:
        yield
    finally:
        _driver_ok(driver, driver.cuCtxPopCurrent(), "cuCtxPopCurrent")


# ---- launching ---------------------------------------------------------------------------------------------


class _i64(int):
    """Marks a kernel argument whose C type is `long long` (plain Python ints are passed as `int`)."""


def _kernel_params(args: tuple) -> tuple[tuple, tuple]:
    """cuda-bindings' documented kernelParams form: a tuple of values and a tuple of their ctypes types.

    cuLaunchKernel packs each value into a buffer of its ctypes type and passes the driver an array of pointers
    to them. Device pointers are passed as c_void_p holding the address (tensor.data_ptr()); the C types must
    match the kernel's parameter types exactly, since the driver copies by the kernel's parameter sizes.
    """
    values: list[Any] = []
    types: list[Any] = []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            values.append(arg.data_ptr())
            types.append(ctypes.c_void_p)
        elif isinstance(arg, _i64):
            values.append(int(arg))
            types.append(ctypes.c_longlong)
        elif isinstance(arg, bool):
            raise TypeError("llm.c kernels take no bool arguments")
        elif isinstance(arg, int):
            if not -(2**31) <= arg <= _INT32_MAX:
                raise ValueError(f"llm.c kernels: {arg} does not fit the kernel's 32-bit int parameter")
            values.append(arg)
            types.append(ctypes.c_int)
        elif isinstance(arg, float):
            values.append(arg)
            types.append(ctypes.c_float)
        else:
            raise TypeError(f"llm.c kernels: cannot pass a {type(arg).__name__} to a kernel")
    return tuple(values), tuple(types)


def _launch(name: str, device: torch.device, grid: tuple[int, ...], block: tuple[int, ...], *args: Any) -> None:
    module = _loaded_module(device)
    driver = module.driver
    grid3 = tuple(grid) + (1,) * (3 - len(grid))
    block3 = tuple(block) + (1,) * (3 - len(block))
    stream = driver.CUstream(torch.cuda.current_stream(device).cuda_stream)
    params = _kernel_params(args)
    with _current_context(driver, module.context):
        _driver_ok(
            driver,
            driver.cuLaunchKernel(module.functions[name], *grid3, *block3, 0, stream, params, 0),
            f"launch {name}",
        )


def _elementwise_grid(n: int) -> tuple[int]:
    return (max(1, min(_MAX_GRID, -(-n // _ELEMENTWISE_BLOCK))),)


# ---- argument checks -----------------------------------------------------------------------------------------


def _float_input(t: torch.Tensor, what: str, ndim: int | None = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cuda":
        raise ValueError(f"{what}: the llm.c kernels run on CUDA tensors, got a tensor on {t.device}")
    if t.dtype != torch.float32:
        raise TypeError(f"{what}: the llm.c kernels support float32 only, got {t.dtype}")
    if ndim is not None and t.ndim != ndim:
        raise ValueError(f"{what}: expected a {ndim}-D tensor, got shape {tuple(t.shape)}")
    return t.contiguous()


def _target_input(t: torch.Tensor, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor of targets, got {type(t).__name__}")
    if t.device.type != "cuda":
        raise ValueError(f"{what}: the llm.c kernels run on CUDA tensors, got targets on {t.device}")
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{what}: targets must be int32 or int64 class indices, got {t.dtype}")
    # The kernels read int32 targets; class indices always fit.
    return t.to(torch.int32).contiguous()


def _dim(value: int, what: str) -> int:
    if value > _INT32_MAX:
        raise ValueError(f"{what}: dimension {value} exceeds the kernels' 32-bit int")
    return int(value)


def _same_device(what: str, *tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"{what}: all tensors must be on one device, got {sorted(map(str, devices))}")


def _rows(x: torch.Tensor) -> tuple[int, int]:
    """(rows, C) of a tensor seen as rows of its last dim."""
    C = x.shape[-1] if x.ndim > 0 else 1
    return (x.numel() // C if C else 0), C


# ---- attention layout ------------------------------------------------------------------------------------------


def permute_split(qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, T, 3, NH, d) fused projections -> q, k, v, each (B, NH, T, d)."""
    qkv = _float_input(qkv, "permute_split", ndim=5)
    B, T, three, NH, d = qkv.shape
    if three != 3:
        raise ValueError(f"permute_split: dim 2 must hold q, k and v (size 3), got shape {tuple(qkv.shape)}")
    q, k, v = (torch.empty((B, NH, T, d), dtype=qkv.dtype, device=qkv.device) for _ in range(3))
    if q.numel():
        _launch("llmc_permute_split", qkv.device, _elementwise_grid(q.numel()), (_ELEMENTWISE_BLOCK,),
                q, k, v, qkv, _dim(B, "B"), _dim(T, "T"), _dim(NH, "NH"), _dim(d, "d"))
    return q, k, v


def permute_split_backward(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> torch.Tensor:
    """Gradients of q, k, v (each (B, NH, T, d)) -> gradient of the fused (B, T, 3, NH, d) input."""
    dq, dk, dv = (_float_input(g, "permute_split_backward", ndim=4) for g in (dq, dk, dv))
    if not dq.shape == dk.shape == dv.shape:
        raise ValueError(f"permute_split_backward: shapes differ: {dq.shape}, {dk.shape}, {dv.shape}")
    _same_device("permute_split_backward", dq, dk, dv)
    B, NH, T, d = dq.shape
    dqkv = torch.empty((B, T, 3, NH, d), dtype=dq.dtype, device=dq.device)
    if dqkv.numel():
        _launch("llmc_permute_split_backward", dq.device, _elementwise_grid(dq.numel()), (_ELEMENTWISE_BLOCK,),
                dqkv, dq, dk, dv, _dim(B, "B"), _dim(T, "T"), _dim(NH, "NH"), _dim(d, "d"))
    return dqkv


def unpermute_forward(heads: torch.Tensor) -> torch.Tensor:
    """(B, NH, T, d) -> (B, T, NH, d), the heads side by side again."""
    return _swap_heads_and_tokens(heads, "unpermute_forward", "llmc_unpermute", heads_first=True)


def unpermute_backward(dmerged: torch.Tensor) -> torch.Tensor:
    """Gradient of the (B, T, NH, d) output -> gradient of the (B, NH, T, d) input."""
    return _swap_heads_and_tokens(dmerged, "unpermute_backward", "llmc_unpermute_backward", heads_first=False)


def _swap_heads_and_tokens(x: torch.Tensor, what: str, kernel: str, heads_first: bool) -> torch.Tensor:
    """(B, A, C, d) -> (B, C, A, d) with `kernel`, where (A, C) is (NH, T) if `heads_first`, else (T, NH)."""
    x = _float_input(x, what, ndim=4)
    B, first, second, d = x.shape
    NH, T = (first, second) if heads_first else (second, first)
    out = torch.empty((B, second, first, d), dtype=x.dtype, device=x.device)
    if out.numel():
        _launch(kernel, x.device, _elementwise_grid(out.numel()), (_ELEMENTWISE_BLOCK,),
                out, x, _dim(B, "B"), _dim(T, "T"), _dim(NH, "NH"), _dim(d, "d"))
    return out


# ---- softmax and cross-entropy -------------------------------------------------------------------------------


def softmax_forward(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim (numerically stable: the row maximum is subtracted first)."""
    x = _float_input(x, "softmax_forward")
    out = torch.empty_like(x)
    rows, C = _rows(x)
    if rows and C:
        # One block per row, sized to the row so short attention rows do not idle most of a large block.
        block = min(512, -(-C // 32) * 32)
        _launch("llmc_softmax", x.device, (min(rows, _INT32_MAX),), (block,), out, x, _i64(rows), _dim(C, "C"))
    return out


def crossentropy_forward(probs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-position losses -log(probs[..., target]) for probs (..., V) and targets (...).

    A negative target marks an ignored position (torch's ignore_index < 0): its loss is 0. The caller
    averages over the positions it counts as valid; this returns no mean so that choice stays visible.
    """
    probs = _float_input(probs, "crossentropy_forward")
    targets = _target_input(targets, "crossentropy_forward")
    if probs.ndim < 1 or tuple(targets.shape) != tuple(probs.shape[:-1]):
        raise ValueError(f"crossentropy_forward: targets {tuple(targets.shape)} must be probs' "
                         f"{tuple(probs.shape)} without the last dim")
    _same_device("crossentropy_forward", probs, targets)
    rows, V = _rows(probs)
    losses = torch.empty(targets.shape, dtype=probs.dtype, device=probs.device)
    if rows:
        _launch("llmc_crossentropy_forward", probs.device, _elementwise_grid(rows), (_ELEMENTWISE_BLOCK,),
                losses, probs, targets, _i64(rows), _dim(V, "V"))
    return losses


def crossentropy_softmax_backward(dlosses: torch.Tensor, probs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Gradient of the logits for per-position losses with gradient `dlosses`: (probs - onehot(target)) * dloss.

    Rows whose target is negative (ignored) get a zero gradient.
    """
    dlosses = _float_input(dlosses, "crossentropy_softmax_backward")
    probs = _float_input(probs, "crossentropy_softmax_backward")
    targets = _target_input(targets, "crossentropy_softmax_backward")
    if probs.ndim < 1 or not tuple(dlosses.shape) == tuple(targets.shape) == tuple(probs.shape[:-1]):
        raise ValueError(f"crossentropy_softmax_backward: dlosses {tuple(dlosses.shape)} and targets "
                         f"{tuple(targets.shape)} must be probs' {tuple(probs.shape)} without the last dim")
    _same_device("crossentropy_softmax_backward", dlosses, probs, targets)
    rows, V = _rows(probs)
    dlogits = torch.empty_like(probs)
    if probs.numel():
        _launch("llmc_crossentropy_softmax_backward", probs.device, _elementwise_grid(probs.numel()),
                (_ELEMENTWISE_BLOCK,), dlogits, dlosses, probs, targets, _i64(rows), _dim(V, "V"))
    return dlogits


# ---- GELU ----------------------------------------------------------------------------------------------------


def gelu_forward(x: torch.Tensor) -> torch.Tensor:
    """The tanh approximation of GELU, elementwise."""
    x = _float_input(x, "gelu_forward")
    out = torch.empty_like(x)
    if x.numel():
        _launch("llmc_gelu_forward", x.device, _elementwise_grid(x.numel()), (_ELEMENTWISE_BLOCK,),
                out, x, _i64(x.numel()))
    return out


def gelu_backward(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Gradient of gelu_forward's input, given its input `x` and the gradient of its output."""
    x = _float_input(x, "gelu_backward")
    grad = _float_input(grad, "gelu_backward")
    if x.shape != grad.shape:
        raise ValueError(f"gelu_backward: input {tuple(x.shape)} and grad {tuple(grad.shape)} differ in shape")
    _same_device("gelu_backward", x, grad)
    dx = torch.empty_like(x)
    if x.numel():
        _launch("llmc_gelu_backward", x.device, _elementwise_grid(x.numel()), (_ELEMENTWISE_BLOCK,),
                dx, x, grad, _i64(x.numel()))
    return dx


# ---- LayerNorm -----------------------------------------------------------------------------------------------

_LAYERNORM_WARPS = 4  # rows per block of the one-warp-per-row kernels


def _check_layernorm_params(what: str, x: torch.Tensor, *params: torch.Tensor) -> None:
    C = x.shape[-1]
    for p in params:
        if tuple(p.shape) != (C,):
            raise ValueError(f"{what}: weight and bias must have shape ({C},), the input's last dim; "
                             f"got {tuple(p.shape)}")


def layernorm_forward(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LayerNorm over the last dim -> (out, mean, rstd); mean and rstd have x's shape without the last dim."""
    x = _float_input(x, "layernorm_forward")
    weight = _float_input(weight, "layernorm_forward")
    bias = _float_input(bias, "layernorm_forward")
    if x.ndim < 1:
        raise ValueError("layernorm_forward: the input needs at least one dim")
    _check_layernorm_params("layernorm_forward", x, weight, bias)
    _same_device("layernorm_forward", x, weight, bias)
    rows, C = _rows(x)
    out = torch.empty_like(x)
    mean = torch.empty(x.shape[:-1], dtype=x.dtype, device=x.device)
    rstd = torch.empty(x.shape[:-1], dtype=x.dtype, device=x.device)
    if rows and C:
        grid = (-(-rows // _LAYERNORM_WARPS),)
        _launch("llmc_layernorm_forward", x.device, grid, (32 * _LAYERNORM_WARPS,),
                out, mean, rstd, x, weight, bias, _i64(rows), _dim(C, "C"), float(eps))
    return out, mean, rstd


def layernorm_backward(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dx, dweight, dbias) of layernorm_forward, from its saved mean and rstd."""
    grad = _float_input(grad, "layernorm_backward")
    x = _float_input(x, "layernorm_backward")
    weight = _float_input(weight, "layernorm_backward")
    mean = _float_input(mean, "layernorm_backward")
    rstd = _float_input(rstd, "layernorm_backward")
    if x.ndim < 1 or grad.shape != x.shape:
        raise ValueError(f"layernorm_backward: grad {tuple(grad.shape)} must have the input's shape "
                         f"{tuple(x.shape)}")
    if not tuple(mean.shape) == tuple(rstd.shape) == tuple(x.shape[:-1]):
        raise ValueError("layernorm_backward: mean and rstd must have the input's shape without the last dim")
    _check_layernorm_params("layernorm_backward", x, weight)
    _same_device("layernorm_backward", grad, x, weight, mean, rstd)
    rows, C = _rows(x)
    dx = torch.empty_like(x)
    dweight = torch.empty_like(weight)
    dbias = torch.empty_like(weight)
    if not C:
        return dx, dweight, dbias
    if not rows:  # no rows to sum over: the parameter gradients are zero
        return dx, dweight.zero_(), dbias.zero_()
    grid = (-(-rows // _LAYERNORM_WARPS),)
    _launch("llmc_layernorm_backward_input", x.device, grid, (32 * _LAYERNORM_WARPS,),
            dx, grad, x, weight, mean, rstd, _i64(rows), _dim(C, "C"))
    _launch("llmc_layernorm_backward_params", x.device, (-(-C // 32),), LAYERNORM_PARAMS_BLOCK,
            dweight, dbias, grad, x, mean, rstd, _i64(rows), _dim(C, "C"))
    return dx, dweight, dbias
