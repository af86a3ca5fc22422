"""Fallbacks: what kimi_cg cannot lift runs the captured graph unchanged (NOTE [errors by who must act]).

``kimi_cg.fallbacks`` counts them by reason (``"in-place write to a graph input"``,
``"grid-dependent value reaches a device op"``, ...); each reason is warned once per source location.
"""

from __future__ import annotations

import collections
import logging

logger = logging.getLogger(__name__)

fallbacks: collections.Counter[str] = collections.Counter()
_warned: set[tuple[str, str]] = set()


def record_fallback(reason: str, where: str, detail: str, what: str) -> None:
    """Count one fallback; warn the first time this reason is seen at this source location.

    ``what`` says what runs instead ("this graph runs unlifted", "this call ran the captured graph")."""
    fallbacks[reason] += 1
    if (reason, where) in _warned:
        logger.debug("kimi_cg: %s (%s): %s", what, reason, detail)
        return
    _warned.add((reason, where))
    logger.warning(
        "kimi_cg: %s (%s) at %s: %s. Results stay correct; options={'strict': True} turns this into an error.",
        what, reason, where, detail,
    )


def clear() -> None:
    fallbacks.clear()
    _warned.clear()
