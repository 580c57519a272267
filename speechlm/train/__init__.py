"""Training: Lightning module, strategy, callbacks, checkpoints, entrypoint."""
