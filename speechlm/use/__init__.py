"""Using a trained model: `speechlm evaluate`, `speechlm transcribe` and `speechlm export`.

- `checkpoint`: a run dir or checkpoint dir -> the one-process model of that checkpoint, with the
  config and tokenizer it was trained with (training code: Lightning module, DCP reader);
- `evaluate_cli`: WER per language of a checkpoint on any manifest, sharded over ranks under torchrun
  (the training `Evaluator`, with explicit rank and world);
- `export_cli`: a self-contained export directory (LLM with LoRA merged and its tokenizer beside it,
  encoder and projector weights in safetensors, one config with every file's SHA-256), written into a
  temp dir and renamed; `hf_export`: a SentencePiece tokenizer rebuilt as a Hugging Face one for it;
- `transcribe`: batched KV-cached greedy decoding of audio files or a manifest, from a run, a
  checkpoint or an export (`speechlm.model.exported` loads an export with no training code).
"""
