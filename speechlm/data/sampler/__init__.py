"""The training sampler: duration-bucketed, language-balanced micro-batches per data-parallel rank."""

from speechlm.data.sampler.epoch_plan import (
    DEFAULT_BUCKET_BOUNDARIES,
    MODES,
    SECOND_UNITS,
    TOKEN_UNITS,
    DurationBucketBatchSampler,
    EpochPlan,
    SamplerSettings,
    TokenCostModel,
    assign_buckets,
    build_epoch_plan,
    check_arrays,
    compute_language_targets,
    fingerprint_manifest,
)

__all__ = [
    "DEFAULT_BUCKET_BOUNDARIES",
    "MODES",
    "SECOND_UNITS",
    "TOKEN_UNITS",
    "DurationBucketBatchSampler",
    "EpochPlan",
    "SamplerSettings",
    "TokenCostModel",
    "assign_buckets",
    "build_epoch_plan",
    "check_arrays",
    "compute_language_targets",
    "fingerprint_manifest",
]
