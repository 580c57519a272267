"""`data.input_cfg`: weighted, nested dataset mixes (`speechlm.data.sources.input_cfg`, `sampler.mix`).

Covers: shares from weights down nested groups, by utterance count where a level gives none; the
planned shares of an epoch meet the targets; bad entries (weight 0 or negative, unknown key, missing
path, empty group, weights on some siblings only, duplicate names) are errors naming the entry; the
mixed table reads clips from every dataset kind; resume mid-epoch gives the same batches and a
changed mix is refused; exhaustive mode refuses weights.
"""

from __future__ import annotations

import numpy as np
import pytest

from speechlm.cli import main
from speechlm.data.dataset import Sample, SpeechDataset
from speechlm.data.manifest import ManifestError, manifest_arrays
from speechlm.data.sampler import DurationBucketBatchSampler, SamplerSettings, build_epoch_plan
from speechlm.data.sources.input_cfg import (
    compute_shares,
    leaves,
    load_input_cfg,
    mix_of_table,
    parse_input_cfg,
)
from speechlm.data.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def sources(demo_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("mix")
    argv = ["shards", "write", demo_data["train"], "--out", str(out / "tars"), "--shard-size", "60"]
    assert main([*argv, "--skip-bad-audio"]) == 0  # the demo's non-audio file is not packed: 220 rows
    return {"files": demo_data["train"], "tars": str(out / "tars"), "val": demo_data["val"]}


def _cfg(s):
    return [
        {"path": s["files"], "name": "files", "weight": 1},
        {
            "group": "more",
            "weight": 3,
            "inputs": [{"path": s["tars"], "name": "tars"}, {"path": s["val"], "name": "val"}],
        },
    ]


def test_shares_follow_weights_down_groups_and_sizes_where_none_given(sources):
    tree = parse_input_cfg(_cfg(sources))
    shares = compute_shares(tree, {"files": 221, "tars": 221, "val": 12})
    assert shares["files"] == pytest.approx(0.25)
    assert shares["tars"] == pytest.approx(0.75 * 221 / 233)  # no weights inside the group: by size
    assert shares["val"] == pytest.approx(0.75 * 12 / 233)
    weighted = _cfg(sources)
    weighted[1]["inputs"][0]["weight"], weighted[1]["inputs"][1]["weight"] = 1, 1
    shares = compute_shares(parse_input_cfg(weighted), {"files": 221, "tars": 221, "val": 12})
    assert shares["tars"] == shares["val"] == pytest.approx(0.375)


def test_planned_shares_meet_the_targets_and_the_table_reads_every_kind(demo_data, sources):
    table = load_input_cfg(_cfg(sources))
    mix = mix_of_table(table)
    assert mix.names == ("files", "tars", "val") and len(table) == 221 + 220 + 12
    arr = manifest_arrays(table)
    s = SamplerSettings(max_batch_duration=30.0, epoch_size=4000)
    plan = build_epoch_plan(arr.durations, arr.lang_codes, s, 0, n_langs=len(arr.lang_names), mix=mix)
    rows = plan.rank_rows(0)[0]
    planned = np.bincount(mix.dataset_codes[rows], minlength=3) / len(rows)
    np.testing.assert_allclose(planned, mix.shares, atol=0.02)  # the lockstep trim moves a few rows
    ds = SpeechDataset(table, Tokenizer(demo_data["tok"]))
    tar_row = int(np.flatnonzero(mix.dataset_codes == 1)[0])
    assert ds.resolve_path(tar_row).as_posix().split(":")[0].endswith(".tar")
    assert isinstance(ds[tar_row], Sample) and isinstance(
        ds[int(np.flatnonzero(mix.dataset_codes == 2)[0])], Sample
    )


def test_resume_with_a_mix_and_a_changed_mix_is_refused(sources):
    table = load_input_cfg(_cfg(sources))
    arr = manifest_arrays(table)

    def sampler(mix):
        s = SamplerSettings(dp_size=2, grad_accum=2, max_batch_duration=20.0)
        return DurationBucketBatchSampler(
            arr.durations, arr.lang_codes, arr.lang_names, s, dp_rank=1, mix=mix
        )

    mix = mix_of_table(table)
    straight = list(sampler(mix))
    first = sampler(mix)
    it = iter(first)
    for _ in range(3):
        next(it)
    resumed = sampler(mix)
    resumed.load_state_dict(first.state_dict())
    assert list(resumed) == straight[3:]
    other = load_input_cfg([{**e, "weight": 5} if "path" in e else e for e in _cfg(sources)])
    with pytest.raises(ValueError, match="params.mix"):
        sampler(mix_of_table(other)).load_state_dict(first.state_dict())
    with pytest.raises(ValueError, match="need sampler.mode=temperature"):
        build_epoch_plan(arr.durations, arr.lang_codes, SamplerSettings(mode="exhaustive"), 0, mix=mix)


@pytest.mark.parametrize(
    "entry, message",
    [
        ({"path": "P", "weight": 0}, r"\[0\].weight=0: a weight must be a number > 0"),
        ({"path": "P", "weight": -1}, r"weight=-1"),
        ({"path": "P", "wieght": 2}, r"\[0\]: unknown key 'wieght'"),
        ({"path": "/nonexistent/x.parquet"}, r"\[0\]: path /nonexistent/x.parquet does not exist"),
        ({"group": "g", "inputs": []}, r"group 'g'\) needs a non-empty list 'inputs'"),
        ({"name": "x"}, r"neither 'path'"),
        ({"path": "P", "type": "tarball"}, r"type='tarball'"),
    ],
)
def test_bad_entries_name_the_entry(sources, entry, message):
    entry = {k: (sources["files"] if v == "P" else v) for k, v in entry.items()}
    with pytest.raises(ManifestError, match=message):
        parse_input_cfg([entry, {"path": sources["val"]}])


def test_weights_on_some_siblings_only_and_duplicate_names(sources):
    with pytest.raises(ManifestError, match=r"data.input_cfg\[1\] has no weight while its siblings"):
        compute_shares(parse_input_cfg([{"path": sources["files"], "weight": 1}, {"path": sources["val"]}]), {
            sources["files"]: 1, sources["val"]: 1})  # fmt: skip
    with pytest.raises(ManifestError, match="two datasets 'a'"):
        load_input_cfg([{"path": sources["files"], "name": "a"}, {"path": sources["val"], "name": "a"}])


def test_input_cfg_from_a_yaml_file_and_exclusive_with_train_manifest(sources, tmp_path):
    import yaml

    from speechlm.config import ConfigError, load_config

    f = tmp_path / "mix.yaml"
    f.write_text(yaml.safe_dump(_cfg(sources)))
    assert mix_of_table(load_input_cfg(str(f))).names == ("files", "tars", "val")
    with pytest.raises(ConfigError, match="are both set"):
        load_config(None, [f"data.input_cfg={f}", "data.train_manifest=x.parquet"])


def test_read_mode_per_dataset(sources):
    from speechlm.config import ExperimentConfig
    from speechlm.data.sampler.build import streaming_layout

    cfg = ExperimentConfig()
    entries = [{"path": sources["files"], "name": "files"}, {"path": sources["tars"], "name": "tars"}]
    table = load_input_cfg(entries)
    assert streaming_layout(cfg, table) is None  # every dataset indexed
    entries[1]["read_mode"] = "streaming"
    table = load_input_cfg(entries)
    layout = streaming_layout(cfg, table)
    codes = mix_of_table(table).dataset_codes
    assert np.all(layout.shard_codes[codes == 0] == -1)  # plain files: spread
    assert len(np.unique(layout.shard_codes[codes == 1])) == 4  # 220 rows in tars of 60: read front to back
    cfg.data.read_mode = "streaming"
    entries[1]["read_mode"], entries[0]["read_mode"] = "indexed", "streaming"
    table = load_input_cfg(entries)
    layout = streaming_layout(cfg, table)
    assert np.all(layout.shard_codes[mix_of_table(table).dataset_codes == 1] == -1)  # the tars, indexed
    with pytest.raises(ManifestError, match="read_mode='random'"):
        parse_input_cfg([{"path": sources["files"], "read_mode": "random"}])


def _data_md_input_cfg(tmp_path):
    """docs/data.md's `data.input_cfg` YAML block as written, its /data/... paths made to exist."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "data.md").read_text(encoding="utf-8")
    block = re.search(r"```yaml\n(data:\n  input_cfg:\n.*?)```", text, re.S)
    assert block is not None, "docs/data.md no longer shows the data.input_cfg block"
    for path in re.findall(r"path: (/data/[^,}]+)", block.group(1)):
        target = tmp_path / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.touch()
    return block.group(1).replace("path: /data/", f"path: {tmp_path}/data/")


def test_the_yaml_form_of_data_md_is_read_as_a_file_and_in_a_config(tmp_path):
    """issue 21: docs/data.md shows `data: input_cfg: [...]`; saved as mix.yaml for `--input-cfg` or
    `data.input_cfg=mix.yaml` it was refused ('must be a non-empty list'). A file holding a list (NeMo's
    input_cfg file), `input_cfg: [...]` (NeMo's key) or `data: input_cfg: [...]` all give one tree."""
    import yaml

    from speechlm.config import load_config

    form = _data_md_input_cfg(tmp_path)
    entries = yaml.safe_load(form)["data"]["input_cfg"]
    files = {
        "config.yaml": form,
        "key.yaml": yaml.safe_dump({"input_cfg": entries}),
        "list.yaml": yaml.safe_dump(entries),
    }
    trees = []
    for name, text in files.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
        trees.append(parse_input_cfg(str(tmp_path / name)))
    assert all([leaf.name for leaf in leaves(t)] == ["en_read", "cv_hi", "shrutilipi"] for t in trees)
    assert all(leaves(t)[2].tags == ("broadcast",) and leaves(t)[1].type == "nemo_tarred" for t in trees)
    cfg = load_config(str(tmp_path / "config.yaml"), [])  # the block as a config: unchanged
    assert [leaf.name for leaf in leaves(parse_input_cfg(cfg.data.input_cfg))] == [
        "en_read",
        "cv_hi",
        "shrutilipi",
    ]


def test_a_yaml_file_of_something_else_names_the_forms_it_takes(sources, tmp_path):
    import yaml

    f = tmp_path / "mix.yaml"
    f.write_text(yaml.safe_dump({"data": {"input_cfg": _cfg(sources), "tokenizer": "x.model"}}))
    with pytest.raises(ManifestError, match=r"mix.yaml: .*a list of datasets.*input_cfg: \[\.\.\.\]"):
        parse_input_cfg(str(f))


def test_tags_as_a_mapping_as_nemo_writes_them(sources):
    tree = parse_input_cfg([{"path": sources["files"], "tags": {"lang": "en", "task": "asr"}}])
    assert leaves(tree)[0].tags == ("lang=en", "task=asr")
    with pytest.raises(ManifestError, match=r"tags=3: give a list of strings or a mapping"):
        parse_input_cfg([{"path": sources["files"], "tags": 3}])
