"""Where a code object reads Python state that existed before the call: its read sites, found from the bytecode.
(Its attribute and global writes are sites too: what the program wrote during the call, it does not read from
before it.)

A read site is an instruction offset plus how to name what it reads from the frame when it runs: a global (or
builtin), a closure cell, or an attribute of an object the frame can name (a local, a global, a cell, an attribute
or an item of one of those at a key so named, `getattr(obj, name)` with such arguments, or what a call or a Python
getter returned: a `Result`). The observer (observer.py) evaluates these names in the running frame just before the
instruction executes, so it sees exactly the object the instruction reads.

Naming comes from a small abstract stack per basic block: loads of locals, globals, cells and constants push a
named value, attribute and subscript loads combine them, a call pushes its `Result`, and any other instruction makes
everything it leaves unnamed. Knowledge never crosses a jump target, so a name is only given where the bytecode
itself proves it. A value only Python code can give (what a function returns, a property's or `__getattr__`'s
answer) is caught from that code's return (`Capture`): where the callable is a class or C code (an lru_cache hit),
the value stays unnamed and reads off it unguarded (known limit).

What C code reads is seen for the builtins and `object` slots named here, the standard library's whole-object
readers (frame_tap._STATE_READERS), and the calls of `CallRead` (a named `operator.attrgetter`, `isinstance`, `type`, a
string constant's `format`) with arguments passed by position. Known limit: other C code reading objects the program
did not build (a getter made and called in one expression, an attrgetter used as a `sort` key, `format` with keyword
arguments).
"""

from __future__ import annotations

import dis
from dataclasses import dataclass, field
from types import CodeType
from typing import Any


@dataclass(frozen=True, slots=True)
class _Named:
    """A place or read known by one name; the subclasses differ only in what the name names."""

    name: str


class Local(_Named):
    __slots__ = ()


class Global(_Named):
    __slots__ = ()


class Cell(_Named):
    __slots__ = ()


@dataclass(frozen=True, slots=True)
class Const:
    value: Any


@dataclass(frozen=True, slots=True)
class Attr:
    base: Source
    name: str
    # the instruction loading it: a value a Python getter gives (a property) is known from the getter's return
    offset: int = field(default=-1, compare=False)


@dataclass(frozen=True, slots=True)
class Item:
    """`base[key]`, read without running code only where `base` is a dict, list or tuple."""

    base: Source
    key: Source


@dataclass(frozen=True, slots=True)
class Method:
    """`base.name` loaded to be called (LOAD_METHOD): names the callable of the call that follows."""

    base: Source
    name: str


@dataclass(frozen=True, slots=True)
class Result:
    """What the call at `offset` returned, known where the called Python function's frame returned it (the
    observer catches the return of the function it expected to run: `Capture`)."""

    offset: int


Source = Local | Global | Cell | Const | Attr | Item | Method | Result


class GlobalRead(_Named):
    __slots__ = ()


class CellRead(_Named):
    """`name`: a free variable of the code (its cell belongs to the function, and existed before the call)."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class AttrRead:
    receiver: Source
    name: str


@dataclass(frozen=True, slots=True)
class AttrCall:
    """`getattr(obj, name[, default])`, `hasattr(obj, name)` or `vars(obj)` (a read), `setattr(obj, name, value)`
    or `delattr(obj, name)` (a write)."""

    function: Global | Attr  # checked to be the builtin (or object's slot) when the call runs
    receiver: Source
    name: Source


@dataclass(frozen=True, slots=True)
class CallRead:
    """`function(*arguments)`, all passed by position, where the function may be C code reading what its arguments
    hold: an `operator.attrgetter` (the attributes it names), `isinstance(obj, cls)` and `type(obj)` (the class of
    `obj`), or a string's `format` (the attributes and items its fields name). Which of these it is, if any, is known
    when the call runs (the observer's `_CALL_READERS`). An unnamed argument is None."""

    function: Source
    arguments: tuple[Source | None, ...]


@dataclass(frozen=True, slots=True)
class AttrWrite:
    """`obj.name = value` or `del obj.name`."""

    receiver: Source
    name: str  # a later read of this attribute in the same call reads what the program wrote: no guard
    deletes: bool = False


@dataclass(frozen=True, slots=True)
class GlobalWrite(_Named):
    """`global name; name = value` or `del name`."""

    deletes: bool = False


@dataclass(frozen=True, slots=True)
class ItemWrite:
    """`container[key] = value`, `del container[key]` or `container += other`: changes `container` in place when it
    is a list, dict or set (container_writes.py names the line by these)."""

    container: Source


@dataclass(frozen=True, slots=True)
class Capture:
    """Before the instruction at this offset runs (a call, or an attribute load a Python getter may answer), the
    observer learns which Python code will give its value (`callee`: the called function, or `getter`'s
    descriptor on its receiver), to catch what it returns (a `Result`, or the `Attr` at this offset). `then`: the
    site this instruction is besides."""

    callee: Source | None
    getter: Attr | None
    then: Read | None


Read = GlobalRead | CellRead | AttrRead | AttrCall | CallRead | AttrWrite | GlobalWrite | ItemWrite | Capture

_UNKNOWN = None
_LOAD_LOCAL = frozenset({"LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_AND_CLEAR", "LOAD_FAST_BORROW"})
_LOAD_LOCAL_PAIR = frozenset({"LOAD_FAST_LOAD_FAST", "LOAD_FAST_BORROW_LOAD_FAST_BORROW"})
_LOAD_CELL = frozenset({"LOAD_DEREF", "LOAD_CLASSDEREF"})
_NO_STACK_EFFECT = frozenset({"NOP", "CACHE", "RESUME", "EXTENDED_ARG", "KW_NAMES", "COPY_FREE_VARS", "MAKE_CELL"})
# The call instruction whose stack still holds the callable and its arguments (3.11 splits PRECALL/CALL).
_CALL = "PRECALL" if "PRECALL" in dis.opmap else "CALL"
# The builtins that read or write an attribute by name, and how many arguments each call takes; then the same for
# object's own slots called unbound (`object.__setattr__(self, name, value)`, as frozen dataclasses write).
_ATTRIBUTE_BUILTINS = {"getattr": (2, 3), "hasattr": (2,), "setattr": (3,), "delattr": (2,), "vars": (1,)}
_ATTRIBUTE_SLOTS = {"__getattribute__": (2,), "__setattr__": (3,), "__delattr__": (2,)}
# The builtins whose C code reads the class of their first argument, by how many arguments a call takes.
_CLASS_BUILTINS = {"isinstance": 2, "type": 1}


def _load_attr_pushes(instruction: dis.Instruction) -> int:
    """How many values LOAD_ATTR / LOAD_METHOD push (a method load pushes the function and self, or NULL)."""
    return 1 + dis.stack_effect(instruction.opcode, instruction.arg)


class _Stack:
    """The abstract value stack of one basic block; popping below what the block pushed gives unnamed values."""

    def __init__(self) -> None:
        self.items: list[Source | None] = []

    def pop(self, n: int = 1) -> list[Source | None]:
        taken = [self.items.pop() if self.items else _UNKNOWN for _ in range(n)]
        return taken[::-1]

    def peek(self, depth: int) -> Source | None:
        return self.items[-depth] if len(self.items) >= depth else _UNKNOWN

    def forget(self, effect: int) -> None:
        self.items = [_UNKNOWN] * max(0, len(self.items) + effect)


def read_sites(code: CodeType) -> dict[int, Read]:
    """Instruction offset -> what the instruction there reads from state that may predate the call."""
    sites: dict[int, Read] = {}
    stack = _Stack()
    freevars = frozenset(code.co_freevars) - {"__class__"}  # `__class__` is the defining class (zero-arg super)
    keywords = False  # the next call passes keywords (3.11, 3.12 name them in KW_NAMES; 3.13 has CALL_KW)
    callee: Source | None = _UNKNOWN  # what the call being prepared calls (3.11 splits PRECALL/CALL)
    producers: dict[int, Source | None] = {}  # offset of a call or attribute load -> the callee, or the Attr
    for ins in dis.get_instructions(code):
        op = ins.opname
        if ins.is_jump_target or op == "PUSH_EXC_INFO":
            stack = _Stack()
        if op in _LOAD_LOCAL:
            stack.items.append(Local(ins.argval))
        elif op in _LOAD_LOCAL_PAIR:
            stack.items.extend(Local(name) for name in ins.argval)
        elif op in _LOAD_CELL:
            stack.items.append(Cell(ins.argval))
            if ins.argval in freevars:
                sites[ins.offset] = CellRead(ins.argval)
        elif op in ("LOAD_GLOBAL", "LOAD_NAME"):
            pushes = dis.stack_effect(ins.opcode, ins.arg)
            stack.items.extend([_UNKNOWN] * (pushes - 1))  # the NULL of a call (3.11, 3.12)
            stack.items.append(Global(ins.argval))
            sites[ins.offset] = GlobalRead(ins.argval)
        elif op == "LOAD_CONST":
            stack.items.append(Const(ins.argval))
        elif op in ("LOAD_ATTR", "LOAD_METHOD"):
            (receiver,) = stack.pop()
            if receiver is not _UNKNOWN:
                sites[ins.offset] = AttrRead(receiver, ins.argval)
            pushes = _load_attr_pushes(ins)
            if pushes == 1 and receiver is not _UNKNOWN:
                stack.items.append(producers.setdefault(ins.offset, Attr(receiver, ins.argval, ins.offset)))
            elif receiver is not _UNKNOWN and (ins.argval in _ATTRIBUTE_SLOTS or _is_template_format(receiver,
                                                                                              ins.argval)):
                # `object.__getattribute__(obj, name)`, `"{0.x}".format(obj)`: which of the two pushed values is the
                # function depends on the receiver, so both name it (the call site checks what it finds when it runs)
                stack.items.extend([Attr(receiver, ins.argval)] * pushes)
            elif receiver is not _UNKNOWN:  # a method: the call names it, whichever of the two values it is
                stack.items.extend([Method(receiver, ins.argval)] * pushes)
            else:
                stack.items.extend([_UNKNOWN] * pushes)
        elif op == "STORE_ATTR":  # TOS.name = TOS1
            _, receiver = stack.pop(2)
            if receiver is not _UNKNOWN:
                sites[ins.offset] = AttrWrite(receiver, ins.argval)
        elif op == "DELETE_ATTR":  # del TOS.name
            (receiver,) = stack.pop()
            if receiver is not _UNKNOWN:
                sites[ins.offset] = AttrWrite(receiver, ins.argval, deletes=True)
        elif op in ("STORE_GLOBAL", "DELETE_GLOBAL"):
            if op == "STORE_GLOBAL":
                stack.pop()
            sites[ins.offset] = GlobalWrite(ins.argval, deletes=op == "DELETE_GLOBAL")
        elif op == "BINARY_SUBSCR":
            container, key = stack.pop(2)
            stack.items.append(Item(container, key) if container is not _UNKNOWN and key is not _UNKNOWN
                               else _UNKNOWN)
        elif op in ("STORE_SUBSCR", "DELETE_SUBSCR"):  # TOS1[TOS] = TOS2, del TOS1[TOS]
            container = stack.peek(2)
            if container is not _UNKNOWN:
                sites[ins.offset] = ItemWrite(container)
            stack.pop(3 if op == "STORE_SUBSCR" else 2)
        elif op == "BINARY_OP" and ins.argrepr.endswith("=") and stack.peek(2) is not _UNKNOWN:  # TOS1 += TOS
            sites[ins.offset] = ItemWrite(stack.peek(2))
            stack.pop(2)
            stack.items.append(_UNKNOWN)
        elif op == "COPY":
            stack.items.append(stack.peek(ins.arg))
        elif op == "POP_TOP":
            stack.pop()
        elif op == "PUSH_NULL":
            stack.items.append(_UNKNOWN)
        elif op in _NO_STACK_EFFECT:
            keywords = keywords or op == "KW_NAMES"
        else:
            if op == _CALL:
                callee = _callee(ins.arg, stack)
                if not keywords:
                    _note_call(ins, stack, sites)
            keywords = False
            stack.forget(dis.stack_effect(ins.opcode, ins.arg, jump=False) if ins.opcode >= dis.HAVE_ARGUMENT
                         else dis.stack_effect(ins.opcode, jump=False))
            if op == "CALL" and stack.items:  # the call's result: known if the callee's return is caught
                producers[ins.offset] = callee
                stack.items[-1] = Result(ins.offset)
            if op != _CALL:
                callee = _UNKNOWN
    return _with_captures(sites, producers)


def _callee(nargs: int, stack: _Stack) -> Source | None:
    """The callable of a call of `nargs` arguments (it sits below or above the NULL, by Python version)."""
    function = stack.peek(nargs + 1)
    return function if function is not _UNKNOWN else stack.peek(nargs + 2)


def _with_captures(sites: dict[int, Read], producers: dict[int, Source | None]) -> dict[int, Read]:
    """Adds a Capture before each call or attribute load whose value a site reads from (a `Result`, an `Attr`
    only a Python getter can answer)."""
    wanted: set[int] = set()
    for site in sites.values():
        for source in _sources(site):
            _produced(source, wanted)
    for offset in wanted:
        producer = producers.get(offset)
        if producer is _UNKNOWN:  # a call of what no site names
            continue
        getter = producer if type(producer) is Attr else None
        sites[offset] = Capture(None if getter else producer, getter, sites.get(offset))
    return sites


def _sources(site: Read) -> tuple[Source | None, ...]:
    kind = type(site)
    if kind is AttrRead or kind is AttrWrite:
        return (site.receiver,)
    if kind is AttrCall:
        return site.function, site.receiver, site.name
    if kind is CallRead:
        return site.function, *site.arguments
    if kind is ItemWrite:
        return (site.container,)
    return ()


def _produced(source: Source | None, wanted: set[int]) -> None:
    """The offsets of the calls and attribute loads `source` is made from."""
    kind = type(source)
    if kind is Result:
        wanted.add(source.offset)
    elif kind is Attr:
        if source.offset >= 0:
            wanted.add(source.offset)
        _produced(source.base, wanted)
    elif kind is Item:
        _produced(source.base, wanted)
        _produced(source.key, wanted)
    elif kind is Method:
        _produced(source.base, wanted)


def _note_call(ins: dis.Instruction, stack: _Stack, sites: dict[int, Read]) -> None:
    """`getattr`, `hasattr`, `vars`, `setattr` or `delattr` of a nameable object (and name) is a read or write
    site; a call that may read its nameable arguments in C code is a CallRead."""
    nargs = ins.arg
    for depth in (nargs + 1, nargs + 2):  # the callable sits below or above the NULL, by Python version
        function = stack.peek(depth)
        if isinstance(function, Global) and nargs in _ATTRIBUTE_BUILTINS.get(function.name, ()) \
                or isinstance(function, Attr) and nargs in _ATTRIBUTE_SLOTS.get(function.name, ()):
            receiver = stack.peek(nargs)
            name = stack.peek(nargs - 1) if nargs > 1 else Const("__dict__")  # `vars(obj)` is `obj.__dict__`
            if receiver is not _UNKNOWN and name is not _UNKNOWN:
                sites[ins.offset] = AttrCall(function, receiver, name)
            return
        if _may_read_in_c(function, nargs):
            arguments = tuple(stack.peek(nargs - i) for i in range(nargs))
            if any(argument is not _UNKNOWN for argument in arguments):
                sites[ins.offset] = CallRead(function, arguments)
            return


def _is_template_format(receiver: Source | None, name: str) -> bool:
    """`receiver.name` is the `format` of a string constant with fields (`"{0.lr:.3g}".format`)."""
    return name == "format" and isinstance(receiver, Const) and type(receiver.value) is str and "{" in receiver.value


def _may_read_in_c(function: Source | None, nargs: int) -> bool:
    """A call of `function` with `nargs` positional arguments may be one of CallRead's: a one-argument call of a
    named value (an attrgetter), a class builtin, or a string constant's `format`."""
    if isinstance(function, Global) and function.name in _CLASS_BUILTINS:
        return _CLASS_BUILTINS[function.name] == nargs
    if isinstance(function, Attr) and _is_template_format(function.base, function.name):
        return True
    return nargs == 1 and function is not _UNKNOWN and type(function) is not Method
