"""Reading a job spec: YAML, ``--set`` overrides, validation, and this machine's paths.

    spec = load_job_spec("jobs/quickstart.yaml", ["train.steps=20", "parallel.cp=2"])
    spec = parse_job_spec({"parallel": {"cp": 2}})     # plain data, no file, no path checks

Checks that look at this machine (``data.path`` exists, output directories can be created)
run here, not in the schema, so a spec meant for another machine still parses
(``check_paths=False``, as ``ringray submit`` uses).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import yaml
from pydantic import ValidationError

from ringray.spec.errors import describe_yaml_error, format_validation_error, load_yaml
from ringray.spec.schema import JobSpec, JobSpecError
from ringray.train import TrainOptions


def _set_dotted(data: dict, dotted: str, value: object) -> None:
    """Set ``data[a][b]... = value`` for ``dotted`` ``a.b...``. A mapping given for a section
    merges into it (``train={steps: 3}`` changes train.steps and keeps the section's other
    fields, as ``train.steps=3`` does); ``null`` for a field restores its default."""
    *parents, leaf = dotted.split(".")
    node = data
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise JobSpecError(f"{dotted}: {part!r} is not a section")
        node = child
    if isinstance(value, dict) and isinstance(node.get(leaf), dict):
        for key, item in value.items():
            _set_dotted(node, f"{leaf}.{key}", item)
        return
    node[leaf] = value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply ``section.key=value`` overrides (values parsed as YAML: ``4``, ``true``, ``null``)."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise JobSpecError(f"--set {item!r}: expected section.key=value")
        if not all(part.strip() for part in key.split(".")):
            raise JobSpecError(f"--set {item!r}: a field name has an empty part; expected "
                               f"section.key=value, e.g. train.steps=3")
        try:
            value = load_yaml(raw)
        except yaml.YAMLError as exc:
            raise JobSpecError(f"--set {item!r}: the value is not valid YAML "
                               f"({describe_yaml_error(exc)})") from None
        _set_dotted(data, key.strip(), value)
    return data


def parse_job_spec(data: dict) -> JobSpec:
    """Validate a spec given as plain data (no look at this machine's files)."""
    try:
        spec = JobSpec.model_validate(data)
    except ValidationError as exc:
        raise JobSpecError(format_validation_error(exc, JobSpec)) from None
    check_task_names(spec.eval.tasks)
    return spec


def check_task_names(tasks: Sequence[str]) -> None:
    """Raise :class:`JobSpecError` (one line) for a name in ``eval.tasks`` that is no task
    a job runs: unknown, or one that downloads its data (a job's workers may have no
    network; ``ringray eval`` skips those with a line)."""
    from ringray.harness.ruler import DOWNLOADING_TASKS, OFFLINE_TASKS

    valid = ", ".join(OFFLINE_TASKS)
    for name in tasks:
        if name in DOWNLOADING_TASKS:
            raise JobSpecError(f"eval.tasks: {name} downloads {DOWNLOADING_TASKS[name]}; a "
                               f"job runs the tasks that need no download: {valid}")
        if name not in OFFLINE_TASKS:
            raise JobSpecError(f"eval.tasks: {name!r} is not a task that runs offline; valid: "
                               f"{valid}")


def task_length_limit(options: TrainOptions) -> tuple[int, str, bool]:
    """``(the longest eval.task_lengths the trained model takes, why, whether its RoPE is
    scaled)``: the positions its export declares (``train.seq_len``, or the pretrained
    checkpoint's ``max_position_embeddings`` when larger), or what the model's RoPE scaling
    reaches."""
    from ringray.train.export import exported_positions

    positions = exported_positions(options)
    where = (f"train.seq_len {positions}" if positions == options.train.seq_len else
             f"max_position_embeddings {positions} of model.from_pretrained")
    scaling = options.model.rope_scaling
    if scaling.kind == "none":
        return positions, where, False
    original = scaling.original_max_position_embeddings or positions
    reach = int(original * scaling.factor)
    if reach > positions:
        return reach, f"{original} x model.rope.factor {scaling.factor:g}", True
    return positions, where, True


def check_eval_tasks(options: TrainOptions) -> None:
    """Raise :class:`JobSpecError` (one line) unless this machine can run the job's
    ``eval.tasks`` after training: lm_eval and RULER's generators installed, every length
    within the model's position limit (:func:`task_length_limit`), and every (task, length)
    cell buildable with the model's tokenizer (ruler_vt never finishes with a byte-level
    one). Refused here, not after the training."""
    evaluation = options.eval
    if not evaluation.tasks:
        return
    from ringray.harness.ruler import (
        CellNotBuilt,
        check_buildable,
        missing_packages,
        needs_tokenizer,
    )

    missing = missing_packages()
    if missing:
        raise JobSpecError(f"eval.tasks: {', '.join(missing)} not installed: the job's "
                           f"evaluation runs them with lm_eval; pip install 'ringray[eval]'")
    try:
        limit, where, scaled = task_length_limit(options)
    except (OSError, ValueError) as exc:
        raise JobSpecError(f"model.from_pretrained: {' '.join(str(exc).split())}") from None
    longest = max(evaluation.task_lengths)
    if longest > limit:
        remedy = (f"set model.rope.scaling: yarn with model.rope.factor: "
                  f"{max(2, -(-longest // limit))}" if not scaled else
                  "raise model.rope.factor")
        raise JobSpecError(f"eval.task_lengths: {longest} is past the trained model's "
                           f"position limit {limit} ({where}); {remedy}, or give lengths up "
                           f"to {limit}")
    cells = [(task, length) for task in evaluation.tasks for length in evaluation.task_lengths
             if needs_tokenizer(task, length)]
    if not cells or (options.pretrained is not None and "://" in options.pretrained):
        return  # nothing to measure, or a remote tokenizer: the export's is checked when made
    tokenizer = _task_tokenizer(options)
    try:
        for task, length in cells:
            check_buildable(task, length, tokenizer)
    except CellNotBuilt as exc:
        raise JobSpecError(f"eval.tasks: {exc}") from None


def _task_tokenizer(options: TrainOptions):
    """The tokenizer the trained model's export carries, as lm_eval loads it."""
    import transformers

    if options.pretrained is not None:
        return transformers.AutoTokenizer.from_pretrained(options.pretrained)
    from ringray.data import ByteTokenizer

    with tempfile.TemporaryDirectory(prefix="ringray-tokenizer-") as directory:
        ByteTokenizer().save_hf(directory)
        return transformers.AutoTokenizer.from_pretrained(directory)


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_output_dir(field: str, location: str) -> None:
    """A local directory that exists and takes new files, or whose nearest existing ancestor
    takes new directories. Tried for real (a temporary entry made and removed at once):
    permission bits say nothing for root or a pseudo-filesystem such as /proc, where the
    write failed only at the first save, after the training."""
    path = Path(location).absolute()
    if path.exists():
        if not path.is_dir():
            raise JobSpecError(f"{field}: {location!r} is a file; give a directory")
        why = _cannot_write(path)
        if why:
            raise JobSpecError(f"{field}: {location!r} is not writable ({why}); give a "
                               f"directory you can write to")
        return
    ancestor = _nearest_existing(path.parent)
    if not ancestor.is_dir():
        raise JobSpecError(f"{field}: {location!r} cannot be created: {ancestor} is a file; "
                           f"give a path under a directory")
    why = _cannot_write(ancestor)
    if why:
        raise JobSpecError(f"{field}: {location!r} cannot be created: {ancestor} is not "
                           f"writable ({why}); give a path under a directory you can write to")


def _cannot_write(directory: Path) -> str | None:
    """Why a new entry cannot be made in ``directory`` (None when one can): a temporary
    directory is made there and removed."""
    try:
        probe = tempfile.mkdtemp(prefix=".ringray-probe-", dir=directory)
    except OSError as exc:
        return (exc.strerror or str(exc)).lower()
    os.rmdir(probe)
    return None


def check_local_paths(spec: JobSpec) -> None:
    """Raise :class:`JobSpecError` unless this machine has ``data.path`` (a directory holding
    at least one document) and can create the run and local checkpoint directories. Relative
    paths are from the current directory, as the trainer reads them."""
    if spec.data.source == "files" and spec.data.path:
        path = Path(spec.data.path)
        if not path.exists():
            raise JobSpecError(f"data.path: {spec.data.path!r} does not exist (from "
                               f"{Path.cwd()}); give a directory of .txt/.jsonl files")
        if not path.is_dir():
            raise JobSpecError(f"data.path: {spec.data.path!r} is a file; give the directory "
                               f"that holds the .txt/.jsonl files")
        check_data(spec.data.path)
    options = spec.train_options()
    if options.pretrained is not None:
        check_pretrained(options)
    check_eval_tasks(options)
    check_output_dir("run_dir", options.run_dir)
    if "://" not in options.checkpoint_location:
        field = "checkpoint.path" if spec.checkpoint.path else "run_dir"
        check_output_dir(field, options.checkpoint_location)


def check_data(path: str) -> None:
    """Raise :class:`JobSpecError` (one line) unless the directory ``path`` holds a document
    (reading only up to the first), so an empty corpus is found before any worker starts."""
    from ringray.data import check_data_path

    try:
        check_data_path(path)
    except ValueError as exc:  # "path: ..." or "FILE:LINE: ..." (a bad JSONL line)
        raise JobSpecError(f"data.path: {str(exc).removeprefix('path: ')}") from None
    except OSError as exc:  # an unreadable file or directory under it
        raise JobSpecError(f"data.path: {exc}") from None


def check_pretrained(options: TrainOptions) -> None:
    """Raise :class:`JobSpecError` (one line) unless ``model.from_pretrained`` holds every
    tensor the model needs, with its shape (safetensors headers only, no weights read), and a
    tokenizer with an end-of-sequence token that fits the model's vocabulary and the job's
    passkey lengths. Run before anything starts, so a bad checkpoint starts no training."""
    from ringray.data import HFTokenizer
    from ringray.model import check_hf_weights
    from ringray.train.options import check_token_budget

    where = f"model.from_pretrained: {options.pretrained}"
    try:
        check_hf_weights(options.model, options.pretrained)
        tokenizer = HFTokenizer.from_pretrained(options.pretrained)
    except ValueError as exc:  # names the file and what is wrong with it
        raise JobSpecError(f"model.from_pretrained: {exc}") from None
    except OSError as exc:  # may not name the checkpoint (a remote filesystem's errors)
        raise JobSpecError(f"{where}: {exc}") from None
    if tokenizer.vocab_size > options.model.vocab_size:
        raise JobSpecError(f"{where}: its tokenizer has {tokenizer.vocab_size} tokens, more "
                           f"than the model's vocab_size {options.model.vocab_size}")
    try:
        check_token_budget(options, tokenizer)
    except ValueError as exc:
        raise JobSpecError(f"{exc} (in this model's tokenizer)") from None


def load_job_spec(
    path: str | Path, overrides: list[str] | None = None, *, check_paths: bool = True
) -> JobSpec:
    """Read, override and validate a YAML job spec.

    ``check_paths``: also check this machine's paths (:func:`check_local_paths`); leave it
    off for a spec that will run elsewhere (``ringray submit`` to a remote cluster).

    Raises:
        JobSpecError: naming the file, or each invalid field and what would be valid.
    """
    path = Path(path)
    try:
        data = load_yaml(path.read_text()) or {}
    except OSError as exc:
        raise JobSpecError(f"{path}: cannot read the job spec ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise JobSpecError(f"{path}: not UTF-8 text (byte {exc.start}: "
                           f"{exc.object[exc.start:exc.start + 1]!r}); save the job spec as "
                           f"UTF-8") from None
    except yaml.YAMLError as exc:
        raise JobSpecError(f"{path}: not valid YAML ({describe_yaml_error(exc)})") from None
    if not isinstance(data, dict):
        kind = type(data).__name__
        raise JobSpecError(f"{path}: a job spec is a mapping of sections, got {kind}")
    spec = parse_job_spec(apply_overrides(data, overrides or []))
    if check_paths:
        check_local_paths(spec)
    return spec
