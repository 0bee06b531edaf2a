"""Acquisition: running the user's Python with proxies under a torch-function mode that records a trace.

Every torch call the program makes (functions, methods, operators, `torch.nn.functional`, property reads) reaches
`Interpreter.__torch_function__`. Metadata reads answer from the proxy; reads of tensor values raise
`DataDependentError`; supported ops record their symbol; in-place ops are functionalized; anything else raises
`UnsupportedOpError`. Python control flow on shapes and Python values simply runs, so the trace is specialised on
them (and the guards check them).

The mode is `Interpreter` (interpreter.py); call_kinds.py holds the kinds of torch calls it tells apart before
recording one, tensor_calls.py the calls it answers itself.
"""

from fulmen.acquisition.acquire.call_kinds import DATA_DEPENDENT, METADATA, SHAPE_UPDATES, SIZED_FACTORIES, STATE
from fulmen.acquisition.acquire.interpreter import Interpreter, _captured, current_interpreter

__all__ = ["DATA_DEPENDENT", "METADATA", "SHAPE_UPDATES", "SIZED_FACTORIES", "STATE", "Interpreter", "_captured",
           "current_interpreter"]
