"""WER per language and reference/hypothesis clean-up."""

from dataclasses import replace

import pytest

from speechlm.data.text import strip_lang_tag
from speechlm.metrics import word_error_counts
from speechlm.use.eval_report import format_wer_table, wer_from_counts


def test_strip_lang_tag():
    assert strip_lang_tag("<|hi|> नमस्ते  दुनिया ") == "नमस्ते दुनिया"
    assert strip_lang_tag("plain words") == "plain words"


def test_wer_by_language():
    refs = ["a b c d", "x y", "p q r s"]
    hyps = ["a b c e", "x y", ""]
    langs = ["en", "hi", "en"]
    m = wer_from_counts((lang, *word_error_counts(r, h)) for r, h, lang in zip(refs, hyps, langs))
    assert m["wer_hi"] == 0.0
    assert m["wer_en"] == pytest.approx(5 / 8)  # one substitution + four deletions (empty hypothesis)
    assert m["wer"] == pytest.approx(5 / 10)
    table = format_wer_table(m, {"en": 2, "hi": 1})
    assert "en" in table and "62.5%" in table and "all" in table


# ---------------------------------------------------------------------------- sharded validation

import random  # noqa: E402

import jiwer  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from parallel.collectives import Collectives  # noqa: E402
from parallel.mesh import ParallelDims  # noqa: E402
from parallel.testing import run_distributed  # noqa: E402
from speechlm.config import EncoderConfig, LLMConfig, ModelConfig  # noqa: E402
from speechlm.data.dataset import Batch  # noqa: E402
from speechlm.model.speech_llm import SpeechLLM  # noqa: E402
from speechlm.use.evaluator import (  # noqa: E402
    decode_shard,
    shard_eval_batches,
)

VOCAB, EOS = 40, 3


def test_shard_eval_batches_deals_every_batch_once_and_pads_to_equal_counts():
    batches = [[i] for i in range(7)]
    shares = [shard_eval_batches(batches, r, 3) for r in range(3)]
    assert {len(s) for s in shares} == {3}
    assert sorted(b[0] for s in shares for b in s if b) == list(range(7))
    assert shares[2] == [[2], [5], []]
    assert shard_eval_batches([], 0, 2) == []
    with pytest.raises(ValueError, match="dp_rank=2"):
        shard_eval_batches(batches, 2, 2)


def test_wer_from_counts_equals_corpus_wer_and_does_not_depend_on_the_split():
    rng = random.Random(0)
    words = "a b c d e f g".split()
    refs = [" ".join(rng.choices(words, k=rng.randint(0, 6))) for _ in range(40)]
    hyps = [" ".join(rng.choices(words, k=rng.randint(0, 6))) for _ in range(40)]
    langs = [rng.choice(["en", "hi"]) for _ in range(40)]
    rows = [(lang, *word_error_counts(r, h)) for r, h, lang in zip(refs, hyps, langs)]
    whole = wer_from_counts(rows)
    kept = [(r, h or "<empty>") for r, h in zip(refs, hyps) if r.strip()]
    assert whole["wer"] == pytest.approx(jiwer.wer([k[0] for k in kept], [k[1] for k in kept]), abs=1e-12)
    halves = [rows[0::2], rows[1::2]]
    assert wer_from_counts(halves[1] + halves[0]) == whole  # exact: sums of integers


class WordTokenizer:
    def decode(self, ids: list[int]) -> str:
        return " ".join(f"w{i}" for i in ids)


def make_batches(n_batches: int = 3) -> list[Batch]:
    g = torch.Generator().manual_seed(3)
    out = []
    for k in range(n_batches):
        lens = [4000 + 1700 * j + 900 * k for j in range(2 + k % 2)]
        audio = torch.randn(len(lens), max(lens), generator=g)
        for j, n in enumerate(lens):
            audio[j, n:] = 0
        tokens = torch.randint(5, VOCAB, (len(lens), 4), generator=g)
        out.append(
            Batch(
                audio=audio,
                audio_lens=torch.tensor(lens),
                tokens=tokens,
                token_lens=torch.full((len(lens),), 4),
                langs=["en" if j % 2 else "hi" for j in range(len(lens))],
                indices=[10 * k + j for j in range(len(lens))],
                durations=torch.tensor(lens) / 16000.0,
            )
        )
    return out


def build_model(eos: int) -> SpeechLLM:
    torch.manual_seed(0)
    enc = EncoderConfig(
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        intermediate_size=64,
        subsampling_conv_channels=8,
        num_mel_bins=32,
    )
    llm = LLMConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=64)
    cfg = ModelConfig(encoder=enc, llm=llm, projector_hidden=32)
    model = SpeechLLM(cfg, vocab_size=VOCAB, pad_id=0, bos_id=2, eos_id=EOS, audio_id=4)
    model.prompt = replace(model.prompt, stop=(eos,))  # VOCAB: never emitted
    with torch.no_grad():  # make the audio matter to a random model, so hypotheses differ per clip
        model.projector.fc1.weight.mul_(10)
        model.projector.fc2.weight.mul_(30)
        model.projector.fc2.bias.zero_()
    return model


def single_rank_rows(eos: int) -> list[dict]:
    return decode_shard(
        build_model(eos),
        make_batches(),
        WordTokenizer(),
        device=torch.device("cpu"),
        comm=Collectives(),
        max_new_tokens=8,
    )


def pick_eos() -> int:
    """An eos that makes the utterances stop at different steps (so the lockstep really matters)."""
    rows = single_rank_rows(VOCAB)
    hyps = [[int(w[1:]) for w in r["hyp"].split()] for r in rows]
    return max(
        sorted({t for h in hyps for t in h}), key=lambda t: len({h.index(t) if t in h else 8 for h in hyps})
    )


def _eval_worker(rank: int, world: int, eos: int, cp: int) -> list[dict]:
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    model = build_model(eos)
    for unit in (*model.llm.model.layers, model.encoder, model.projector):
        fully_shard(unit)  # every forward all-gathers over both ranks: unequal step counts would hang
    fully_shard(model)
    for name in ("generate_greedy", "encode_audio", "embed_tokens"):
        register_fsdp_forward_method(model, name)
    comm = ParallelDims(world, cp=cp).collectives(rank)
    batches = make_batches()
    share = shard_eval_batches([[i] for i in range(len(batches))], comm.dp_rank, comm.dp_size)
    slots = [batches[s[0]] if s else Batch.empty() for s in share]
    rows = decode_shard(
        model, slots, WordTokenizer(), device=torch.device("cpu"), comm=comm, max_new_tokens=8
    )
    order = {b.indices[j]: 100 * k + j for k, b in enumerate(batches) for j in range(len(b))}
    # every dp group's rows on every rank (one copy per group), in the single-rank order (as Evaluator)
    parts = comm.gather_objects((comm.primary, rows))
    merged = sorted((r for primary, part in parts if primary for r in part), key=lambda r: order[r["row"]])
    dist.barrier()
    return merged


@pytest.mark.multiproc
@pytest.mark.parametrize("cp", [1, 2], ids=["dp2", "cp2"])
def test_sharded_validation_equals_single_rank_exactly(cp):
    eos = pick_eos()
    want = single_rank_rows(eos)
    assert len({len(r["hyp"].split()) for r in want}) > 1  # utterances stop at different steps
    per_rank = run_distributed(_eval_worker, 2, "gloo", eos, cp, timeout_s=240)
    for got in per_rank:
        assert got == want  # same rows, same order, on every rank
        rows = [(r["lang"], r["errors"], r["words"]) for r in got]
        assert wer_from_counts(rows) == wer_from_counts((r["lang"], r["errors"], r["words"]) for r in want)
