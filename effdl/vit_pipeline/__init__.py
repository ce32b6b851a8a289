"""The ViT training pipeline of the Clothing task, as the course gave it and as fixed.

One config, :class:`PipelineConfig`, has a field per choice the two pipelines make differently,
so a preset pair (full, ``--quick``) per pipeline is the whole difference, and every fix can be
switched on or off alone from the command line (an ablation is one flag). As given:

1. data path: CSV re-read for the label map, pandas ``.loc`` per item, full-resolution JPEG
   decode, Resize -> CenterCrop -> RandomResizedCrop (effdl.data.clothing);
2. loader: ``num_workers=0`` (decoding on the training thread), pageable memory, blocking copies;
3. model: dims 255, heads never split, attention pre-norm never applied, explicit softmax
   (effdl.models.vit);
4. fp32 (no autocast) and ``cudnn.deterministic = True``;
5. a host-device sync per step: ``.item()`` on loss and accuracy;
6. validation without ``no_grad`` (autograd graph built, activations kept) and its averages
   divided by the training loader's length;
plus ``zero_grad()`` zeroing in place (``set_to_none=False``, the default of the torch the course
wrote against) and a for-each Adam.
"""

from effdl.vit_pipeline.config import (
    AS_GIVEN,
    FIXED,
    PIPELINES,
    PRESETS,
    PipelineConfig,
    for_device,
    parse_config,
)
from effdl.vit_pipeline.data import (
    ClothingData,
    decoded_batches,
    input_transform,
    make_loaders,
    prepare_data,
)
from effdl.vit_pipeline.training import (
    BatchStats,
    PhaseResult,
    Trainer,
    build_trainer,
    run_phase,
    timed_batches,
)

__all__ = [
    "AS_GIVEN",
    "FIXED",
    "PIPELINES",
    "PRESETS",
    "BatchStats",
    "ClothingData",
    "PhaseResult",
    "PipelineConfig",
    "Trainer",
    "build_trainer",
    "decoded_batches",
    "for_device",
    "input_transform",
    "make_loaders",
    "parse_config",
    "prepare_data",
    "run_phase",
    "timed_batches",
]
