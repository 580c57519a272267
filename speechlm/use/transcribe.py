"""`speechlm transcribe RUN_OR_EXPORT AUDIO... | --manifest M [--out out.jsonl]`: greedy transcripts.

The model comes from an export directory (`speechlm.model.exported`: no training code is imported)
or from a run / checkpoint directory (`speechlm.use.checkpoint`). Inputs (`speechlm.use.inputs`) are
audio files (any format libsndfile reads, resampled to the model's rate) or ``--manifest M``: a list of
paths, a NeMo JSON-lines or parquet manifest whose ``text`` is optional, or any source the trainer
reads; transcripts are never needed.

Long audio: a clip longer than ``--max-duration`` (default 60 s) is not decoded in one piece (its
transcript would be cut at ``--max-new-tokens`` and memory grows with the clip): its line carries an
error, unless ``--chunk SECONDS`` is given. Then a clip longer than SECONDS is cut into
n = ceil(duration / SECONDS) equal consecutive windows (no overlap), each decoded as an utterance of
its own, and the texts are joined in order with one space (``lang``: the first window's tag;
``windows``: n). A word spoken across a window boundary may come out split or garbled. A piece whose
decoding stops at ``--max-new-tokens`` with no end of transcript marks its line ``"truncated": true``,
with a warning on stderr: a cut transcript is never passed off as whole.

Batching is the evaluation's (`batch_by_duration` over the pieces): shortest first, at most
``--batch-seconds`` of audio (default: the model's ``trainer.eval_batch_duration``, as `speechlm
evaluate` uses) and at most ``--batch-size`` pieces per batch; each batch is decoded greedily with the
KV cache (`SpeechLLM.generate_greedy`) on ``--device`` (default: the GPU when there is one). With the
same manifest and batch settings the hypotheses equal those `speechlm evaluate` scores.

Output: one JSON line per input, in input order: ``{"path", "lang", "text"}`` (``lang``: the language
tag the model emitted, null when it emitted none; a manifest adds ``row``, a conversation row's clips
``clip``). An input that cannot be used (missing file, undecodable audio, a manifest line without an
audio path, a clip over ``--max-duration``) gets ``{"path", "error"}`` instead, the others are still
transcribed, and the command exits 1 after writing everything. An input list that is empty is an error
(exit 1). A progress display goes to stderr when there is more than one batch and the output is a
terminal (`speechlm.progress`; none in logs or pipes).

Under ``torchrun --nproc-per-node N ... --cp-size N`` the N processes form one CP group that decodes every
batch together: a clip the CP layout shards (longer than 30 s, limited-context encoder) is encoded slice by
slice over the group (`speechlm.model.cp_audio.encode_for_decoding`) instead of whole on one GPU, and rank 0
writes the lines (raise ``--max-duration`` for such clips).

Interruption: ``--out`` is written once, at the end, into a temporary file renamed over it; a
process stopped by SIGTERM or SIGKILL leaves ``--out`` as it was before (absent, or the previous
complete file), never a partial one. That temporary file is created (and removed) before the model
is loaded, so an ``--out`` that cannot be written is refused at once (exit 4), not after the work; a
write that fails at the end (disk full) is exit 4 too, saying the lines were not written. Without
``--out`` the lines go to stdout at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from speechlm.config import eval_batch_duration
from speechlm.data.sampler.batching import batch_by_duration
from speechlm.data.text import decode_hypothesis
from speechlm.data.tokenizer import load_text_tokenizer
from speechlm.errors import EXIT_DATA, OutputError, UsageError
from speechlm.io import atomic_write_text, temp_sibling
from speechlm.model.devices import device_argument
from speechlm.progress import Progress

DEFAULT_MAX_NEW_TOKENS = 96  # the same budget as evaluation (speechlm.use.evaluator.decode_shard)
DEFAULT_MAX_DURATION = 60.0  # seconds of one clip decoded in one piece, unless --max-duration / --chunk


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
    p.add_argument(
        "--max-duration",
        type=float,
        default=DEFAULT_MAX_DURATION,
        help=f"seconds: a longer clip is refused (its line carries an error) unless --chunk is given "
        f"(default {DEFAULT_MAX_DURATION:g})",
    )
    p.add_argument(
        "--chunk",
        type=float,
        default=None,
        metavar="SECONDS",
        help="cut clips longer than this into equal windows of at most SECONDS, decode each and join their "
        "texts with a space (docs/use.md)",
    )
    p.add_argument(
        "--cp-size",
        type=int,
        default=1,
        help="under torchrun with this many processes: one CP group decodes every batch together, a clip "
        "longer than 30 s encoded sharded over it; rank 0 writes the lines (default 1)",
    )
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
    from speechlm.model.exported import is_export_dir, load_exported  # lazy: torch (CLI start-up)

    p = Path(path)
    if is_export_dir(p) or not ((p / "complete.json").is_file() or (p / "checkpoints").is_dir()):
        ex = load_exported(p, device=device)  # not a run nor a checkpoint either: the export's error
        tokenizer = load_text_tokenizer(ex.tokenizer_path)
        return UsableModel(ex.model, tokenizer, ex.sample_rate, float(ex.config["eval_batch_duration"]))
    from speechlm.use.checkpoint import load_checkpoint  # lazy: torch (CLI start-up)

    loaded = load_checkpoint(path, device=device, log=lambda m: print(m, file=sys.stderr))
    cfg = loaded.cfg
    return UsableModel(loaded.model, loaded.tokenizer, int(cfg.data.sample_rate), eval_batch_duration(cfg))


def default_device() -> str:
    import torch  # lazy: torch (CLI start-up)

    return "cuda" if torch.cuda.is_available() else "cpu"


def check_args(args: argparse.Namespace) -> None:
    if bool(args.audio) == bool(args.manifest):
        raise UsageError(
            "give audio files or --manifest M (one of the two): nothing to transcribe, or both given"
        )
    check_decoding_arguments(args)
    if not (args.max_duration > 0 and math.isfinite(args.max_duration)):
        raise UsageError(f"--max-duration {args.max_duration}: give seconds > 0")
    if args.chunk is not None and not 1.0 <= args.chunk <= args.max_duration:
        raise UsageError(
            f"--chunk {args.chunk}: give window seconds between 1 and --max-duration ({args.max_duration:g})"
        )
    if args.out is not None:
        out = Path(args.out)
        if out.is_dir():
            raise OutputError(f"--out {out} is a directory: give a file path such as {out / 'hyps.jsonl'}")
        if not out.parent.is_dir():
            raise OutputError(f"--out {out}: the folder {out.parent} does not exist; create it first")
        check_out_writable(out)  # last: every usage error comes first


def rank_device() -> str:
    """This process's device under torchrun: ``cuda:LOCAL_RANK`` where there are GPUs, else the CPU."""
    import torch  # lazy: torch (CLI start-up)

    if torch.cuda.is_available():
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return "cpu"


def init_process_group(device: str) -> None:
    """The default process group of a torchrun launch (NCCL on CUDA, else gloo), unless one exists."""
    import torch  # lazy: torch (CLI start-up)
    import torch.distributed as dist  # lazy: torch (CLI start-up)

    if dist.is_initialized():
        return
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")


def check_cp_group(cp_size: int, world_size: int) -> None:
    if cp_size < 1 or ((cp_size > 1 or world_size > 1) and cp_size != world_size):
        raise UsageError(
            f"--cp-size {cp_size} with {world_size} process(es): transcribe runs one CP group, so under torchrun "
            "give --cp-size equal to the number of processes (torchrun --nproc-per-node N ... --cp-size N)"
        )


def join_cp_group(model: Any, rank: int, world_size: int, device: str) -> None:
    """Put `model` under dynamic CP over all `world_size` processes (one group; every process decodes every
    batch): a clip the layout shards is encoded slice by slice over them
    (`speechlm.model.cp_audio.encode_for_decoding`). Decoding runs no CP attention, so the layout's attention
    kind does not matter here."""
    import torch.distributed as dist  # lazy: torch (CLI start-up)

    from parallel.cp_layout import DynamicCPLayout  # lazy: torch (CLI start-up)

    init_process_group(device)

    model.set_cp_layout(
        DynamicCPLayout(
            group=dist.group.WORLD,
            cp_size=world_size,
            cp_rank=rank,
            kind="ring",
            pad_to_multiple=model.cfg.pad_to_multiple,
        )
    )


def run_transcribe_command(args: argparse.Namespace) -> int:
    from speechlm.use.inputs import file_inputs, manifest_inputs  # lazy: torch (CLI start-up)

    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    check_cp_group(args.cp_size, world_size)
    check_args(args)
    if args.cp_size > 1 and args.device is None:
        args.device = rank_device()  # cuda:LOCAL_RANK
    um = load_model(args.model, args.device or default_device())
    if args.cp_size > 1:
        join_cp_group(um.model, rank, world_size, args.device)
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
    inputs = manifest_inputs(args.manifest, um) if args.manifest else file_inputs(args.audio, um.sample_rate)
    rule = WindowRule(args.max_duration, args.chunk)
    records = transcribe(
        um,
        inputs,
        rule,
        batch_seconds=args.batch_seconds or um.batch_seconds,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        lang_id=lang_id,
    )
    if rank > 0:  # the CP group's processes hold the same lines: rank 0 writes them
        return 0
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


# --- decoding ----------------------------------------------------------------------------------------
def language_of(tokenizer: Any, ids: list[int]) -> str | None:
    """The language whose tag is the first generated token, None when it is not a tag."""
    if not ids or not tokenizer.tag_tokens:  # data.lang_tags=none: no tag is generated
        return None
    for lang in tokenizer.langs:
        if int(tokenizer.lang_id(lang)) == int(ids[0]):
            return str(lang)
    return None


@dataclass(frozen=True)
class WindowRule:
    """How long a clip may be: ``--max-duration`` (refused beyond it), ``--chunk`` (cut into windows)."""

    max_duration: float = DEFAULT_MAX_DURATION
    chunk: float | None = None

    def windows(self, seconds: float) -> int:
        """Windows a clip of `seconds` is decoded in: n = ceil(seconds / chunk) equal ones with --chunk
        (each at most chunk seconds), else 1."""
        if self.chunk is None or seconds <= self.chunk:
            return 1
        return math.ceil(seconds / self.chunk - 1e-9)

    def refusal(self, path: Any, seconds: float) -> str | None:
        """Why a clip of `seconds` is not decoded (longer than --max-duration, no --chunk), or None."""
        if self.chunk is not None or seconds <= self.max_duration:
            return None
        return (
            f"{path} is {seconds:.1f} s long, more than --max-duration {self.max_duration:g} s: it is not "
            "decoded in one piece (the transcript would be cut at --max-new-tokens and memory grows with the "
            "clip); give --chunk SECONDS (e.g. --chunk 30) to transcribe it in windows, or a larger --max-duration"
        )


@dataclass(frozen=True)
class Piece:
    """One decoding row: window `window` of `windows` of input `input` (`seconds` long)."""

    input: int
    window: int
    windows: int
    seconds: float


def window_of(audio_N: Any, window: int, windows: int) -> Any:
    """Window `window` of `windows` equal consecutive windows of `audio_N` (the last takes the rest)."""
    n = int(audio_N.shape[0])
    return audio_N[window * n // windows : (window + 1) * n // windows]


def plan_pieces(inputs: list[Any], rule: WindowRule) -> tuple[list[Piece], dict[int, str]]:
    """The pieces to decode, and the inputs refused by length ({input: reason}), from their durations."""
    pieces, refused = [], {}
    for i, item in enumerate(inputs):
        reason = rule.refusal(item.record.get("path"), item.duration)
        if reason is not None:
            refused[i] = reason
            continue
        n = rule.windows(item.duration)
        pieces += [Piece(i, k, n, item.duration / n) for k in range(n)]
    return pieces, refused


class Joined:
    """The windows of one input decoded so far: texts joined with one space, in window order."""

    def __init__(self, windows: int) -> None:
        self.texts: list[str | None] = [None] * windows
        self.langs: list[str | None] = [None] * windows
        self.truncated = False

    def add(self, window: int, text: str, lang: str | None, truncated: bool) -> None:
        self.texts[window], self.langs[window] = text, lang
        self.truncated = self.truncated or truncated

    def done(self) -> bool:
        return all(t is not None for t in self.texts)

    def record(self) -> dict[str, Any]:
        text = " ".join(t for t in self.texts if t)
        out: dict[str, Any] = {"lang": next((x for x in self.langs if x is not None), None), "text": text}
        if len(self.texts) > 1:
            out["windows"] = len(self.texts)
        if self.truncated:
            out["truncated"] = True
        return out


def transcribe(
    um: UsableModel,
    inputs: list[Any],
    rule: WindowRule,
    *,
    batch_seconds: float,
    batch_size: int | None,
    max_new_tokens: int,
    lang_id: int | None = None,
) -> list[dict[str, Any]]:
    """Decode every input (`speechlm.use.inputs.AudioInput`), in batches of pieces; one record per input,
    in input order. A clip longer than the rule allows gets an error record; with --chunk a long clip
    is decoded as windows whose texts are joined. A piece whose decoding stopped at `max_new_tokens`
    marks its input ``"truncated": true`` and is warned about."""
    from speechlm.use.inputs import InputError  # lazy: torch (CLI start-up)

    device = next(um.model.parameters()).device
    pieces, refused = plan_pieces(inputs, rule)
    batches = batch_by_duration(np.asarray([p.seconds for p in pieces]), batch_seconds, batch_size)
    records: list[dict[str, Any] | None] = [None] * len(inputs)
    for i, reason in refused.items():
        records[i] = {**inputs[i].record, "error": reason}
    joined: dict[int, Joined] = {}
    print(
        f"transcribing {len(inputs)} inputs ({len(pieces)} pieces) in {len(batches)} batches on {device}",
        file=sys.stderr,
        flush=True,
    )
    bar = Progress(len(pieces), "transcribing", "utt", enabled=None if len(batches) > 1 else False)
    cache: tuple[int, Any] | None = None  # the last input's audio: its windows are decoded one after another
    for batch in batches:
        ok: list[tuple[Piece, Any]] = []
        for piece in (pieces[b] for b in batch):
            i = piece.input
            if records[i] is not None:  # an earlier window of it failed
                continue
            try:
                if cache is None or cache[0] != i:
                    cache = (i, inputs[i].load())
                    seconds = cache[1].shape[0] / um.sample_rate
                    late = rule.refusal(inputs[i].record.get("path"), seconds)
                    if late is not None:  # the header or manifest said less than the audio holds
                        raise InputError(late)
            except InputError as e:
                records[i] = {**inputs[i].record, "error": str(e)}
                continue
            ok += expand(piece, cache[1], rule, um.sample_rate)
        for (piece, ids), truncated in decode_pieces(um, ok, device, max_new_tokens, lang_id):
            i = piece.input
            j = joined.setdefault(i, Joined(piece.windows))
            j.add(piece.window, decode_text(um.tokenizer, ids), language_of(um.tokenizer, ids), truncated)
            if j.done():
                records[i] = {**inputs[i].record, **joined.pop(i).record()}
        bar.update(len(batch))
    bar.close()
    warn_truncated([r for r in records if r is not None and r.get("truncated")], max_new_tokens)
    return [r for r in records if r is not None]


def expand(piece: Piece, audio_N: Any, rule: WindowRule, sample_rate: int) -> list[tuple[Piece, Any]]:
    """The samples of `piece`; a one-piece input whose audio turned out longer than --chunk becomes all
    its windows here (its duration was unknown or understated when the pieces were planned)."""
    import torch  # lazy: torch (CLI start-up)

    n = rule.windows(audio_N.shape[0] / sample_rate) if piece.windows == 1 else piece.windows
    if n != piece.windows:
        return [(Piece(piece.input, k, n, piece.seconds), torch.as_tensor(window_of(audio_N, k, n)))
                for k in range(n)]  # fmt: skip
    return [(piece, torch.as_tensor(window_of(audio_N, piece.window, piece.windows)))]


def decode_pieces(
    um: UsableModel, ok: list[tuple[Piece, Any]], device: Any, max_new_tokens: int, lang_id: int | None
) -> Iterator[tuple[tuple[Piece, list[int]], bool]]:
    """Greedy ids of each piece (one padded batch), and whether it stopped at `max_new_tokens` (no stop
    token: `generate_greedy` returns the ids without the stop token, so a full budget means none came)."""
    import torch  # lazy: torch (CLI start-up)

    if not ok:
        return
    lens = torch.tensor([int(a.shape[0]) for _, a in ok])
    audio_BN = torch.zeros(len(ok), int(lens.max()), dtype=torch.float32)
    for b, (_, a) in enumerate(ok):
        audio_BN[b, : a.shape[0]] = a
    out = um.model.generate_greedy(
        audio_BN.to(device), lens.to(device), max_new_tokens=max_new_tokens, lang_id=lang_id
    )
    for (piece, _), ids in zip(ok, out):
        yield (piece, ids), len(ids) >= max_new_tokens


def decode_text(tokenizer: Any, ids: list[int]) -> str:
    return str(decode_hypothesis(tokenizer, ids))


def warn_truncated(records: list[dict[str, Any]], max_new_tokens: int) -> None:
    if records:
        print(
            f"warning: {len(records)} input(s) stopped at --max-new-tokens {max_new_tokens} before the model ended "
            f'its transcript (first: {records[0]["path"]}): their lines carry "truncated": true and miss the '
            "rest; give a larger --max-new-tokens, or --chunk SECONDS for long audio",
            file=sys.stderr,
        )


def check_out_writable(out: Path) -> None:
    """Create and remove `out`'s temporary file now, so an --out that cannot be written is refused before
    any decoding (exit 4), not after it."""
    tmp = temp_sibling(out)
    try:
        with tmp.open("w"):
            pass
    except OSError as e:
        raise OutputError(
            f"--out {out} cannot be written ({e.strerror or e}): nothing was transcribed; give a path in a "
            "folder you can write to"
        ) from None
    with contextlib.suppress(OSError):
        tmp.unlink()


def write_records(records: list[dict[str, Any]], out: str | None) -> None:
    """JSON lines to `out` (a temp file renamed over it: never a partial file) or to stdout."""
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    if out is None:
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    path = Path(out)
    try:
        atomic_write_text(path, text)  # the temp file is removed when the write fails
    except OSError as e:
        raise OutputError(
            f"cannot write {path}: {e.strerror or e}; the {len(records)} lines decoded were not written (a "
            f"previous {path.name} is left as it was); free space or fix the path and run again"
        ) from None
    print(f"wrote {len(records)} lines to {path}", file=sys.stderr)
