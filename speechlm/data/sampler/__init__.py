"""The training sampler: duration-bucketed, language-balanced micro-batches per data-parallel rank.

One concern per module:

- `settings`: the frozen `SamplerSettings` (built from the config in one place) and `check_arrays`;
- `cost`: the token cost model and the integer costs the packer compares;
- `ordering`: steps 1-3 of the plan (duration buckets, language targets, per-bucket order / draws);
- `batching`: steps 4-6 (greedy packing, dealing to dp ranks, lockstep trim);
- `mix`: `DatasetMix`, dataset weights (`data.input_cfg`) inside the temperature draw;
- `epoch_plan`: `EpochPlan` and the pure `build_epoch_plan` (the algorithm is described there);
- `streaming`: the pure `build_streaming_plan` (shards read front to back; the streaming read mode);
- `stateful`: `DurationBucketBatchSampler`, the resumable per-rank wrapper used by the trainer
  (`StreamingLayout` switches it to the streaming plan);
- `build`: `build_sampler`, the one builder `speechlm train` and `speechlm plan` share (settings with
  the encoder's token cost, inputs from the index, the sampler of one dp rank).
"""

from speechlm.data.sampler.cost import SECOND_UNITS, TOKEN_UNITS, TokenCostModel
from speechlm.data.sampler.epoch_plan import EpochPlan, build_epoch_plan
from speechlm.data.sampler.mix import DatasetMix
from speechlm.data.sampler.ordering import assign_buckets, compute_language_targets
from speechlm.data.sampler.settings import DEFAULT_BUCKET_BOUNDARIES, MODES, SamplerSettings, check_arrays
from speechlm.data.sampler.stateful import DurationBucketBatchSampler, StreamingLayout, fingerprint_manifest
from speechlm.data.sampler.streaming import build_streaming_plan

__all__ = [
    "DEFAULT_BUCKET_BOUNDARIES",
    "MODES",
    "SECOND_UNITS",
    "TOKEN_UNITS",
    "DatasetMix",
    "DurationBucketBatchSampler",
    "EpochPlan",
    "SamplerSettings",
    "StreamingLayout",
    "TokenCostModel",
    "assign_buckets",
    "build_epoch_plan",
    "build_streaming_plan",
    "check_arrays",
    "compute_language_targets",
    "fingerprint_manifest",
]
