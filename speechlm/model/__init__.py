"""Model: audio front end, encoder, projector, decoder LLM and attention backends.

Model code never imports torch.distributed.
"""
