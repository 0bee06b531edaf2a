"""torch.func transforms a program makes while fulmen acquires it (`torch.vmap(f, ...)`, `torch.func.grad(f)`):
fulmen's own, which have torch.func's signatures (derivatives.py, vmap.py register theirs here).

torch's transform would wrap fulmen's proxies in functorch's batched or grad tensors, which no trace can hold
(refused: "a batched tensor reached it"). Hugging Face transformers builds attention masks so: `sdpa_mask` maps its
mask function over batch, head, query and key indices with four nested `torch.vmap`s, made and called at once. As
torch's `vmap` / `grad` frame returns the function it made (its local `wrapped` / `wrapper`), that local is rebound
(as a debugger sets a local, as replacements.ForwardLookasideWatch does) to a function calling fulmen's transform
of the same function and options; torch's own code then copies the transformed function's name and doc onto it, as
it does onto its own. Inside the trace fulmen's transform records the transformed calls; called after the trace, it
runs through fulmen.jit. Nothing of torch changes: other threads, and transforms made outside an acquisition, get
torch's. Known limit: a transform made before the acquisition and called inside it is torch's, refused as before.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

from fulmen.observation.frame_tap import QuietWatch

# torch's transform's code -> the region making fulmen's in its place (filled in by vmap.py, derivatives.py)
WATCHES: dict[types.CodeType, FuncTransformWatch] = {}


class FuncTransformWatch(QuietWatch):
    """A call of a torch.func transform that returns a function (frame_tap.CallWatch): at each line, once the function
    is made in the local `result`, it is replaced by fulmen's transform, which `transform` makes from the frame's
    locals (the function and the options the call was given)."""

    def __init__(self, result: str, transform: Callable[[dict[str, Any]], Callable[..., Any]]) -> None:
        self.result = result
        self.transform = transform

    def enter(self, frame: types.FrameType) -> Any:
        return [None]  # the function fulmen put in place, once made

    def line(self, token: Any, frame: types.FrameType) -> None:
        local = frame.f_locals
        made = local.get(self.result)
        if made is None or made is token[0]:
            return  # not made yet, or already fulmen's (torch's next line may copy its function's name onto it)
        transformed = self.transform(local)

        def fulmen_transform(*args: Any, **kwargs: Any) -> Any:
            return transformed(*args, **kwargs)

        token[0] = local[self.result] = fulmen_transform


def made_as(torch_transform: Callable[..., Any], result: str,
            transform: Callable[[dict[str, Any]], Callable[..., Any]]) -> None:
    """Calls of `torch_transform` made inside an acquisition give fulmen's transform (see the module docstring)."""
    WATCHES[torch_transform.__code__] = FuncTransformWatch(result, transform)
