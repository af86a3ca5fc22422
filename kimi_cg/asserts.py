"""Asserts on grid values whose message is an expression, traced without a graph break.

NOTE [asserts with a computed message]
Dynamo turns ``assert cond`` and ``assert cond, "text"`` on a tensor into ``torch._assert_async`` in
the graph (``rewrite_assert_with_torch_assert``): no break. It recognises the assert by its bytecode,
and only those two forms: a message that is an expression, as Kimi-VL's remote code writes in every
attention layer (``assert cu_seqlens[-1] == q.shape[0], (cu_seqlens[-1], q.shape[0])``), is a branch
on tensor data and breaks the graph there: 27 pieces per call for its flash path (a host pass and a
replay each; 2026-12-05 on an H100 that made the tower no faster than eager).

While dynamo traces a kimi_cg frame (``dynamo_settings.active()``), ``install()`` makes dynamo take
a jump as an assert when the side it takes on a false condition leads (through ``POP_TOP`` and
forward jumps only) into an assert's failing block: ``LOAD_ASSERTION_ERROR``, the message's
instructions (no store, no jump out of them) and ``RAISE_VARARGS``. Two jumps lead there: the
assert's own ``POP_JUMP_IF_TRUE`` (its fall-through is the failing block: dynamo's detector is
extended, and dynamo emits the check) and, in ``assert a == b == c, msg`` or ``assert a and b, msg``,
the ``POP_JUMP_IF_FALSE`` of each earlier link (its target is the failing block: the check is emitted
here and the trace goes on as if the link held).

Each is accepted only when the condition cannot reach the device program as an assert on data that
could fail there: a condition computed from integer tensors only (the grid, ``cu_seqlens``; sizes
are symbols, not data), which kimi_cg's host program evaluates on the host when those come from the
grid (an integer tensor the device program holds keeps the check on the device, as dynamo's own
rewrite of ``assert cond, "text"`` does), or a condition on sizes (a runtime check on the host). A
condition on activations (``assert torch.isfinite(x).all(), f"..."``) keeps its graph break: as
``_assert_async`` on a GPU its failure would be a device-side assert, which ends the process's CUDA
context, where eager raises an ``AssertionError``.

What the rewrite changes: a passing assert behaves as in eager (the message was never built: eager
builds it only on failure); a failing one raises kimi_cg's ``InvalidInputError`` (a RuntimeError whose
text names the assert's source line) instead of an ``AssertionError`` carrying the computed message.
Counted in ``counters["asserts_with_computed_messages"]``.
"""

from __future__ import annotations

import dis
import importlib
import linecache
import logging
import operator
import sys

import torch

from kimi_cg.counters import counters

logger = logging.getLogger(__name__)

_MESSAGE_BLOCK_LIMIT = 200  # instructions; a longer failing branch is left to dynamo
_ANCESTRY_LIMIT = 20000  # graph nodes looked at for one condition


def install() -> None:
    """Wrap dynamo's assert detector and its jump-if-false handlers (idempotent; a torch without
    them is left alone)."""
    module = importlib.import_module("torch._dynamo.symbolic_convert")
    original = getattr(module, "_detect_and_normalize_assert_statement", None)
    if original is not None and not hasattr(original, "__kimi_cg_original__"):
        module._detect_and_normalize_assert_statement = _detector(original)
    base = getattr(module, "InstructionTranslatorBase", None)
    if base is None:
        return
    for name in ("POP_JUMP_IF_FALSE", "POP_JUMP_FORWARD_IF_FALSE"):
        handler = getattr(base, name, None)
        if handler is None or hasattr(handler, "__kimi_cg_original__"):
            continue
        patched = _jump_if_false(handler)
        setattr(base, name, patched)  # what translator classes made later look up
        # Each translator class dispatches through a table of handlers built when it was made.
        classes, opcode = [base], dis.opmap.get(name)
        while classes:
            cls = classes.pop()
            classes.extend(cls.__subclasses__())
            table = cls.__dict__.get("dispatch_table")
            if opcode is not None and isinstance(table, list) and table[opcode] is handler:
                table[opcode] = patched


def _detector(original):
    def detect_assert(self, truth_fn, push) -> bool:
        if original(self, truth_fn, push):
            return True
        if truth_fn is not operator.truth or push or not _tracing_for_kimi_cg():
            return False
        try:
            # The condition: dynamo's jump handler (this detector's caller) popped it into its local
            # ``value`` before asking; a torch that names it otherwise gets dynamo's own handling.
            condition = sys._getframe(1).f_locals.get("value")
            message = _assert_message(self, self.instruction_pointer, condition)
        except Exception:  # noqa: BLE001 - an unexpected dynamo internal: dynamo's own handling (a graph break)
            logger.debug("kimi_cg: assert detection failed; dynamo handles this jump", exc_info=True)
            return False
        if message is None:
            return False
        counters["asserts_with_computed_messages"] += 1
        self.push(_constant(self, message))
        return True

    detect_assert.__kimi_cg_original__ = original
    return detect_assert


def _jump_if_false(original):
    def jump_if_false(self, inst) -> None:
        message = None
        if _tracing_for_kimi_cg() and self.stack:
            try:
                condition = self.stack[-1]
                if condition.is_tensor():
                    message = _assert_message(self, self.indexof.get(inst.target), condition)
            except Exception:  # noqa: BLE001 - as in detect_assert
                logger.debug("kimi_cg: assert detection failed; dynamo handles this jump", exc_info=True)
                message = None
        if message is None:
            return original(self, inst)
        from torch._dynamo.utils import proxy_args_kwargs

        condition = self.pop()
        counters["asserts_with_computed_messages"] += 1
        self.output.create_proxy("call_function", torch._assert_async,
                                 *proxy_args_kwargs((condition, _constant(self, message)), {}))
        return None  # the link holds: on to the next instruction, as when the condition is true

    jump_if_false.__kimi_cg_original__ = original
    return jump_if_false


def _tracing_for_kimi_cg() -> bool:
    from kimi_cg import dynamo_settings

    return dynamo_settings.active() and sys.flags.optimize == 0


def _constant(tx, value):
    from torch._dynamo.variables import VariableTracker

    return VariableTracker.build(tx, value)


def _assert_message(tx, failing, condition) -> str | None:
    """The message for ``_assert_async`` when the instructions from index ``failing`` lead into an
    assert's failing block and ``condition`` can be checked on the host; None otherwise."""
    instructions = tx.instructions
    index, steps = failing, 0
    while isinstance(index, int) and index < len(instructions) and steps < 8:
        name = instructions[index].opname
        if name in ("POP_TOP", "NOP"):
            index += 1
        elif name == "JUMP_FORWARD":
            index = tx.indexof.get(instructions[index].target)
        else:
            break
        steps += 1
    if not isinstance(index, int) or index >= len(instructions) or instructions[index].opname != "LOAD_ASSERTION_ERROR":
        return None
    start = index
    end = next((i for i in range(start + 1, min(start + _MESSAGE_BLOCK_LIMIT, len(instructions)))
                if instructions[i].opname == "RAISE_VARARGS"), None)
    if end is None:
        return None
    for instruction in instructions[start + 1:end]:
        if instruction.opname.startswith(("STORE_", "DELETE_", "RETURN", "YIELD", "IMPORT", "SETUP_", "BEFORE_")):
            return None
        target = getattr(instruction, "target", None)
        if target is not None and not start < tx.indexof.get(target, -1) < end:
            return None  # the message's own branches (a conditional expression) stay inside it
    if not _checked_on_the_host(condition):
        return None
    jump = tx.current_instruction
    line = getattr(getattr(jump, "positions", None), "lineno", None) or getattr(jump, "starts_line", None)
    filename = tx.f_code.co_filename
    source = linecache.getline(filename, line).strip() if isinstance(line, int) else ""
    return f"assertion failed at {filename}:{line}: {source}" if source else "assertion failed"


def _checked_on_the_host(value) -> bool:
    from torch._dynamo.variables import SymNodeVariable

    if value is None:
        return False
    if value.is_python_constant() or isinstance(value, SymNodeVariable):
        return True  # a constant, or a condition on sizes: dynamo's runtime check, on the host
    if not value.is_tensor():
        return False
    seen, stack = set(), [value.as_proxy().node]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if len(seen) > _ANCESTRY_LIMIT:
            return False
        example = node.meta.get("example_value")
        if not isinstance(example, torch.Tensor):
            continue  # a size or other scalar: a symbol, not data the condition reads
        if example.is_floating_point() or example.is_complex():
            return False
        stack.extend(node.all_input_nodes)
    return True
