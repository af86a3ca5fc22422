"""Custom ops the device program calls (registered with torch.library on import)."""

from kimi_cg.ops.varlen_attention import varlen_attention, varlen_attention_reference
from kimi_cg.ops.merge_gather import merge_gather, merge_gather_layernorm
from kimi_cg.ops.resize import bicubic_resize
from kimi_cg.ops.linear_gelu import linear_gelu_tanh
from kimi_cg.ops.table_gather import table_gather

__all__ = ["varlen_attention", "varlen_attention_reference"]
__all__ += ["merge_gather", "merge_gather_layernorm"]
__all__ += ["bicubic_resize"]
__all__ += ["linear_gelu_tanh"]
__all__ += ["table_gather"]
