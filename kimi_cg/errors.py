"""Errors kimi_cg raises, split by who must act: the model author or the caller."""


class KimiCGError(RuntimeError):
    """Base class of every kimi_cg error."""


class UnsupportedGraphError(KimiCGError):
    """A captured graph uses a pattern the compiler cannot lift or canonicalise (a model-side fix)."""


class InvalidInputError(KimiCGError, ValueError):
    """A call's inputs are invalid (a grid the model cannot process); names the offending item."""
