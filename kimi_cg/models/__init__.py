"""Reference towers: the eager models kimi_cg compiles (inputs to the compiler, not part of it)."""

from kimi_cg.models.moonvit import (
    KimiVLMultiModalProjector,
    KimiVLVisionEncoder,
    MoonVitConfig,
    MoonVitPretrainedModel,
)
from kimi_cg.models.moonvit3d import (
    KimiK25MultiModalProjector,
    KimiK25VisionEncoder,
    MoonViT3dConfig,
    MoonViT3dPretrainedModel,
)

__all__ = [
    "KimiK25MultiModalProjector",
    "KimiK25VisionEncoder",
    "KimiVLMultiModalProjector",
    "KimiVLVisionEncoder",
    "MoonViT3dConfig",
    "MoonViT3dPretrainedModel",
    "MoonVitConfig",
    "MoonVitPretrainedModel",
]
