"""What dynamo traces in place of transformers' SDPA attention function in kimi_cg frames.

NOTE [attention substitutes]
transformers' vision towers (Kimi-K2.5, Qwen2-VL, Qwen2.5-VL, GLM-4V, ...) run attention in their
default ``sdpa`` path one image at a time: ``torch.split(q, lengths.tolist())`` and a call of
``transformers.integrations.sdpa_attention.sdpa_attention_forward`` per piece. With the lengths as
grid values (unbacked SymInts), dynamo cannot trace that function: it branches on
``q_length > 1`` and SDPA's shape checks guard on the piece's length, so the frame breaks or fails
and the tower runs unlifted. The eager path's per-piece attention (matmul, softmax, matmul) traces,
and SegmentAttentionPass turns the loop into one varlen call (canonicalize/segment_loop.py).

So while dynamo traces a kimi_cg frame, a call of ``sdpa_attention_forward`` that is plain attention
(no mask, no dropout, ``is_causal=False``, no GQA, no extra options) is traced as that same attention
written with matmul and softmax: the same function of q, k, v (softmax in fp32, as the eager path),
which the loop rewrite recognises. Every other call, and every call in a frame dynamo traces for
another backend, traces transformers' own code (an identical copy of the function: dynamo records the
same graph as without kimi_cg). Eager execution never changes: dynamo's substitution only applies
while it inlines a call.

This registers one dynamo polyfill (``torch._dynamo.substitute_in_graph``) for that one function,
process-wide, the first time dynamo traces a kimi_cg frame after transformers is imported.

NOTE [flash path]
The split loop costs dynamo a trace per number of segments: the pieces' lengths are a Python list, so
every layer is unrolled over them, with fake-tensor and sympy work per piece and layer (a tiny 32-layer
Qwen2-VL tower: 7 s for one image, minutes for two). The same towers have a second branch, taken when
``transformers.utils.generic.is_flash_attention_requested(config)`` is true: one attention call over
all packed rows with ``cu_seq_lens_q`` / ``max_length_q`` (the flash-attn varlen convention), which
transformers defines to compute the same attention as the split loop. So in a kimi_cg frame:

- ``is_flash_attention_requested(config)`` is traced as true when the config asks for ``"sdpa"``, is
  a vision config (it has ``patch_size``) and transformers' ``"sdpa"`` attention function is the one
  substituted here (so the branch's attention call reaches the code below);
- the SDPA function then receives the packed q, k, v and traces ``torch.ops.kimi_cg.varlen_attention``
  over ``cu_seq_lens_q`` (kimi_cg's varlen vocabulary: segment padding, bounds, kernels), when the
  call is one it computes exactly: batch 1, no mask, no dropout, not causal, the same boundaries for
  keys as for queries, no other option (options that are None, e.g. a ``cache=None`` a decorator
  forwards, change nothing). Grouped key/value heads are repeated to the query heads first
  (``repeat_interleave`` on the head dim: query head h reads key head h // groups, as transformers'
  ``repeat_kv``). Any other SDPA call in such a trace (a flash
  branch that expects flash-attn to derive the segments from ``position_ids``, a mask, keys of other
  length, a module of another config), and a graph of such a trace that computes a softmax or SDPA
  besides (an attention function other than transformers' SDPA may have ignored ``cu_seq_lens_q``;
  checked by the backend, ``check_flash_path_graph``), is refused: the trace fails, that call runs
  eagerly, and the frame's code is traced without the flash branch from the next call on
  (``flash_path_refusals``; NOTE [dynamo settings], step 3).

Counted: ``flash_path_traces`` (traces that took the branch). The eager path, other backends, configs
asking for ``"eager"`` (its attention function is the model's own and ignores ``cu_seq_lens_q``), and
text configs are never affected.
"""

from __future__ import annotations

import functools
import logging
import sys
import types

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

_SDPA_MODULE = "transformers.integrations.sdpa_attention"
_installed: dict[str, object] = {}
# Keyword arguments the SDPA function ignores (transformers forwards the model call's kwargs), and
# those that change the attention unless None. Any other keyword: NOTE [attention keywords].
_IGNORED_KWARGS = {"output_attentions", "output_hidden_states", "return_dict", "use_cache", "position_ids",
                   "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}
_NONE_KWARGS = {"softcap", "position_bias", "sliding_window", "s_aux", "cache", "past_key_values"}
# NOTE [attention keywords]
# Towers forward their call's keyword arguments down to the attention function (LFM3-VL passes
# ``grid_thw``, and ``cache=None`` from a deprecation decorator). transformers' SDPA function and its
# flash path read a known set of keywords (their signatures, and the FlashAttentionKwargs they
# document) and ignore the rest. So a keyword neither reads is ignored here too, and one they read is
# accepted only as None where None is its default. The set is read from the installed transformers
# when the substitutes are installed; where it cannot be read, every keyword not listed above makes
# the call one kimi_cg does not take (traced as written, or the flash branch refused).
_ATTENTION_FUNCTIONS = (("transformers.integrations.sdpa_attention", "sdpa_attention_forward"),
                        ("transformers.integrations.flash_attention", "flash_attention_forward"),
                        ("transformers.modeling_flash_attention_utils", "_flash_attention_forward"),
                        ("transformers.modeling_flash_attention_utils", "_process_flash_attention_kwargs"))
_attention_keywords: dict | None = None  # name -> its default; set by install()


def _read_attention_keywords() -> dict | None:
    """NOTE [attention keywords]: the keywords transformers' attention functions read, or None."""
    import importlib
    import inspect

    keywords = {}
    try:
        for module_name, function_name in _ATTENTION_FUNCTIONS:
            function = getattr(importlib.import_module(module_name), function_name)
            for name, parameter in inspect.signature(function).parameters.items():
                if parameter.kind not in (parameter.VAR_KEYWORD, parameter.VAR_POSITIONAL):
                    keywords[name] = parameter.default  # (parameter.empty where it has none: never None)
        documented = getattr(importlib.import_module(_ATTENTION_FUNCTIONS[2][0]), "FlashAttentionKwargs")
        for name in getattr(documented, "__annotations__", {}):
            keywords.setdefault(name, None)
    except Exception as error:  # noqa: BLE001 - another transformers layout: only the lists above hold
        logger.info("kimi_cg: transformers' attention keywords not read (%s)", error)
        return None
    return keywords


def _harmless(name: str, argument) -> bool:
    """Whether a keyword argument leaves the attention as kimi_cg computes it (NOTE [attention keywords])."""
    if name in _IGNORED_KWARGS:
        return True
    if name in _NONE_KWARGS:
        return argument is None
    keywords = _attention_keywords
    if keywords is None:
        return False
    if name not in keywords:
        return True
    return argument is None and keywords[name] is None


_GENERIC_MODULE = "transformers.utils.generic"
_INTERFACES_MODULE = "transformers.modeling_utils"


class FlashPathRefused(RuntimeError):
    """A call kimi_cg cannot compute exactly on transformers' flash branch (NOTE [flash path])."""


@torch._dynamo.assume_constant_result
def _tracing_for_kimi_cg() -> bool:
    from kimi_cg import dynamo_settings

    return dynamo_settings.active()


@torch._dynamo.assume_constant_result
def _flash_path_allowed() -> bool:
    """Whether this trace may take transformers' flash branch (its frame was never refused)."""
    from kimi_cg import dynamo_settings

    return dynamo_settings.flash_path_allowed()


@torch._dynamo.assume_constant_result
def _sdpa_interface_is_substituted() -> bool:
    """Whether transformers' attention registry maps "sdpa" to the function substituted here."""
    interfaces = getattr(sys.modules.get(_INTERFACES_MODULE), "ALL_ATTENTION_FUNCTIONS", None)
    try:
        return interfaces is not None and interfaces["sdpa"] is _installed.get(_SDPA_MODULE)
    except (KeyError, TypeError):
        return False


@torch._dynamo.assume_constant_result
def _note_flash_path() -> bool:
    from kimi_cg import dynamo_settings

    dynamo_settings.note_flash_path()
    return True


@torch._dynamo.assume_constant_result
def _flash_path_taken() -> bool:
    """Whether this trace has taken transformers' flash branch (NOTE [flash path])."""
    from kimi_cg import dynamo_settings

    return dynamo_settings.flash_path_taken()


@torch._dynamo.assume_constant_result
def _refuse_flash_path(reason: str) -> bool:
    raise FlashPathRefused(f"kimi_cg cannot trace this call on transformers' flash branch: {reason}")


def _takes_flash_path(config) -> bool:
    """NOTE [flash path]: traced by dynamo (every test reads constants)."""
    return (config is not None and getattr(config, "_attn_implementation", None) == "sdpa"
            and hasattr(config, "patch_size") and _sdpa_interface_is_substituted())


def _plain(module, query, key, value, attention_mask, dropout, is_causal, kwargs) -> bool:
    """Whether this call is attention without mask, dropout, causality, GQA or options."""
    if attention_mask is not None or is_causal is not False or not isinstance(dropout, (int, float)) or dropout != 0:
        return False
    if getattr(module, "num_key_value_groups", 1) != 1:
        return False
    for name, argument in kwargs.items():
        if not _harmless(name, argument):
            return False
    # Heads and head dims are static; sequence lengths may be grid values (never compared here).
    return query.dim() == key.dim() == value.dim() == 4 and query.shape[1] == key.shape[1] == value.shape[1] and (
        query.shape[-1] == key.shape[-1])


def _matmul_softmax_attention(query, key, value, scaling):
    """[B, H, n, D] attention as the eager path writes it; returns ([B, n, H, D], None) like SDPA's path."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    weights = torch.matmul(query, key.transpose(2, 3)) * scale
    weights = F.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), None


def _packed_attention(module, query, key, value, attention_mask, dropout, is_causal, scaling, kwargs):
    """NOTE [flash path]: the flash branch's packed call as kimi_cg's varlen op, or a refusal.
    query, key, value: [1, H, L, D]; returns ([1, L, H, D], None) as transformers' attention functions."""
    if not _takes_flash_path(getattr(module, "config", None)):
        return _refuse_flash_path("an attention whose config does not ask for sdpa on a vision config")
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if cu_seqlens is None:
        return _refuse_flash_path("no cu_seq_lens_q (segments from position_ids or a mask)")
    if kwargs.get("cu_seq_lens_k") is not cu_seqlens:
        return _refuse_flash_path("cu_seq_lens_k is not cu_seq_lens_q")
    if attention_mask is not None:
        return _refuse_flash_path("an attention mask")
    if not isinstance(dropout, (int, float)) or dropout != 0:
        return _refuse_flash_path("dropout")
    if (is_causal if is_causal is not None else getattr(module, "is_causal", True)) is not False:
        return _refuse_flash_path("causal attention")
    for name, argument in kwargs.items():
        if not _harmless(name, argument):
            return _refuse_flash_path(f"the option {name}")
    groups = getattr(module, "num_key_value_groups", 1)
    if not (isinstance(groups, int) and groups >= 1 and query.dim() == key.dim() == value.dim() == 4
            and query.shape[0] == 1 and key.shape == value.shape
            and key.shape[1] * groups == query.shape[1] and key.shape[2:] == query.shape[2:]):
        return _refuse_flash_path("q, k, v not of one [1, H, L, D] shape (k, v: H / num_key_value_groups heads)")
    if groups > 1:
        # Grouped key/value heads: query head h reads key/value head h // groups, as transformers'
        # repeat_kv lays them out for its eager and sdpa paths; the varlen op takes one head count.
        key, value = (tensor.repeat_interleave(groups, dim=1) for tensor in (key, value))
    q, k, v = (tensor[0].transpose(0, 1) for tensor in (query, key, value))
    max_seqlen = kwargs.get("max_length_q")
    if max_seqlen is None:
        max_seqlen = q.shape[0]  # any upper bound gives the same result (NOTE [max_seqlen])
    return torch.ops.kimi_cg.varlen_attention(q, k, v, cu_seqlens, max_seqlen, scaling).unsqueeze(0), None


# Attention written out in a graph: on the flash branch every attention should be kimi_cg's varlen op.
_UNPACKED_ATTENTION = ("softmax", "scaled_dot_product")


def check_flash_path_graph(gm: torch.fx.GraphModule) -> None:
    """NOTE [flash path]: a graph traced on the flash branch must hold no attention other than kimi_cg's
    varlen op. A softmax or an SDPA call there may be an attention that ignores ``cu_seq_lens_q`` (a
    function other than transformers' SDPA took the branch's call, or a check of another config flipped
    the branch): refused, so the frame is traced on its sdpa branch."""
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
        if any(word in str(name) for word in _UNPACKED_ATTENTION):
            raise FlashPathRefused(f"kimi_cg cannot trace this frame on transformers' flash branch: its graph "
                                   f"computes {name} besides the packed attention ({node.format_node()[:200]})")


def _traceable_copy(function):
    """The same function under another identity: what a substitute calls to trace the original as written."""
    copy = types.FunctionType(function.__code__, function.__globals__, function.__name__, function.__defaults__,
                              function.__closure__)
    copy.__kwdefaults__ = function.__kwdefaults__
    return copy


def _substitute(module_name: str, original, replacement) -> None:
    try:
        torch._dynamo.substitute_in_graph(original, skip_signature_check=True)(replacement)
    except (TypeError, ValueError) as error:  # another library registered one first, or a torch without it
        logger.info("kimi_cg: %s.%s is traced as written (%s)", module_name, original.__name__, error)
    _installed[module_name] = original


def install() -> None:
    """Register the substitutes (NOTE [attention substitutes], NOTE [flash path]) once transformers is
    loaded; idempotent (a reloaded module keeps what it had)."""
    _install_sdpa(getattr(sys.modules.get(_SDPA_MODULE), "sdpa_attention_forward", None))
    _install_flash_request(getattr(sys.modules.get(_GENERIC_MODULE), "is_flash_attention_requested", None))


def _install_sdpa(original) -> None:
    global _attention_keywords
    if original is None or _SDPA_MODULE in _installed:
        return
    _attention_keywords = _read_attention_keywords()
    copy = _traceable_copy(original)

    @functools.wraps(original)
    def sdpa_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                               **kwargs):
        if _tracing_for_kimi_cg():
            if _flash_path_taken():  # every SDPA call of a trace on the flash branch is a packed one, or refused
                return _packed_attention(module, query, key, value, attention_mask, dropout, is_causal, scaling, kwargs)
            if _plain(module, query, key, value, attention_mask, dropout, is_causal, kwargs):
                return _matmul_softmax_attention(query, key, value, scaling)
        return copy(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal,
                    **kwargs)

    _substitute(_SDPA_MODULE, original, sdpa_attention_forward)


def _install_flash_request(original) -> None:
    """NOTE [flash path]: ``is_flash_attention_requested`` is true in kimi_cg frames for vision configs
    on "sdpa" (only once the SDPA substitute is in place); elsewhere it is traced as written."""
    if original is None or _GENERIC_MODULE in _installed or _SDPA_MODULE not in _installed:
        return
    copy = _traceable_copy(original)

    @functools.wraps(original)
    def is_flash_attention_requested(config=None, requested_attention_implementation=None, version=None):
        if (_tracing_for_kimi_cg() and requested_attention_implementation is None and version is None
                and _flash_path_allowed() and _takes_flash_path(config)):
            return _note_flash_path()
        return copy(config, requested_attention_implementation, version)

    _substitute(_GENERIC_MODULE, original, is_flash_attention_requested)
