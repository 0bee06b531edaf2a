"""Errors raised while acquiring a program; each names the user's source line."""

from __future__ import annotations

from fulmen.core.source import SourceLocation


class FulmenError(RuntimeError):
    """Base class of fulmen's errors."""


class TraceError(FulmenError):
    """An error found while acquiring the user's program, located at the user's source line."""

    def __init__(self, message: str, location: SourceLocation | None):
        self.location = location
        where = f"\n  at {location.describe()}" if location is not None else ""
        super().__init__(f"{message}{where}")


class DataDependentError(TraceError):
    """The program reads tensor values (a branch, `.item()`, `.tolist()`), which are unknown while tracing."""


class UnsupportedOpError(TraceError):
    """The program calls a torch operation fulmen has no symbol for."""


class ExecutorContractError(TraceError):
    """An executor's callable broke what its symbol declares (outputs other than its like=/meta= gives, an argument
    modified in place, an argument's memory returned; found on the call's first run), or a user's executor rule
    misbehaved (a checker failing or answering other than a bool, a grad_transform putting no grad for an input that
    requires one); located at the user's line."""


class CacheLimitError(FulmenError):
    """A call needed a new trace past `JitOptions.cache_limit` with `cache_limit_action="error"`."""


class CacheLimitWarning(UserWarning):
    """A jitted callable reached `JitOptions.cache_limit`: calls that miss the cache run eagerly from now on."""
