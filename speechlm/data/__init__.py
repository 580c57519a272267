"""Data side: manifests, text cleaning, tokenizer, sampler, dataset and loaders."""
