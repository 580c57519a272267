"""Data sources beyond one file per utterance: tar shards (ours, NeMo tarred, Lhotse Shar, WeNet),
Lhotse cuts with offsets, and the positional reads of their members.

- `tar_index`: the (offset, size) of every member of a tar, scanned once and cached with a fingerprint;
- `members`: `MemberReader` (positional, header-checked reads) and `decode_audio`;
- `shards`: ``speechlm shards write`` and its reader, `SourceReport` (what indexing dropped);
- `detect`: `detect_source_type` and `load_source`, the one entry from any path to a manifest table.

Imports run one way: members and tar_index use nothing here; shards uses tar_index; detect uses shards
and the registered readers. None of them imports torch.
"""
