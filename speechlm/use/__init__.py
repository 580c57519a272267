"""Using a trained model: `speechlm evaluate`, `speechlm transcribe` and `speechlm export`, and the
evaluation engine training's validation shares. Nothing here imports `speechlm.train` or
`speechlm.preflight` (training imports this layer, never the reverse).

- `checkpoint_files`: the files of a checkpoint, verified and read with loaders that run no code
  (shared with training's resume); `checkpoint`: a run dir or checkpoint dir -> the one-process model
  of that checkpoint (`TrainedModule`), with the config and tokenizer it was trained with;
- `evaluator`: greedy decoding and each task's metrics per language over a manifest, sharded over the
  data-parallel ranks (`Evaluator`, run by training's validation and final evaluation and by `speechlm
  evaluate`); `eval_report`: its table, counts, eval.json and eval_decodes.jsonl;
- `evaluate_cli` (command line) and `evaluation`: the metrics per task and language of a checkpoint on
  any manifest, sharded over ranks under torchrun (the `Evaluator`, with explicit rank and world);
- `export_cli` (command line) and `export`: a self-contained export directory (LLM with LoRA merged and
  its tokenizer beside it, encoder and projector weights in safetensors, one config with every file's
  SHA-256), written into a temp dir and renamed; `hf_export`: a SentencePiece tokenizer rebuilt as a
  Hugging Face one for it;
- `transcribe`: batched KV-cached greedy decoding of audio files or a manifest, from a run, a
  checkpoint or an export (`speechlm.model.exported` loads an export with no training code); `inputs`:
  its audio files and manifests.
"""
