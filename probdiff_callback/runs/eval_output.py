"""`probdiff eval`'s and `probdiff score`'s --out folder: its files, and how an evaluation stopped part-way resumes.

- `records.jsonl`: one `Record` per query, in the queries' order once the command finished. While `probdiff eval`
  runs, each query's record is appended as it finishes, so that an evaluation that fails part-way keeps them.
- `summary.json`: the `Summary`, then `config` (the settings the command read, as they applied), what was evaluated
  (model, adapter, the queries' or pairs' file), `seconds`, `resumed` (after --resume: how many records it kept) and
  `cost`. Written last: a folder without it holds no finished evaluation.
- `unfinished.json` (`UNFINISHED_FILE`): beside records.jsonl while `probdiff eval` runs, and after it stopped
  part-way: what it evaluates (model, adapter, dtype, device, the queries' file, the settings), `n_queries` and, once
  it failed, `error`. Removed when the results are whole.

Results already there are replaced only with --overwrite. `probdiff eval --resume` continues the unfinished
evaluation: the same model, queries and settings (only `HOW_NOT_WHAT` may change), so each kept record is the one an
uninterrupted run writes; it keeps the records (less a last line half-written when the process was killed),
evaluates the queries they lack, and writes the whole results in the queries' order. `probdiff compare` refuses an
unfinished folder: its records are some of its queries'.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from probdiff_callback.core.config import EVAL, ProbDiffConfig
from probdiff_callback.core.json_form import jsonl_lines
from probdiff_callback.core.records import dumps
from probdiff_callback.runs.run_files import read_records, write_atomic, write_json, write_jsonl

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence

    from probdiff_callback.core.evaluator import Evaluation
    from probdiff_callback.core.queries import Query
    from probdiff_callback.core.records import Record, Summary

RESULT_FILES = ("records.jsonl", "summary.json")
# Beside records.jsonl while `probdiff eval` runs, and after it stopped part-way: what it evaluates (`--resume`).
UNFINISHED_FILE = "unfinished.json"
# Settings that change how an evaluation runs, not what it writes: `--resume` may change them (a smaller batch after
# running out of memory, longer waits for a slow engine, a server restarted elsewhere).
HOW_NOT_WHAT = frozenset(
    {"batch_size", "score_chunk_tokens", "vllm_server_base_url", "vllm_server_timeout", "vllm_stall_timeout",
     "vllm_gpu_memory_utilization", "vllm_enable_sleep_mode"}
)  # fmt: skip


class OutputDirError(Exception):
    """--out cannot take this command's results; said before the model loads."""


def prepare_out(out: str, overwrite: bool, resume: bool = False) -> list[Path]:
    """Make the --out directory before the model loads, so that an unusable one stops the command at once rather
    than after the whole evaluation; earlier results there are replaced only with --overwrite, and an unfinished
    evaluation is continued only with --resume. Returns the folders it made, innermost first (an evaluation that
    finishes nothing removes them again)."""
    path = Path(out)
    existing = next(p for p in (path, *path.parents) if p.exists())  # `out` itself, or where it would be made
    made = [p for p in (path, *path.parents) if not p.exists()]
    if not existing.is_dir():
        where = "is a file" if existing == path else f"is under {existing}, a file"
        raise OutputDirError(f"--out {out} {where}: give a directory (it gets {' and '.join(RESULT_FILES)})")
    unfinished = (path / UNFINISHED_FILE).is_file()
    if resume and not unfinished:
        if (path / "summary.json").exists():
            raise OutputDirError(f"--resume: --out {out} holds a finished evaluation (summary.json): nothing to resume")
        raise OutputDirError(
            f"--resume: --out {out} holds no unfinished evaluation (the {UNFINISHED_FILE} that `probdiff eval` "
            "leaves when it stops part-way)"
        )
    if resume:
        return []
    if unfinished and not overwrite:
        raise OutputDirError(
            f"--out {out} holds an unfinished evaluation ({_count_lines(path / 'records.jsonl')} queries' records, "
            "no summary.json): add --resume to finish it with `probdiff eval`, or --overwrite to replace it"
        )
    earlier = [name for name in RESULT_FILES if (path / name).exists()]
    if earlier and not overwrite:
        raise OutputDirError(
            f"--out {out} already holds {' and '.join(earlier)} of an earlier run: choose another --out, "
            "or add --overwrite to replace them"
        )
    if earlier:
        print(f"--overwrite: replacing {' and '.join(earlier)} in {out}", file=sys.stderr)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # no permission, read-only file system
        raise OutputDirError(f"--out {out}: cannot create the directory ({err.strerror}: {err.filename})") from None
    return made


def remove_empty(made: Sequence[Path]) -> None:
    """The folders `prepare_out` made, innermost first, where they are still empty (one that holds anything stays)."""
    for folder in made:
        with contextlib.suppress(OSError):
            folder.rmdir()


def _count_lines(path: Path) -> int:
    return sum(1 for line in jsonl_lines(path.read_text(encoding="utf-8")) if line.strip()) if path.is_file() else 0


def setting_text(value) -> str:
    """A setting's value as `key=value` takes it (null, true, false)."""
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def what_is_evaluated(args, config: ProbDiffConfig) -> dict:
    """What `probdiff eval` evaluates: the model, how it runs, the queries' file and the settings that applied (paths
    that exist as absolute paths, so that --resume from another folder finds them the same)."""

    def as_given(value: str | None) -> str | None:
        return str(Path(value).resolve()) if value is not None and Path(value).exists() else value

    reads = ProbDiffConfig.keys_read_by(EVAL)
    settings = json.loads(dumps({key: value for key, value in config.to_dict().items() if key in reads}))
    return {
        "model": as_given(args.model),
        "adapter": as_given(args.adapter),
        "dtype": args.dtype,
        "device": args.device,
        "queries": as_given(args.queries),
        "config": settings,
    }


def kept_records(out: str, evaluated: dict, queries: Sequence[Query]) -> list[Record]:
    """The records an unfinished evaluation in `out` kept, after checking that this command continues it: the same
    model, queries and settings (other than `HOW_NOT_WHAT`), and every kept query among this command's."""
    path = Path(out)
    before = json.loads((path / UNFINISHED_FILE).read_text(encoding="utf-8"))
    differences = [
        f"{key} {before.get(key)!r} then, {value!r} now"
        for key, value in evaluated.items()
        if key != "config" and before.get(key) != value
    ]
    then, now = before.get("config", {}), evaluated["config"]
    differences += [
        f"{key}={setting_text(then.get(key))} then, {setting_text(now.get(key))} now"
        for key in dict.fromkeys([*now, *then])
        if key not in HOW_NOT_WHAT and then.get(key) != now.get(key)
    ]
    if differences:
        raise OutputDirError(
            f"--resume: the evaluation in {out} was started otherwise ({'; '.join(differences)}): give what it was "
            "started with, or start afresh with --overwrite"
        )
    records_path = path / "records.jsonl"
    if not records_path.is_file():
        return []
    text = records_path.read_text(encoding="utf-8")
    if text and not text.endswith("\n"):  # a record half-written when the process was killed: evaluated again
        write_atomic(records_path, text[: text.rfind("\n") + 1])
    kept = read_records(records_path)
    ids = {query.id for query in queries}
    strangers = [record.id for record in kept if record.id not in ids]
    if strangers:
        raise OutputDirError(
            f"--resume: {records_path} holds records of {len(strangers)} queries this command does not evaluate "
            f"(the first: {strangers[0]!r}): give the --queries and --limit it was started with"
        )
    return kept


@contextlib.contextmanager
def keeping_finished(
    out: str, evaluated: dict, kept: list[Record], n_queries: int, made: Sequence[Path] = ()
) -> Iterator[Callable]:
    """--out while the evaluation runs: `UNFINISHED_FILE` says what it evaluates, and records.jsonl gets each
    query's record as it finishes (after `kept`, an unfinished evaluation's). Should the evaluation fail or be
    interrupted (Ctrl-C), what it finished stays, with a line saying how to finish it; where nothing was finished,
    --out is left without results, as before, and the folders `prepare_out` `made` for it are removed. The caller
    writes the whole results and removes `UNFINISHED_FILE` once it succeeded."""
    path = Path(out)
    records_path, marker = path / "records.jsonl", path / UNFINISHED_FILE
    if not kept:
        (path / "summary.json").unlink(missing_ok=True)  # --overwrite: the earlier summary is not this one
        records_path.write_text("", encoding="utf-8")
    write_json(marker, {**evaluated, "n_queries": n_queries})
    finished = len(kept)
    with open(records_path, "a", encoding="utf-8") as sink:

        def add(records: list[Record]) -> None:
            nonlocal finished
            sink.write("".join(dumps(record) + "\n" for record in records))
            sink.flush()
            finished += len(records)

        try:
            yield add
        except BaseException as err:
            sink.flush()
            if finished == 0:
                records_path.unlink(missing_ok=True)
                marker.unlink(missing_ok=True)
                remove_empty(made)
                raise
            interrupted = isinstance(err, KeyboardInterrupt)
            write_json(marker, {**evaluated, "n_queries": n_queries, "error": str(err) or type(err).__name__})
            print(
                f"probdiff eval: {finished} of {n_queries} queries were evaluated before "
                f"{'it was interrupted' if interrupted else 'the error below'}; their records are in {records_path}. "
                f"The same command with --resume evaluates the other {n_queries - finished} and writes the summary.",
                file=sys.stderr,
            )
            raise


def in_query_order(records: Sequence[Record], queries: Sequence[Query]) -> list[Record]:
    by_id = {record.id: record for record in records}
    return [by_id[query.id] for query in queries]


def write_results(
    command: str, out: str, evaluation: Evaluation, summary: Summary, config: ProbDiffConfig, extra: dict
) -> None:
    """records.jsonl and summary.json: the summary, then the settings that applied, `extra` (what was evaluated,
    the seconds) and what each stage cost."""
    reads = ProbDiffConfig.keys_read_by(command)
    applied = {key: value for key, value in config.to_dict().items() if key in reads}
    write_jsonl(Path(out) / "records.jsonl", evaluation.records)
    write_json(Path(out) / "summary.json", {**summary.to_json(), "config": applied, **extra, "cost": evaluation.cost})


def finished_records(directory: str) -> list[Record]:
    """The records of a finished `probdiff eval` or `probdiff score` in `directory`."""
    if (Path(directory) / UNFINISHED_FILE).is_file():  # its records are some of its queries'
        raise ValueError(
            f"{directory} holds an unfinished evaluation ({_count_lines(Path(directory) / 'records.jsonl')} "
            "queries' records, no summary.json): finish it first with the same `probdiff eval` and --resume"
        )
    path = Path(directory) / "records.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found; give directories written by `probdiff eval` or `probdiff score`")
    return read_records(path)
