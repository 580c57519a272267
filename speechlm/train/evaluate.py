"""Greedy decoding and word error rate per language (jiwer)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import jiwer
import torch


def strip_lang_tag(text: str) -> str:
    text = text.strip()
    if text.startswith("<|") and "|>" in text:
        text = text[text.index("|>") + 2 :]
    return " ".join(text.split())


def wer_by_language(refs: list[str], hyps: list[str], langs: list[str]) -> dict[str, float]:
    """Corpus WER overall (`wer`) and per language (`wer_<lang>`), in [0, inf)."""
    if not refs:
        return {}
    out: dict[str, float] = {}
    by: dict[str, tuple[list[str], list[str]]] = defaultdict(lambda: ([], []))
    for r, h, lang in zip(refs, hyps, langs):
        by[lang][0].append(r)
        by[lang][1].append(h)

    def corpus_wer(rs: list[str], hs: list[str]) -> float:
        pairs = [(r, h) for r, h in zip(rs, hs) if r.strip()]
        if not pairs:
            return 0.0
        return float(jiwer.wer([p[0] for p in pairs], [p[1] if p[1].strip() else "<empty>" for p in pairs]))

    out["wer"] = corpus_wer(refs, hyps)
    for lang in sorted(by):
        out[f"wer_{lang}"] = corpus_wer(*by[lang])
    return out


@torch.no_grad()
def decode_batches(
    model: Any,
    batches: Iterable[Any],
    tokenizer: Any,
    *,
    device: torch.device,
    max_new_tokens: int = 96,
    max_batches: int | None = None,
) -> tuple[list[str], list[str], list[str]]:
    """Greedy-decode every batch; returns (references, hypotheses, languages) without language tags."""
    refs: list[str] = []
    hyps: list[str] = []
    langs: list[str] = []
    was_training = model.training
    model.eval()
    try:
        for i, batch in enumerate(batches):
            if max_batches is not None and i >= max_batches:
                break
            if len(batch) == 0:
                continue
            batch = batch.to(device)
            out_ids = model.generate_greedy(batch.audio, batch.audio_lens, max_new_tokens=max_new_tokens)
            for b in range(len(batch)):
                n = int(batch.token_lens[b])
                refs.append(strip_lang_tag(tokenizer.decode(batch.tokens[b, :n].tolist())))
                hyps.append(strip_lang_tag(tokenizer.decode(list(out_ids[b]))))
                langs.append(batch.langs[b])
    finally:
        model.train(was_training)
    return refs, hyps, langs


def format_wer_table(metrics: dict[str, float], counts: dict[str, int] | None = None) -> str:
    rows = [(k[4:], v) for k, v in metrics.items() if k.startswith("wer_")]
    lines = ["language  utterances  WER", "--------  ----------  ------"]
    for lang, v in rows:
        n = "" if counts is None else str(counts.get(lang, ""))
        lines.append(f"{lang:<8}  {n:>10}  {100 * v:5.1f}%")
    if "wer" in metrics:
        total = "" if counts is None else str(sum(counts.values()))
        lines.append(f"{'all':<8}  {total:>10}  {100 * metrics['wer']:5.1f}%")
    return "\n".join(lines)
