"""Tiny pretrained LLM directories for the tests: what `model.llm.pretrained` points at in a real run
(a `save_pretrained` directory with safetensors weights and the LLM's own tokenizer), made in seconds.

    make_tiny_pretrained(tmp_path / "llm", langs=["en", "hi"])

writes a randomly initialised `LlamaForCausalLM` (2 layers, hidden 32) and a byte-level BPE tokenizer
trained with the `tokenizers` library on the demo corpus' transcripts of `langs`, with ChatML-style
special tokens (``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``) and, with ``chat_template=True``,
a ChatML chat template (the assistant turn ends with ``<|im_end|>`` then a newline). The tokenizer has
no BOS and no PAD token, as Qwen's: the code under test must cope with both missing. `AutoTokenizer`
and `AutoModelForCausalLM` load the directory offline. The LLM knows nothing of the speech side's
tokens: `<|audio|>` and the language tags are added by `speechlm.data.hf_tokenizer.HFTokenizer`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEMO_SHARDS = REPO / "data/demo/shards"

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TINY_LLM = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)


def demo_transcripts(langs: Sequence[str]) -> list[str]:
    """The raw demo transcriptions of `langs` (every shard of the bundled demo corpus)."""
    import pyarrow.parquet as pq

    texts: list[str] = []
    for meta in sorted(DEMO_SHARDS.glob("*/metadata.parquet")):
        table = pq.read_table(meta, columns=["transcription_native", "segment_language"]).to_pylist()
        texts += [
            r["transcription_native"]
            for r in table
            if r["transcription_native"] and r["segment_language"] in langs
        ]
    return texts


def train_bpe_tokenizer(texts: Sequence[str], *, vocab_size: int = 400):
    """A byte-level BPE `tokenizers.Tokenizer` trained on `texts`; the three ChatML specials get ids 0, 1, 2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[ENDOFTEXT, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer)
    return tok


def make_tiny_pretrained(
    directory: str | Path,
    *,
    langs: Sequence[str],
    chat_template: bool = True,
    with_tokenizer: bool = True,
    tie_word_embeddings: bool = False,
    seed: int = 0,
) -> Path:
    """Write a tiny random pretrained LLM (and, with `with_tokenizer`, its tokenizer) into `directory`.

    ``chat_template=False`` leaves the tokenizer without a template (the plain prompt form);
    ``with_tokenizer=False`` writes the weights only (a run must then name data.tokenizer). Returns the
    directory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    bpe = train_bpe_tokenizer(demo_transcripts(langs))
    eos = IM_END if chat_template else ENDOFTEXT
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=eos, bos_token=None, pad_token=None)
    hf_tok.add_special_tokens({"additional_special_tokens": [IM_START, IM_END]})
    if chat_template:
        hf_tok.chat_template = CHATML_TEMPLATE
    if with_tokenizer:
        hf_tok.save_pretrained(out)
    cfg = LlamaConfig(
        vocab_size=len(hf_tok),
        bos_token_id=None,
        eos_token_id=hf_tok.eos_token_id,
        pad_token_id=None,
        max_position_embeddings=2048,
        tie_word_embeddings=tie_word_embeddings,
        **TINY_LLM,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).save_pretrained(out)
    return out
