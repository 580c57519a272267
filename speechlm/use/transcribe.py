"""`speechlm transcribe RUN_OR_EXPORT AUDIO... | --manifest M [--out out.jsonl]`: greedy transcripts.

The model comes from an export directory (`speechlm.model.exported`: no training code is imported)
or from a run / checkpoint directory (`speechlm.use.checkpoint`). Inputs are audio files (any format
libsndfile reads, resampled to the model's rate) or a manifest of any format the trainer reads.

Batching is the evaluation's (`batch_by_duration`): shortest first, at most ``--batch-seconds`` of
audio (default: the model's ``trainer.eval_batch_duration``, as `speechlm evaluate` uses) and at most
``--batch-size`` utterances per batch; each batch is decoded greedily with the KV cache
(`SpeechLLM.generate_greedy`) on ``--device`` (default: the GPU when there is one). With the same
manifest and batch settings the hypotheses equal those `speechlm evaluate` scores.

Output: one JSON line per input, in input order: ``{"path", "lang", "text"}`` (``lang``: the language
tag the model emitted, null when it emitted none; a manifest adds ``row``). An input that cannot be
used (missing file, undecodable audio, a manifest row the trainer would drop) gets
``{"path", "error"}`` instead, the others are still transcribed, and the command exits 1 after
writing everything. A progress display goes to stderr when there is more than one batch and the
output is a terminal (`speechlm.progress`; none in logs or pipes).

Interruption: ``--out`` is written once, at the end, into a temporary file renamed over it; a
process stopped by SIGTERM or SIGKILL leaves ``--out`` as it was before (absent, or the previous
complete file), never a partial one. Without ``--out`` the lines go to stdout at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from speechlm.errors import EXIT_DATA, OutputError, UsageError

DEFAULT_MAX_NEW_TOKENS = 96  # the same budget as evaluation (speechlm.train.evaluate.decode_shard)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "transcribe",
        help="transcribe audio files or a manifest with a run, checkpoint or export (greedy, KV cache)",
        description="Greedy-decode audio with a trained model. Writes one JSON line per input "
        '({"path", "lang", "text"}, or {"path", "error"}); exit code 1 when any input failed.',
    )
    p.add_argument("model", metavar="RUN_OR_EXPORT", help="an export dir, a run dir or a checkpoint dir")
    p.add_argument("audio", nargs="*", help="audio files to transcribe")
    p.add_argument("--manifest", help="transcribe every row of this manifest (any format the trainer reads)")
    p.add_argument("--out", help="write the JSON lines to this file (atomically, at the end); default stdout")
    add_decoding_arguments(p, device_help="cpu, cuda, cuda:1, ... (default: cuda when available)")
    p.add_argument("--lang", default=None, help="force this language tag instead of letting the model choose")
    p.set_defaults(func=run_transcribe_command)


def add_checkpoint_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "checkpoint",
        metavar="RUN_OR_CKPT",
        help="a run dir (its latest complete checkpoint) or a checkpoint dir",
    )


def add_decoding_arguments(p: argparse.ArgumentParser, *, device_help: str) -> None:
    """--batch-size, --batch-seconds, --max-new-tokens, --device: what transcribe and evaluate share."""
    p.add_argument(
        "--batch-size", type=int, default=None, help="utterances per batch at most (default: no limit)"
    )
    p.add_argument(
        "--batch-seconds",
        type=float,
        default=None,
        help="seconds of audio per batch (default: the model's trainer.eval_batch_duration)",
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=DEFAULT_MAX_NEW_TOKENS,
        help=f"tokens per utterance at most (default {DEFAULT_MAX_NEW_TOKENS}, as in training's evaluation)",
    )
    p.add_argument(
        "--ctc-weight",
        type=float,
        default=None,
        help="weight of the CTC head's prefix scores in joint CTC/attention greedy decoding, 0-1 (default: the "
        "model's model.decode_ctc_weight; 0: the LLM alone)",
    )
    from speechlm.model.devices import device_argument

    p.add_argument("--device", type=device_argument, default=None, help=device_help)


def apply_ctc_weight(model: Any, weight: float | None) -> None:
    """``--ctc-weight``: set the model's joint-decoding weight; refused when it has no CTC head."""
    if weight is None:
        return
    if weight > 0 and getattr(model, "ctc_head", None) is None:
        raise UsageError(
            f"--ctc-weight {weight}: this model was trained without a CTC head (model.ctc_weight=0); leave out "
            "--ctc-weight"
        )
    model.decode_ctc_weight = float(weight)


def check_decoding_arguments(args: argparse.Namespace) -> None:
    if args.batch_size is not None and args.batch_size < 1:
        raise UsageError(f"--batch-size {args.batch_size}: give a number of utterances >= 1")
    if args.batch_seconds is not None and not args.batch_seconds > 0:
        raise UsageError(f"--batch-seconds {args.batch_seconds}: give seconds of audio > 0")
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens {args.max_new_tokens}: give a number >= 1")
    if args.ctc_weight is not None and not 0.0 <= args.ctc_weight <= 1.0:
        raise UsageError(f"--ctc-weight {args.ctc_weight}: give a weight between 0 and 1")


@dataclass
class UsableModel:
    """What transcription needs, from an export or a checkpoint."""

    model: Any  # SpeechLLM, eval mode, on its device
    tokenizer: Any
    sample_rate: int
    batch_seconds: float  # the evaluation's batch budget


def load_model(path: str | Path, device: str) -> UsableModel:
    """An export dir (no training code), else a run or checkpoint dir (through the training layer)."""
    from speechlm.data.tokenizer import load_text_tokenizer
    from speechlm.model.exported import is_export_dir, load_exported

    p = Path(path)
    if is_export_dir(p) or not ((p / "complete.json").is_file() or (p / "checkpoints").is_dir()):
        ex = load_exported(p, device=device)  # not a run nor a checkpoint either: the export's error
        tokenizer = load_text_tokenizer(ex.tokenizer_path)
        return UsableModel(ex.model, tokenizer, ex.sample_rate, float(ex.config["eval_batch_duration"]))
    from speechlm.config import eval_batch_duration
    from speechlm.use.checkpoint import load_checkpoint

    loaded = load_checkpoint(path, device=device, log=lambda m: print(m, file=sys.stderr))
    cfg = loaded.cfg
    return UsableModel(loaded.model, loaded.tokenizer, int(cfg.data.sample_rate), eval_batch_duration(cfg))


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def check_args(args: argparse.Namespace) -> None:
    if bool(args.audio) == bool(args.manifest):
        raise UsageError(
            "give audio files or --manifest M (one of the two): nothing to transcribe, or both given"
        )
    check_decoding_arguments(args)
    if args.out is not None:
        out = Path(args.out)
        if out.is_dir():
            raise OutputError(f"--out {out} is a directory: give a file path such as {out / 'hyps.jsonl'}")
        if not out.parent.is_dir():
            raise OutputError(f"--out {out}: the folder {out.parent} does not exist; create it first")


def run_transcribe_command(args: argparse.Namespace) -> int:
    check_args(args)
    um = load_model(args.model, args.device or default_device())
    apply_ctc_weight(um.model, args.ctc_weight)
    lang_id = None
    if args.lang is not None:
        if not um.tokenizer.tag_tokens:
            raise UsageError(
                f"--lang {args.lang}: this model was trained with data.lang_tags=none (no language tag to "
                "force); leave out --lang"
            )
        if args.lang not in um.tokenizer.langs:
            raise UsageError(
                f"--lang {args.lang}: the model knows the languages {', '.join(um.tokenizer.langs)}"
            )
        lang_id = int(um.tokenizer.lang_id(args.lang))
    source = ManifestInputs(args.manifest, um) if args.manifest else FileInputs(args.audio, um.sample_rate)
    batches = source.batches(args.batch_seconds or um.batch_seconds, args.batch_size)
    records = transcribe(um, source, batches, max_new_tokens=args.max_new_tokens, lang_id=lang_id)
    write_records(records, args.out)
    failed = [r for r in records if "error" in r]
    if failed:
        where = args.out or "the output"
        print(
            f"error: {len(failed)} of {len(records)} inputs could not be transcribed (their lines in {where} "
            f'carry "error"; first: {failed[0]["path"]}: {failed[0]["error"]})',
            file=sys.stderr,
        )
        return EXIT_DATA
    return 0


# --- inputs ------------------------------------------------------------------------------------------
class FileInputs:
    """Audio files named on the command line; durations from the file headers (0 when unreadable)."""

    def __init__(self, paths: list[str], sample_rate: int) -> None:
        self.paths, self.sample_rate = list(paths), sample_rate

    def __len__(self) -> int:
        return len(self.paths)

    def durations(self) -> list[float]:
        import soundfile as sf

        out = []
        for p in self.paths:
            try:
                out.append(float(sf.info(p).duration))
            except Exception:  # noqa: BLE001 - reported when the file is loaded
                out.append(0.0)
        return out

    def batches(self, seconds: float, size: int | None) -> list[list[int]]:
        import numpy as np

        from speechlm.data.sampler.batching import batch_by_duration

        return batch_by_duration(np.asarray(self.durations()), seconds, size)

    def record(self, i: int) -> dict[str, Any]:
        return {"path": self.paths[i]}

    def load(self, batch: list[int]) -> Iterator[tuple[int, Any, str | None]]:
        """(input, audio tensor or None, error or None) per input of `batch`."""
        import torch

        from speechlm.data.audio import AudioDecodeError
        from speechlm.data.dataset import load_audio

        for i in batch:
            try:
                audio = load_audio(self.paths[i], self.sample_rate)
            except (FileNotFoundError, AudioDecodeError) as e:
                yield i, None, str(e)
                continue
            if audio.size == 0:
                yield i, None, f"{self.paths[i]} decodes to no samples"
                continue
            yield i, torch.from_numpy(audio), None


class ManifestInputs:
    """The rows of a manifest, read as evaluation reads them (`SpeechDataset`)."""

    def __init__(self, manifest: str, um: UsableModel) -> None:
        from speechlm.data.dataset import SpeechDataset
        from speechlm.data.sources.mmap_cache import open_index

        self.table = open_index(manifest)
        # the text is not needed here: any length is accepted (evaluation drops what training drops)
        self.ds = SpeechDataset(self.table, um.tokenizer, max_tokens=1 << 30, sample_rate=um.sample_rate)

    def __len__(self) -> int:
        return len(self.ds)

    def batches(self, seconds: float, size: int | None) -> list[list[int]]:
        from speechlm.data.manifest import manifest_arrays
        from speechlm.data.sampler.batching import batch_by_duration

        return batch_by_duration(manifest_arrays(self.table).durations, seconds, size)

    def record(self, i: int) -> dict[str, Any]:
        return {"row": i, "path": str(self.ds.resolve_path(i))}

    def load(self, batch: list[int]) -> Iterator[tuple[int, Any, str | None]]:
        from speechlm.data.dataset import DroppedSample

        for sample in self.ds.__getitems__(batch):
            if isinstance(sample, DroppedSample):
                yield sample.index, None, f"{sample.reason}: {sample.detail}"
            else:
                yield sample.index, sample.audio, None


# --- decoding ----------------------------------------------------------------------------------------
def language_of(tokenizer: Any, ids: list[int]) -> str | None:
    """The language whose tag is the first generated token, None when it is not a tag."""
    if not ids or not tokenizer.tag_tokens:  # data.lang_tags=none: no tag is generated
        return None
    for lang in tokenizer.langs:
        if int(tokenizer.lang_id(lang)) == int(ids[0]):
            return str(lang)
    return None


def transcribe(
    um: UsableModel,
    source: Any,
    batches: list[list[int]],
    *,
    max_new_tokens: int,
    lang_id: int | None = None,
) -> list[dict[str, Any]]:
    """Decode every batch; one record per input, in input order."""
    import torch

    from speechlm.data.text import decode_hypothesis
    from speechlm.progress import Progress

    device = next(um.model.parameters()).device
    records: list[dict[str, Any] | None] = [None] * len(source)
    print(
        f"transcribing {len(source)} inputs in {len(batches)} batches on {device}",
        file=sys.stderr,
        flush=True,
    )
    bar = Progress(len(source), "transcribing", "utt", enabled=None if len(batches) > 1 else False)
    for batch in batches:
        ok: list[tuple[int, Any]] = []
        for i, audio, error in source.load(batch):
            if error is not None:
                records[i] = {**source.record(i), "error": error}
            else:
                ok.append((i, audio))
        if ok:
            lens = torch.tensor([int(a.shape[0]) for _, a in ok])
            audio_BN = torch.zeros(len(ok), int(lens.max()), dtype=torch.float32)
            for b, (_, a) in enumerate(ok):
                audio_BN[b, : a.shape[0]] = a
            out = um.model.generate_greedy(
                audio_BN.to(device), lens.to(device), max_new_tokens=max_new_tokens, lang_id=lang_id
            )
            for (i, _), ids in zip(ok, out):
                text = decode_hypothesis(um.tokenizer, ids)
                records[i] = {**source.record(i), "lang": language_of(um.tokenizer, ids), "text": text}
        bar.update(len(batch))
    bar.close()
    return [r for r in records if r is not None]


def write_records(records: list[dict[str, Any]], out: str | None) -> None:
    """JSON lines to `out` (a temp file renamed over it: never a partial file) or to stdout."""
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    if out is None:
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    path = Path(out)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise OutputError(f"cannot write {path}: {e.strerror or e}; free space or fix the path") from None
    print(f"wrote {len(records)} lines to {path}", file=sys.stderr)
