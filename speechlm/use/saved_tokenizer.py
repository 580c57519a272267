"""Loading a saved tokenizer (an export's, a run's `RUN/tokenizer`) for evaluate, transcribe and export."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_text_tokenizer(path: Path) -> Any:
    """A saved tokenizer (`tokenizer.save`: a SentencePiece .model file, or a directory holding one or a
    Hugging Face tokenizer), as `speechlm.data.tokenizer.load_text_tokenizer` reads it."""
    try:
        from speechlm.data.tokenizer import load_text_tokenizer as load  # type: ignore[attr-defined]
    except ImportError:  # a build with the SentencePiece tokenizer only
        from speechlm.data.tokenizer import Tokenizer as load

        models = sorted(Path(path).glob("*.model")) if Path(path).is_dir() else []
        path = models[0] if len(models) == 1 else path
    return load(path)
