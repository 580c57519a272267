"""A conversation corpus in every format docs/data.md documents (issue 35), for the tests that train on it.

Each format holds the same five kinds of sample, twice (ids ``k<kind>-<i>``), English, 1 s sine clips:

    k0  one clip with its own transcript (untagged, as NeMo writes it), task asr
    k1  one clip without a transcript, task asr: the answer is the clip's transcript (the declared rule)
    k2  one clip without a transcript, task qa: a short answer, never a CTC target
    k3  two clips without transcripts, one answer covering both (task asr): no CTC term at all
    k4  two clips with transcripts of their own, two user turns and two answers (task qa)

ShareGPT and ms-swift have no field for a per-clip transcript, so their k0 and k4 have none (k0 then
falls under the k1 rule). `expected_ctc(fmt, kind)` is each clip's CTC target (audio order, untagged
words; None: no CTC term) and `ANSWERS[kind]` the last answer the LLM learns.
"""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import soundfile as sf

SR = 16000
T = ["water house", "big tree", "small river", "the red sun", "green book", "cold milk"]
INSTR = "Transcribe the audio."
QUESTION = "What is the first word?"
ANSWERS = {0: T[0], 1: T[1], 2: "small", 3: f"{T[3]} {T[4]}", 4: T[5]}
FORMATS = ["nemo", "nemo_tarred", "sharegpt", "swift", "lhotse", "parquet"]
NO_PER_CLIP = {"sharegpt", "swift"}  # formats without a per-clip transcript field
KINDS = range(5)
COPIES = 2


def expected_ctc(fmt: str, kind: int) -> list[str | None]:
    """Each clip's CTC target (audio order) for a `kind` sample read from `fmt`."""
    if kind == 0:
        return [T[0]]  # its own transcript, or (no per-clip field) the k1 rule with the same words
    if kind == 1:
        return [T[1]]
    if kind == 2:
        return [None]
    if kind == 3:
        return [None, None]
    return [None, None] if fmt in NO_PER_CLIP else [T[4], T[5]]


def write_clip(path: Path, seconds: float, freq: float) -> Path:
    t = np.arange(int(round(SR * seconds))) / SR
    sf.write(path, (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32), SR, subtype="PCM_16")
    return path


def _clips(audio: Path, i: int) -> tuple[str, str]:
    """Two clip files of copy `i` (relative names)."""
    a, b = f"a{i}.wav", f"b{i}.wav"
    if not (audio / a).exists():
        write_clip(audio / a, 1.0, 300.0 + 50 * i)
        write_clip(audio / b, 0.75, 500.0 + 50 * i)
    return a, b


def _nemo_records(audio_dir: Path, prefix: str = "") -> list[dict]:
    def au(v: str, text: str | None = None) -> dict:
        d = {"from": "User", "type": "audio", "value": prefix + v, "duration": 1.0 if v[0] == "a" else 0.75}
        return {**d, "text": text} if text else d

    def tx(role: str, v: str) -> dict:
        return {"from": role, "type": "text", "value": v}

    recs = []
    for i in range(COPIES):
        a, b = _clips(audio_dir, i)
        turns = {
            0: [au(a, T[0]), tx("User", INSTR), tx("Assistant", ANSWERS[0])],
            1: [au(a), tx("User", INSTR), tx("Assistant", ANSWERS[1])],
            2: [au(a), tx("User", QUESTION), tx("Assistant", ANSWERS[2])],
            3: [au(a), au(b), tx("User", "Transcribe both."), tx("Assistant", ANSWERS[3])],
            4: [au(a, T[4]), tx("User", "What is said first?"), tx("Assistant", "first"),
                au(b, T[5]), tx("User", "And then?"), tx("Assistant", ANSWERS[4])],
        }  # fmt: skip
        for k in KINDS:
            task = "qa" if k in (2, 4) else "asr"
            recs.append({"id": f"k{k}-{i}", "lang": "en", "task": task, "conversations": turns[k]})
    return recs


def _write_jsonl(path: Path, recs: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    return path


def _chat_records(audio_dir: Path, user: str, assistant: str, who: str, what: str, files: str, mark: str):
    recs = []
    for i in range(COPIES):
        a, b = _clips(audio_dir, i)
        turns = {
            0: ([a], [(user, f"{mark} {INSTR}"), (assistant, ANSWERS[0])]),
            1: ([a], [(user, f"{mark} {INSTR}"), (assistant, ANSWERS[1])]),
            2: ([a], [(user, f"{mark} {QUESTION}"), (assistant, ANSWERS[2])]),
            3: ([a, b], [(user, f"{mark} {mark} Transcribe both."), (assistant, ANSWERS[3])]),
            4: ([a, b], [(user, f"{mark} What is said first?"), (assistant, "first"),
                         (user, f"{mark} And then?"), (assistant, ANSWERS[4])]),
        }  # fmt: skip
        for k in KINDS:
            audios, conv = turns[k]
            task = "qa" if k in (2, 4) else "asr"
            recs.append({"id": f"k{k}-{i}", "lang": "en", "task": task, files: audios,
                         "conversations" if what == "value" else "messages":
                         [{who: r, what: t} for r, t in conv]})  # fmt: skip
    return recs


def _lhotse(root: Path) -> Path:
    from lhotse import CutSet, Recording, SupervisionSegment

    cuts = []
    for i in range(COPIES):
        a, b = _clips(root, i)
        for k in KINDS:
            cut = Recording.from_file(root / a, recording_id=f"rec-k{k}-{i}").to_cut()
            cut.id = f"k{k}-{i}"
            if k == 0:  # a plain ASR cut: its supervision is the transcript
                cut.supervisions = [SupervisionSegment(f"s{k}-{i}", cut.recording_id, 0.0, cut.duration,
                                                       text=T[0], language="en")]  # fmt: skip
            elif k in (1, 2):  # no supervision: custom prompt and answer
                cut.custom = {"task": "qa" if k == 2 else "asr", "lang": "en", "answer": ANSWERS[k],
                              "prompt": QUESTION if k == 2 else INSTR}  # fmt: skip
            else:  # a custom conversation: the cut itself ("" value) and a second file
                other = str((root / b).resolve())
                turns = _nemo_records(root)[k]["conversations"]  # copy 0's turns, re-pointed below
                turns = [
                    {**t, "value": "" if t["value"].startswith("a") else other} if t["type"] == "audio" else t
                    for t in turns
                ]
                cut.custom = {"conversation": turns, "task": "qa" if k == 4 else "asr", "lang": "en"}
            cuts.append(cut)
    path = root / "cuts.jsonl.gz"
    CutSet.from_cuts(cuts).to_file(path)
    return path


def _parquet(root: Path) -> Path:
    """Manifest columns: k0 a tagged transcript row; k1/k2 `prompt`/`target` (the other names of
    instruction/answer); k3/k4 a `conversation` JSON (speechlm's form)."""
    from speechlm.data.conversation import AudioRef, Clip, Conversation, Turn

    rows: dict[str, list] = {c: [] for c in ("audio_filepath", "duration", "text", "lang", "segment_id",
                                              "task", "prompt", "target", "conversation")}  # fmt: skip

    def add(seg: str, path: str, dur: float, text: str, task, prompt, target, conv) -> None:
        for c, v in zip(rows, (path, dur, text, "en", seg, task, prompt, target, conv)):
            rows[c].append(v)

    for i in range(COPIES):
        a, b = _clips(root, i)
        pa_, pb = str((root / a).resolve()), str((root / b).resolve())
        add(f"k0-{i}", pa_, 1.0, f"<|en|> {T[0]}", None, None, None, None)
        add(f"k1-{i}", pa_, 1.0, "", "asr", INSTR, ANSWERS[1], None)
        add(f"k2-{i}", pa_, 1.0, "", "qa", QUESTION, ANSWERS[2], None)
        clips3 = (Clip(pa_, duration=1.0), Clip(pb, duration=0.75))
        c3 = Conversation((Turn("user", (AudioRef(0), AudioRef(1), "Transcribe both.")),
                           Turn("assistant", (ANSWERS[3],))), clips3, "asr", "en", f"k3-{i}")  # fmt: skip
        clips4 = (Clip(pa_, duration=1.0, transcript=T[4]), Clip(pb, duration=0.75, transcript=T[5]))
        c4 = Conversation((Turn("user", (AudioRef(0), "What is said first?")), Turn("assistant", ("first",)),
                           Turn("user", (AudioRef(1), "And then?")), Turn("assistant", (ANSWERS[4],))),
                          clips4, "qa", "en", f"k4-{i}")  # fmt: skip
        add(f"k3-{i}", pa_, 1.75, "", None, None, None, c3.to_json())
        add(f"k4-{i}", pa_, 1.75, "", "qa", None, None, c4.to_json())
    n = len(rows["segment_id"])
    path = root / "conv.parquet"
    pq.write_table(pa.table({**rows, "shard_id": ["conv"] * n, "source": ["user"] * n}), path)
    return path


def write_format(fmt: str, root: Path) -> Path:
    """The corpus in `fmt` under `root` (made if missing); returns what `data.train_manifest` takes."""
    root.mkdir(parents=True, exist_ok=True)
    if fmt == "nemo":
        return _write_jsonl(root / "conv.jsonl", _nemo_records(root))
    if fmt == "nemo_tarred":
        out = root / "tarred"
        out.mkdir(exist_ok=True)
        recs = _nemo_records(root)
        with tarfile.open(out / "audio_0.tar", "w") as tar:
            for name in sorted(
                {t["value"] for r in recs for t in r["conversations"] if t["type"] == "audio"}
            ):
                tar.add(root / name, arcname=name)
        _write_jsonl(out / "manifest_0.jsonl", recs)
        return out
    if fmt == "sharegpt":
        path = root / "sharegpt.json"
        path.write_text(json.dumps(_chat_records(root, "human", "gpt", "from", "value", "sound", "<sound>")))
        return path
    if fmt == "swift":
        recs = _chat_records(root, "user", "assistant", "role", "content", "audios", "<audio>")
        return _write_jsonl(root / "swift.jsonl", recs)
    if fmt == "lhotse":
        return _lhotse(root)
    if fmt == "parquet":
        return _parquet(root)
    raise ValueError(fmt)
