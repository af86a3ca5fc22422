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
# those that change the attention unless None. Any other keyword: the call is traced as written.
_IGNORED_KWARGS = {"output_attentions", "output_hidden_states", "return_dict", "use_cache", "position_ids",
                   "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}
_NONE_KWARGS = {"softcap", "position_bias", "sliding_window", "s_aux"}


@torch._dynamo.assume_constant_result
def _tracing_for_kimi_cg() -> bool:
    from kimi_cg import dynamo_settings

    return dynamo_settings.active()


def _plain(module, query, key, value, attention_mask, dropout, is_causal, kwargs) -> bool:
    """Whether this call is attention without mask, dropout, causality, GQA or options."""
    if attention_mask is not None or is_causal is not False or not isinstance(dropout, (int, float)) or dropout != 0:
        return False
    if getattr(module, "num_key_value_groups", 1) != 1:
        return False
    for name, argument in kwargs.items():
        if name not in _IGNORED_KWARGS and not (name in _NONE_KWARGS and argument is None):
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


def install() -> None:
    """Register the substitute for transformers' SDPA attention when transformers is loaded; idempotent."""
    module = sys.modules.get(_SDPA_MODULE)
    original = getattr(module, "sdpa_attention_forward", None)
    if original is None or _SDPA_MODULE in _installed:  # once (a reloaded module keeps what it had)
        return
    copy = types.FunctionType(original.__code__, original.__globals__, original.__name__, original.__defaults__,
                              original.__closure__)
    copy.__kwdefaults__ = original.__kwdefaults__

    @functools.wraps(original)
    def sdpa_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                               **kwargs):
        if _tracing_for_kimi_cg() and _plain(module, query, key, value, attention_mask, dropout, is_causal, kwargs):
            return _matmul_softmax_attention(query, key, value, scaling)
        return copy(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal,
                    **kwargs)

    try:
        torch._dynamo.substitute_in_graph(original, skip_signature_check=True)(sdpa_attention_forward)
    except (TypeError, ValueError) as error:  # another library registered one first, or a torch without it
        logger.info("kimi_cg: transformers' SDPA attention is traced as written (%s)", error)
    _installed[_SDPA_MODULE] = original
