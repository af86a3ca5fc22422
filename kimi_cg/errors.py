"""Errors kimi_cg raises, split by who must act: the model author, the caller, or kimi_cg itself.

NOTE [errors by who must act]
- ``InvalidInputError``: the call's inputs violate a check the model itself enforces. kimi_cg raises
  it only after running the captured graph unchanged on the same inputs and seeing it fail too, so
  eager would have raised as well; the error is an instance of both ``InvalidInputError`` and the
  class the captured graph raised (``except AssertionError`` written for eager keeps working). One
  difference from eager remains: where dynamo put a runtime assertion on a data-dependent size into
  the captured graph, that check fails before the op eager would fail in, so the error is an
  InvalidInputError and a RuntimeError even where eager raised, say, an IndexError.
- ``UnsupportedGraphError``: kimi_cg cannot lift a graph or a call (a compiler limit, or a model
  pattern it does not know). By default this is never raised: the graph or the call runs the
  captured graph unchanged (correct, with its host syncs), counted in ``kimi_cg.fallbacks`` by
  reason and warned once per source location. With ``options={"strict": True}`` it is raised.
"""

from __future__ import annotations


class KimiCGError(RuntimeError):
    """Base class of every kimi_cg error."""


class UnsupportedGraphError(KimiCGError):
    """A captured graph uses a pattern the compiler cannot lift or canonicalise (a model-side fix).

    ``reason`` is a short, stable name of the limit (the key of ``kimi_cg.fallbacks``); ``where`` the
    model's source line, when known."""

    def __init__(self, message: str, reason: str = "unsupported pattern", where: str | None = None):
        super().__init__(message)
        self.reason = reason
        self.where = where


class InvalidInputError(KimiCGError, ValueError):
    """A call's inputs are invalid (a grid the model cannot process); names the offending item."""

    @classmethod
    def like(cls, message: str, eager_error: BaseException) -> "InvalidInputError":
        """An InvalidInputError that is also an instance of ``eager_error``'s class."""
        return _invalid_input_class(type(eager_error))(message)


_INVALID_INPUT_CLASSES: dict[type, type] = {}


def _invalid_input_class(eager_class: type) -> type:
    if issubclass(eager_class, InvalidInputError) or not issubclass(eager_class, Exception):
        return InvalidInputError
    found = _INVALID_INPUT_CLASSES.get(eager_class)
    if found is None:
        try:
            found = type(f"InvalidInputError[{eager_class.__name__}]", (InvalidInputError, eager_class), {})
        except TypeError:  # an exception class with its own instance layout (OSError, ...)
            found = InvalidInputError
        _INVALID_INPUT_CLASSES[eager_class] = found
    return found
