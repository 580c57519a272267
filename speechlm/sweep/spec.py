"""Sweep specs: a base config, shared overrides, a grid and explicit jobs → a job matrix on disk.

A spec (YAML)::

    base: configs/demo.yaml          # a config path (relative to the spec file or the working dir)
    overrides: [trainer.max_steps=2000, trainer.val_every=200]   # or a mapping key: value
    grid:                            # the product of these value lists
      sampler.temperature: [0.3, 0.5]
      trainer.seed: [0, 1, 2]
    jobs:                            # added to the grid's jobs
      - {name: no-ctc, overrides: {model.ctc_weight: 0}}
    gpus_per_job: 1

`write_sweep` resolves every job's config with the same code as `speechlm train` (YAML + dotted
overrides, unknown keys are errors), so a job's `jobs/<id>/config.yaml` is the whole config and
`speechlm train SWEEP_DIR/jobs/<id>/config.yaml` runs it by hand unchanged. Job ids are made from the
job's values (`sampler.temperature=0.3,trainer.seed=1` → `temperature-0.3_seed-1`), so they are stable
across re-inits: running `init` again on the same directory adds new jobs as `queued` and keeps the
state of the jobs it already has.
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from speechlm.config import SWEEP_SPEC_KEYS, ConfigError, is_override, load_config, to_dict
from speechlm.sweep.store import StatusStore, write_json_atomic

SPEC_KEYS = SWEEP_SPEC_KEYS
JOB_KEYS = ("name", "overrides")
# config paths that a job reads: made absolute at init so a job runs from any working directory
PATH_KEYS = ("data.train_manifest", "data.val_manifest", "data.tokenizer")


class SpecError(ValueError):
    """A sweep spec or job matrix that cannot be used; the message names the file and the key."""


@dataclass
class Job:
    id: str
    overrides: list[str]  # the job's own dotted overrides (after the spec's shared ones)
    axes: dict[str, Any] = field(default_factory=dict)  # grid key -> value (empty for explicit jobs)


@dataclass
class Spec:
    base: Path | None
    overrides: list[str]
    jobs: list[Job]
    gpus_per_job: int = 1


def format_override(key: str, value: Any) -> str:
    """`key=value` with a non-string value as JSON (valid YAML), so `apply_override` reads it back unchanged."""
    return f"{key}={value if isinstance(value, str) else json.dumps(value)}"


def _overrides_of(value: Any, where: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, dict):
        return [format_override(str(k), v) for k, v in value.items()]
    if isinstance(value, list) and all(isinstance(v, str) and is_override(v) for v in value):
        return list(value)
    raise SpecError(f"{where} must be a mapping of dotted keys to values or a list of KEY=VALUE strings")


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-") or "job"


def grid_job_id(axes: dict[str, Any]) -> str:
    """`{"sampler.temperature": 0.3, "trainer.seed": 1}` → `temperature-0.3_seed-1`."""
    parts = []
    for key, value in axes.items():
        shown = value if isinstance(value, str) else json.dumps(value)
        parts.append(f"{key.rsplit('.', 1)[-1]}-{slug(str(shown))}")
    return "_".join(parts) or "base"


def load_spec(path: str | Path) -> Spec:
    """Read and check a spec; every error names the file and the key."""
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except OSError as e:
        raise SpecError(f"{p}: cannot read the sweep spec ({e.strerror or e})") from None
    except yaml.YAMLError as e:
        raise SpecError(f"{p}: not valid YAML ({e})") from None
    if not isinstance(data, dict):
        raise SpecError(f"{p}: the top level must be a mapping with keys {', '.join(SPEC_KEYS)}")
    unknown = sorted(set(data) - set(SPEC_KEYS))
    if unknown:
        raise SpecError(f"{p}: unknown key '{unknown[0]}'; valid keys are: {', '.join(SPEC_KEYS)}")
    base = data.get("base")
    base_path = None
    if base is not None:
        base_path = Path(str(base))
        if not base_path.is_absolute() and not base_path.exists() and (p.parent / base_path).exists():
            base_path = p.parent / base_path
    gpus = data.get("gpus_per_job", 1)
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1:
        raise SpecError(f"{p}: 'gpus_per_job' must be a whole number >= 1, got {gpus!r}")
    shared = _overrides_of(data.get("overrides"), f"{p}: 'overrides'")

    jobs: list[Job] = []
    grid = data.get("grid") or {}
    if not isinstance(grid, dict):
        raise SpecError(f"{p}: 'grid' must be a mapping of dotted keys to lists of values")
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise SpecError(f"{p}: grid key '{key}' must have a non-empty list of values, got {values!r}")
    if grid:
        keys = list(grid)
        for combo in itertools.product(*(grid[k] for k in keys)):
            axes = dict(zip(keys, combo))
            jobs.append(Job(grid_job_id(axes), [format_override(k, v) for k, v in axes.items()], axes))
    explicit = data.get("jobs") or []
    if not isinstance(explicit, list):
        raise SpecError(f"{p}: 'jobs' must be a list of {{name, overrides}}")
    for i, entry in enumerate(explicit):
        where = f"{p}: jobs[{i}]"
        if not isinstance(entry, dict) or "name" not in entry:
            raise SpecError(f"{where} must be a mapping with a 'name' (and optional 'overrides')")
        bad = sorted(set(entry) - set(JOB_KEYS))
        if bad:
            raise SpecError(f"{where}: unknown key '{bad[0]}'; valid keys are: {', '.join(JOB_KEYS)}")
        jobs.append(
            Job(slug(str(entry["name"])), _overrides_of(entry.get("overrides"), f"{where}.overrides"))
        )
    if not jobs:
        jobs.append(Job("base", []))
    seen: dict[str, int] = {}
    for job in jobs:
        if job.id in seen:
            raise SpecError(f"{p}: two jobs have the id '{job.id}'; give explicit jobs distinct names")
        seen[job.id] = 1
    return Spec(base_path, shared, jobs, gpus)


def resolve_job_config(spec: Spec, job: Job, run_dir: Path) -> dict[str, Any]:
    """The job's whole config as `speechlm train` would build it, with its run dir and resume=auto."""
    overrides = [*spec.overrides, *job.overrides, f"trainer.run_dir={run_dir}", "trainer.resume=auto"]
    try:
        cfg = load_config(spec.base, overrides)
    except ConfigError as e:
        raise SpecError(f"job '{job.id}': {e}") from None
    out = to_dict(cfg)
    for dotted in PATH_KEYS:
        section, key = dotted.split(".")
        value = out[section].get(key)
        if value and not Path(value).is_absolute() and Path(value).exists():
            out[section][key] = str(Path(value).resolve())
    return out


def write_sweep(spec: Spec, sweep_dir: Path) -> dict[str, Any]:
    """Write matrix.json and one resolved config + run dir per job; returns the matrix.

    Jobs already in an existing matrix keep their entry; their config is rewritten only if it changed
    (a changed config of a job that already ran is refused: give the new variant its own name)."""
    sweep_dir.mkdir(parents=True, exist_ok=True)
    matrix_path = sweep_dir / "matrix.json"
    old: dict[str, Any] = {}
    if matrix_path.exists():
        old = {j["id"]: j for j in read_matrix(sweep_dir)["jobs"]}
    store = StatusStore(sweep_dir)
    entries = []
    for job in spec.jobs:
        job_dir = sweep_dir / "jobs" / job.id
        run_dir = (job_dir / "run").resolve()
        text = yaml.safe_dump(resolve_job_config(spec, job, run_dir), sort_keys=False)
        cfg_path = job_dir / "config.yaml"
        if job.id in old and cfg_path.exists() and cfg_path.read_text() != text and run_dir.exists():
            raise SpecError(
                f"job '{job.id}' already ran with another config ({cfg_path}); give the changed job a new "
                f"name, or remove {job_dir} to start it over"
            )
        job_dir.mkdir(parents=True, exist_ok=True)
        cfg_path.write_text(text)
        entries.append(
            {
                "id": job.id,
                "overrides": [*spec.overrides, *job.overrides],
                "axes": job.axes,
                "config": str(cfg_path.relative_to(sweep_dir)),
                "run_dir": str(Path("jobs") / job.id / "run"),
                "log": str(Path("jobs") / job.id / "train.log"),
                "gpus": spec.gpus_per_job,
            }
        )
    kept = [j for jid, j in old.items() if jid not in {e["id"] for e in entries}]
    matrix: dict[str, Any] = {
        "version": 1,
        "base": str(spec.base) if spec.base else None,
        "jobs": kept + entries,
    }
    write_json_atomic(matrix_path, matrix)
    store.add_jobs([e["id"] for e in matrix["jobs"]])
    return matrix


def read_matrix(sweep_dir: Path) -> dict[str, Any]:
    path = sweep_dir / "matrix.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise SpecError(
            f"{path}: no job matrix here; create it with `speechlm sweep init SPEC --out {sweep_dir}`"
        ) from None
    except json.JSONDecodeError as e:
        raise SpecError(f"{path}: not valid JSON ({e}); re-create it with `speechlm sweep init`") from None
    if not isinstance(data, dict) or not isinstance(data.get("jobs"), list):
        raise SpecError(
            f"{path}: expected an object with a 'jobs' list; re-create it with `speechlm sweep init`"
        )
    return data
