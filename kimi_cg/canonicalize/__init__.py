"""Canonicalisation passes: one pass per module, each a ``GraphPass`` applied to the dynamo graph.

Invariants every pass keeps (see docs/design.md):
- the graph stays functional apart from the in-place ops the model itself wrote;
- after all passes, no node that depends on pixel values has an output shape with a grid-dependent
  (unbacked) symbol, and no such node takes a grid-dependent integer argument;
- after a pass, ``GraphPass`` lints the graph and recompiles the module when the pass changed the graph.
"""

from kimi_cg.canonicalize.base import GraphPass
from kimi_cg.canonicalize.compile_regions import InlineRegionsPass, has_regions
from kimi_cg.canonicalize.embedding_reads import EmbeddingReadsPass
from kimi_cg.canonicalize.fuse_gather_layernorm import FuseGatherLayerNormPass
from kimi_cg.canonicalize.gather_reduce import GatherReducePass
from kimi_cg.canonicalize.linear_gelu import LinearGeluPass
from kimi_cg.canonicalize.merge_gather import MergeGatherPass
from kimi_cg.canonicalize.patch_conv import PatchConvPass
from kimi_cg.canonicalize.real_rope import RealRopePass
from kimi_cg.canonicalize.scatter_merge import ScatterMergePass
from kimi_cg.canonicalize.segment_attention import SegmentAttentionPass
from kimi_cg.canonicalize.separable_resize import SeparableResizePass
from kimi_cg.canonicalize.table_gather import TableGatherPass

__all__ = ["EmbeddingReadsPass", "FuseGatherLayerNormPass", "GatherReducePass", "GraphPass", "InlineRegionsPass",
           "LinearGeluPass", "MergeGatherPass", "PatchConvPass", "RealRopePass", "ScatterMergePass",
           "SegmentAttentionPass", "SeparableResizePass", "TableGatherPass", "has_regions"]
