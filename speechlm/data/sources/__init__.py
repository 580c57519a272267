"""Data sources beyond one file per utterance: tar shards (ours, NeMo tarred, Lhotse Shar, WeNet),
Lhotse cuts with offsets, and the positional reads of their members.

- `tar_index`: the (offset, size) of every member of a tar, scanned once and cached with a fingerprint;
- `members`: `MemberReader` (positional, header-checked reads) and `decode_audio`;
- `report`: `SourceReport` (what indexing dropped, per shard and reason);
- `join`: tar rows joined to their members (`locate_members`, `with_tar_locators`);
- `shards`: ``speechlm shards write`` and its reader;
- `detect`: `detect_source_type` and `load_source`, the one entry from any path to a manifest table.

Imports run one way: members, report and tar_index use nothing here; join uses report and tar_index;
shards uses join; detect uses shards, the manifest readers (`manifest.load`, `manifest.nemo`) and the
registered readers; mmap_cache uses detect. None of them imports torch.
"""
