"""Helpers of the conversation-format tests (issue 23, formats scope): two clips and one 2-turn, 2-clip
sample written in every format the readers know."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import numpy as np
import soundfile as sf

from speechlm.data.conversation import AudioRef, Clip, Conversation, Turn

SR = 16000
CLIP_SECONDS = {"a.wav": 0.5, "b.wav": 0.25}
Q1, A1, Q2, A2 = "What is said first?", "water", "And then?", "house"


def write_wav(path: Path, seconds: float, freq: float = 440.0) -> None:
    t = np.arange(int(round(SR * seconds))) / SR
    sf.write(path, (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32), SR, subtype="PCM_16")


def write_clips(root: Path) -> dict[str, Path]:
    root.mkdir(parents=True, exist_ok=True)
    out = {}
    for k, (name, seconds) in enumerate(CLIP_SECONDS.items()):
        write_wav(root / name, seconds, 300.0 + 200 * k)
        out[name] = root / name
    return out


def expected(clips: dict[str, Path], *, task: str = "qa", lang: str = "hi") -> Conversation:
    """The one internal conversation every format below reads to."""
    return Conversation(
        (
            Turn("user", (AudioRef(0), Q1)),
            Turn("assistant", (A1,)),
            Turn("user", (AudioRef(1), Q2)),
            Turn("assistant", (A2,)),
        ),
        tuple(Clip(str(clips[n].resolve()), duration=s) for n, s in CLIP_SECONDS.items()),
        task,
        lang,
        "s1",
    )


def nemo_turns(a: str, b: str) -> list[dict]:
    return [
        {"from": "User", "type": "audio", "value": a, "duration": CLIP_SECONDS["a.wav"]},
        {"from": "User", "type": "text", "value": Q1},
        {"from": "Assistant", "type": "text", "value": A1},
        {"from": "User", "type": "audio", "value": b, "duration": CLIP_SECONDS["b.wav"]},
        {"from": "User", "type": "text", "value": Q2},
        {"from": "Assistant", "type": "text", "value": A2},
    ]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


def nemo_conversation_jsonl(root: Path) -> Path:
    rec = {"id": "s1", "task": "qa", "lang": "hi", "conversations": nemo_turns("a.wav", "b.wav")}
    return write_jsonl(root / "nemo_conv.jsonl", [rec])


def _chat_record(audio_key: str, turns_key: str, who: str, what: str, roles: tuple, marks: tuple) -> dict:
    """The sample in a ShareGPT-like form: `roles` (user, assistant), `marks` the placeholder of each clip."""
    (user, assistant), (m1, m2) = roles, marks
    turns = [(user, f"{m1}{Q1}"), (assistant, A1), (user, f"{m2}{Q2}"), (assistant, A2)]
    record = {"id": "s1", "task": "qa", "lang": "hi", audio_key: ["a.wav", "b.wav"]}
    return {**record, turns_key: [{who: r, what: t} for r, t in turns]}


def sharegpt_json(root: Path) -> Path:
    """ShareGPT (NeMo's share_gpt, LLaVA): a JSON list, `sound`, `<sound>`/`<speech>` placeholders."""
    rec = _chat_record(
        "sound", "conversations", "from", "value", ("human", "gpt"), ("<sound>\n", "<speech> ")
    )
    path = root / "sharegpt.json"
    path.write_text(json.dumps([rec], ensure_ascii=False), encoding="utf-8")
    return path


def swift_messages_jsonl(root: Path) -> Path:
    """ms-swift: JSON lines of `messages` with role/content, `audios`, `<audio>` placeholders."""
    rec = _chat_record("audios", "messages", "role", "content", ("user", "assistant"), ("<audio>", "<audio>"))
    return write_jsonl(root / "swift.jsonl", [rec])


def manifest_row_jsonl(root: Path, conv: Conversation) -> Path:
    """A NeMo-style manifest line carrying the canonical ``conversation`` (relative clip paths)."""
    doc = json.loads(conv.to_json())
    for c in doc["clips"]:
        c["path"] = Path(c["path"]).name
    rec = {"audio_filepath": "a.wav", "duration": 0.75, "task": "qa", "conversation": json.dumps(doc)}
    return write_jsonl(root / "rows.jsonl", [rec])


def nemo_conversation_tarred(root: Path, clips: dict[str, Path]) -> Path:
    """NeMo's tarred form: manifest_0.jsonl + audio_0.tar (members named by the audio values)."""
    out = root / "tarred"
    out.mkdir()
    with tarfile.open(out / "audio_0.tar", "w") as tar:
        for name, path in clips.items():
            tar.add(path, arcname=name)
    rec = {"id": "s1", "task": "qa", "lang": "hi", "conversations": nemo_turns("a.wav", "b.wav")}
    write_jsonl(out / "manifest_0.jsonl", [rec])
    return out


def lhotse_cuts(root: Path, clips: dict[str, Path]) -> Path:
    """One cut over a.wav whose custom ``conversation`` refers to itself (empty value) and to b.wav."""
    from lhotse import CutSet, Recording

    cut = Recording.from_file(clips["a.wav"], recording_id="rec-a").to_cut()
    cut.id = "s1"
    turns = nemo_turns("", str(clips["b.wav"]))
    cut.custom = {"conversation": turns, "task": "qa", "lang": "hi"}
    path = root / "cuts.jsonl.gz"
    CutSet.from_cuts([cut]).to_file(path)
    return path


def full_and_resumed_metrics(run_train, base: list[str], tmp_path: Path, *, steps: int, stop: int) -> tuple:
    """Train `steps` steps in one go, and `stop` steps + a checkpoint then resumed to `steps`: the two
    runs' metrics (`helpers.read_train_metrics`) to compare, and the first run's stdout."""
    from helpers import read_train_metrics

    runs = (
        [f"trainer.max_steps={steps}", f"trainer.run_dir={tmp_path / 'full'}"],
        [f"trainer.max_steps={stop}", f"trainer.ckpt_every={stop}", f"trainer.run_dir={tmp_path / 'p'}"],
        [f"trainer.max_steps={steps}", f"trainer.run_dir={tmp_path / 'p'}", "trainer.resume=auto"],
    )
    outs = []
    for args in runs:
        r = run_train([*base, *args])
        assert r.returncode == 0, r.stderr[-3000:]
        outs.append(r.stdout)
    return read_train_metrics(tmp_path / "full"), read_train_metrics(tmp_path / "p"), outs[0]
