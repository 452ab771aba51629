"""`probdiff`: evaluate, score, compare and convert from the command line."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from probdiff_callback.analysis.report import degenerate_note, format_comparison, format_summary
from probdiff_callback.core.config import DEFAULT_ALARM_GAIN_SHARE, EVAL, SCORE, ProbDiffConfig, config_for_command
from probdiff_callback.core.queries import QUERY_FIELDS, TURN_FIELDS
from probdiff_callback.generation.vllm_common import EngineUnavailable, vllm_problem
from probdiff_callback.models import check_model_arguments
from probdiff_callback.models.command_loading import load_model
from probdiff_callback.runs.eval_output import (
    UNFINISHED_FILE,
    OutputDirError,
    finished_records,
    in_query_order,
    keeping_finished,
    kept_records,
    prepare_out,
    remove_empty,
    setting_text,
    what_is_evaluated,
    write_results,
)

if TYPE_CHECKING:
    from collections.abc import Iterator

    from probdiff_callback.core.engine import Engine


def _settings_epilog(command: str) -> str:
    """The ProbDiff settings `command` reads, by group, each with its default and its help (the fields' own)."""
    import dataclasses
    import textwrap

    defaults = ProbDiffConfig()
    fields = {f.name: f for f in dataclasses.fields(ProbDiffConfig)}
    lines = [
        f"ProbDiff settings (key=value) that `probdiff {command}` reads (docs/configuration.md#probdiff-settings):"
    ]
    for group, names in ProbDiffConfig.read_by(command).items():
        lines.append(f"  {group}:")
        for name in names:
            head = f"    {name}={setting_text(getattr(defaults, name))}"
            lines += textwrap.wrap(
                fields[name].metadata["help"], 110, initial_indent=f"{head}  ", subsequent_indent=" " * 8
            )
    return "\n".join(lines)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive count (leave --limit out for every query)")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is not a count (0 or more)")
    return value


def _add_model_args(parser: argparse.ArgumentParser, command: str) -> None:
    parser.add_argument(
        "--model",
        default="tiny",
        help="preset (tiny, smollm2, qwen-14b-chat, qwen1.5-14b-chat), local directory or hub id [tiny]",
    )
    parser.add_argument(
        "--adapter", default=None, help="a PEFT adapter directory (e.g. a training checkpoint) to apply"
    )
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16 [auto]")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... [cuda if available]")
    parser.add_argument("--out", required=True, help="output directory for records.jsonl and summary.json")
    replacing = parser.add_mutually_exclusive_group()
    replacing.add_argument(
        "--overwrite", action="store_true", help="replace the records.jsonl and summary.json that --out already holds"
    )
    if command == EVAL:
        replacing.add_argument(
            "--resume",
            action="store_true",
            help="finish the evaluation that stopped part-way in --out: keep its records, evaluate the queries it "
            "lacks, write the summary (the same model, queries and settings)",
        )
    parser.add_argument(
        "overrides", nargs="*", metavar="key=value", help="ProbDiff settings, each with its default: see below"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="probdiff",
        description="ProbDiff self-evaluation of chat LLMs (the model judges itself by its log-probabilities).",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    evaluate = commands.add_parser(
        "eval",
        help="answer, revise and score queries; writes records.jsonl and summary.json",
        epilog=_settings_epilog(EVAL),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_model_args(evaluate, EVAL)
    evaluate.add_argument(
        "--queries",
        required=True,
        help="JSON lines or a JSON list; each row's query is the first of "
        f"{', '.join(QUERY_FIELDS)} that holds text, or the first user turn of {', '.join(TURN_FIELDS)} (a chat); "
        "optional: id (or question_id), category, and a reference answer (reference, completion, or the chat's "
        "assistant turn) for BLEU/chrF or ROUGE (docs/cli.md#query-files)",
    )
    evaluate.add_argument("--limit", type=_positive_int, default=None, help="only the first N queries (N >= 1)")

    score = commands.add_parser(
        "score",
        help="score texts generated elsewhere (rows {id, query, response, revised})",
        epilog=_settings_epilog(SCORE),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_model_args(score, SCORE)
    score.add_argument("--pairs", required=True, help="JSON lines or a JSON list of {id, query, response, revised}")

    compare = commands.add_parser(
        "compare", help="win/tie/lose of two result directories on the same queries, a sign test and an interval"
    )
    compare.add_argument(
        "dir_a", help="a `probdiff eval` or `score` output directory (records.jsonl, summary.json): model A"
    )
    compare.add_argument("dir_b", help="another one, on the same query ids: model B (wins are A's)")
    compare.add_argument("--delta", type=float, default=None, help="threshold [the delta in DIR_A's summary]")

    convert = commands.add_parser(
        "convert-qwen", help="convert a Qwen v1 checkpoint (Qwen-14B-Chat) to a plain Qwen2ForCausalLM checkpoint"
    )
    convert.add_argument("src", help="directory with the v1 config.json, weights and qwen.tiktoken")
    convert.add_argument("dst", help="output directory")
    convert.add_argument("--max-shard-size", default="5GB")

    select = commands.add_parser("select", help="rank the checkpoints of a training run evaluated by ProbDiffCallback")
    select.add_argument("run_dir", help="the training output directory (holds probdiff/history.jsonl)")
    select.add_argument("--subdir", default="probdiff", help="ProbDiffCallback's output subdirectory [probdiff]")
    share = (
        "the share of what training gained on a measure that the pick may give up [the run's "
        f"probdiff.alarm_gain_share, else {DEFAULT_ALARM_GAIN_SHARE:g}]"
    )
    select.add_argument("--alarm-gain-share", type=float, default=None, help=share)
    select.add_argument(
        "--by",
        choices=["probdiff_guarded", "probdiff_confidence"],
        default=None,
        help="what picks the best checkpoint: the confidence of the checkpoints the run's independent measures do not "
        "call damaged, or the confidence alone [what the run selected by; probdiff_guarded for a run written before "
        "it was recorded]",
    )
    select_target = select.add_mutually_exclusive_group()
    select_target.add_argument("--link", action="store_true", help="make RUN_DIR/best a symlink to the best checkpoint")
    select_target.add_argument("--copy", action="store_true", help="copy the best checkpoint to RUN_DIR/best")

    plot = commands.add_parser(
        "plot", help="one PNG of ProbDiff over a training run: confidence and the distribution of d per step"
    )
    plot.add_argument("run_dir", help="the training output directory (holds probdiff/history.jsonl)")
    plot.add_argument("--subdir", default="probdiff", help="ProbDiffCallback's output subdirectory [probdiff]")
    plot.add_argument("--out", default=None, help="PNG path [RUN_DIR/probdiff/probdiff.png]")

    check = commands.add_parser(
        "crosscheck",
        help="how far ProbDiff followed independent measures over a training run: reference metrics, eval loss, "
        "your judges' verdicts",
    )
    check.add_argument("run_dir", help="the training output directory (holds probdiff/history.jsonl)")
    check.add_argument("--subdir", default="probdiff", help="ProbDiffCallback's output subdirectory [probdiff]")
    check.add_argument("--json", default=None, help="report path [RUN_DIR/probdiff/crosscheck.json]")
    check.add_argument("--plot", default=None, help="scatter plot path [RUN_DIR/probdiff/crosscheck.png]")
    check.add_argument(
        "--verdicts",
        default=None,
        help='JSON lines of outside verdicts by query id: {"id", "winner": "A"|"B"|"tie"} (pairwise) or '
        '{"id", "revision": "better"|"worse"|"same"} (revision vs answer); see docs/agreement.md',
    )
    check.add_argument(
        "--step", type=int, default=None, help="the step the verdicts judge (pairwise: A) [the last evaluated step]"
    )
    check.add_argument("--against", type=int, default=None, help="pairwise verdicts: step B [the baseline]")

    watch = commands.add_parser(
        "watch",
        help="the evaluator of a run trained with probdiff.async_eval=true: evaluates its queued checkpoints",
        description=WATCH_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    watch.add_argument(
        "run_dir", help="the training output directory (holds probdiff/queue/evaluator.json, which training wrote)"
    )
    watch.add_argument("--subdir", default="probdiff", help="ProbDiffCallback's output subdirectory [probdiff]")
    watch.add_argument(
        "--follow",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="wait for more requests until training writes queue/training-ended (--follow, the default); "
        "--no-follow evaluates what is queued now and stops",
    )
    watch.add_argument(
        "--started-by-training",
        action="store_true",
        help="set by the training command that starts its evaluator: ends when training's process does",
    )
    watch.add_argument(
        "--poll-seconds",
        type=_positive_seconds,
        default=2.0,
        help="how often to look for new requests while following [2]",
    )
    watch.add_argument(
        "--helpers-after-training",
        type=_non_negative_int,
        default=0,
        metavar="N",
        help="on the CPU: once training has queued its last step or ended, evaluate each request in shares with N "
        "helper processes, on the cores training freed (training's local evaluator sets it) [0]",
    )
    return parser


WATCH_DESCRIPTION = """\
Evaluate the checkpoints a training run queued (probdiff.async_eval=true), in step order, each as the training loop
would have: the run's ProbDiff settings, held-out queries and engine (HF, or vLLM with use_vllm=true), the same
records. Each step's row and records go into RUN_DIR/probdiff (history.jsonl, step-N/records.jsonl, and the
checkpoint's probdiff.json), then its done mark into RUN_DIR/probdiff/queue/step-N/done.json.

What it needs on disk: the run directory and the base model's folder (or preset) the run was trained from; each
step's weights are in the queue. Devices: CUDA_VISIBLE_DEVICES picks the GPUs (none: the CPU), OMP_NUM_THREADS the CPU
threads. One evaluator per run: a second one is refused, naming the first. SIGTERM stops it (exit 0), Ctrl-C too
(exit 130); the step in progress stays queued and is evaluated next time. A failed evaluation is a failed row, and
the command goes on. Exit 2: no queue in RUN_DIR, another evaluator, or a spec it cannot read.
"""


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive number of seconds")
    return value


# Set by the console script: this process is ours, so process-wide settings may change.
_own_process = False


@contextlib.contextmanager
def _vllm_engine(args, config: ProbDiffConfig, model, tokenizer) -> Iterator[Engine]:
    """The vLLM engine `config` asks for, holding the weights `probdiff eval` evaluates: the base model, or with
    --adapter the adapter (by path) or the merged weights, as `vllm_weight_sync` says; stopped at the end."""
    from probdiff_callback.generation.vllm import VLLMGeneration

    started = time.time()
    with contextlib.closing(VLLMGeneration.start(config, model, tokenizer, dtype=args.dtype)) as vllm:
        ready = time.time() - started
        with vllm.holding(model, base_model=args.adapter is None, adapter=args.adapter) as engine:
            where = config.vllm_server_base_url if config.vllm_mode == "server" else vllm.where
            print(f"vLLM ({config.vllm_mode}, {where}) started in {ready:.1f}s; {vllm.handed_over}", file=sys.stderr)
            yield engine


def _engine(args, config: ProbDiffConfig, model, tokenizer, queries: int, stack: contextlib.ExitStack):
    """The engine that writes the texts of `queries` queries (generation/choice.py), said in one line, and `config`
    with `use_vllm` decided; vLLM's engine entered on `stack` (None: HF). Where vLLM cannot start, `use_vllm=true`
    stops; `auto` takes HF."""
    from probdiff_callback.generation.choice import architectures_of, choose_engine, parameters_of

    on_gpu = next(model.parameters()).device.type == "cuda"
    choice = choose_engine(config, parameters=parameters_of(model), architectures=architectures_of(model),
                           queries=queries, in_training_loop=False, on_gpu=on_gpu)  # fmt: skip
    engine = None
    if choice.use_vllm and queries:
        try:
            engine = stack.enter_context(_vllm_engine(args, choice.applied(config), model, tokenizer))
        except EngineUnavailable as err:
            if config.use_vllm is True:
                raise
            choice = choice.fallen_back(str(err))
    print(choice.line(), file=sys.stderr)
    return choice.applied(config), engine


def cmd_eval(args) -> int:
    from probdiff_callback.core.queries import load_queries
    from probdiff_callback.core.reference_metrics import plan_references

    config = config_for_command(EVAL, args.overrides)
    if problem := vllm_problem(config):
        raise ValueError(problem)
    queries = load_queries(args.queries)
    config.check_categories(q.category for q in queries)  # the whole file: --limit may leave a category out
    if args.limit is not None:
        queries = queries[: args.limit]
    plan = plan_references(queries)
    if plan.notice():
        print(f"note: {plan.notice()}", file=sys.stderr)
    made = prepare_out(args.out, args.overwrite, args.resume)
    evaluated = what_is_evaluated(args, config)
    kept = kept_records(args.out, evaluated, queries) if args.resume else []
    kept_ids = {record.id for record in kept}
    remaining = [query for query in queries if query.id not in kept_ids]
    if args.resume:
        print(
            f"--resume: {len(kept)} of {len(queries)} queries were evaluated in {args.out}; evaluating the other "
            f"{len(remaining)}",
            file=sys.stderr,
        )
    try:
        check_model_arguments(args.model, args.adapter, args.dtype)
        # torch and transformers: after every check of the arguments, which then stop within a second
        from probdiff_callback.core.evaluator import Evaluation, evaluate, summarise

        model, tokenizer = load_model(args, _own_process)
    except BaseException:  # no model (or Ctrl-C while loading): the folders made for the results go again
        remove_empty(made)
        raise
    started = time.time()
    with keeping_finished(args.out, evaluated, kept, len(queries), made) as keep, contextlib.ExitStack() as stack:
        config, engine = _engine(args, config, model, tokenizer, len(remaining), stack)
        evaluation = evaluate(model, tokenizer, remaining, config, engine=engine, on_finished=keep)
    whole = Evaluation(in_query_order([*kept, *evaluation.records], queries), evaluation.cost)
    evaluation, summary = summarise(whole, queries, config, plan)
    seconds = round(time.time() - started, 2)
    extra = {"model": args.model, "adapter": args.adapter, "queries": args.queries, "seconds": seconds}
    if args.resume:
        extra["resumed"] = len(kept)  # records kept from the unfinished evaluation; seconds and cost are this run's
    write_results(EVAL, args.out, evaluation, summary, config, extra)
    (Path(args.out) / UNFINISHED_FILE).unlink(missing_ok=True)
    print(format_summary(summary))
    if summary.n_truncated:
        print(
            f"note: {summary.n_truncated} queries were longer than max_prompt_tokens={config.max_prompt_tokens} "
            "and were cut in the middle (see `truncated` in records.jsonl)"
        )
    if summary.n_revision_truncated:
        print(
            f"note: {summary.n_revision_truncated} refinement requests (query + answer + prompt) were longer than "
            f"max_prompt_tokens={config.max_prompt_tokens} and were cut in the middle "
            "(see `revision_truncated` in records.jsonl)"
        )
    if summary.n_capped or summary.n_revision_capped:
        print(
            f"note: {summary.n_capped} answers and {summary.n_revision_capped} revisions ended at "
            f"max_new_tokens={config.max_new_tokens} without an end-of-turn token and were scored cut short "
            "(see `response_capped` and `revision_capped` in records.jsonl); "
            "the reference code allowed 2,048 tokens (1,024 on AlignBench)"
        )
    if summary.n_revision_degenerate:
        print(degenerate_note(summary))
    print(f"wrote {Path(args.out) / 'records.jsonl'} and {Path(args.out) / 'summary.json'}")
    return 0


def cmd_score(args) -> int:
    from probdiff_callback.core.queries import load_pairs
    from probdiff_callback.core.reference_metrics import plan_references

    config = config_for_command(SCORE, args.overrides)
    pairs = load_pairs(args.pairs)
    queries = [query for query, _, _ in pairs]
    plan = plan_references(queries)
    prepare_out(args.out, args.overwrite)
    check_model_arguments(args.model, args.adapter, args.dtype)
    from probdiff_callback.core.evaluator import summarise  # torch and transformers: after the checks, as in eval
    from probdiff_callback.core.pairs import score_pairs

    model, tokenizer = load_model(args, _own_process)
    started = time.time()
    evaluation, summary = summarise(score_pairs(model, tokenizer, pairs, config), queries, config, plan)
    seconds = round(time.time() - started, 2)
    extra = {"model": args.model, "adapter": args.adapter, "pairs": args.pairs, "seconds": seconds}
    write_results(SCORE, args.out, evaluation, summary, config, extra)
    print(format_summary(summary))
    if summary.n_revision_degenerate:
        print(degenerate_note(summary))
    print(f"wrote {Path(args.out) / 'records.jsonl'} and {Path(args.out) / 'summary.json'}")
    return 0


def cmd_compare(args) -> int:
    from probdiff_callback.core.metric import compare
    from probdiff_callback.core.records import Summary

    records = [finished_records(directory) for directory in (args.dir_a, args.dir_b)]
    delta = args.delta
    if delta is None:
        delta = Summary.from_json(json.loads((Path(args.dir_a) / "summary.json").read_text())).delta
    result = compare(records[0], records[1], delta)
    print(format_comparison(result, args.dir_a, args.dir_b))
    if result.n_only_a or result.n_only_b:
        print(f"not compared: {result.n_only_a} queries only in A, {result.n_only_b} only in B")
    return 0


def cmd_convert(args) -> int:
    from probdiff_callback.models.qwen_v1 import convert_qwen_checkpoint

    out = convert_qwen_checkpoint(args.src, args.dst, max_shard_size=args.max_shard_size)
    print(f"wrote a Qwen2ForCausalLM checkpoint to {out}")
    return 0


def cmd_select(args) -> int:
    from probdiff_callback.analysis.select import format_selection, point_best, select, unpoint_best
    from probdiff_callback.runs.run_files import read_run

    selection = select(read_run(args.run_dir, args.subdir), args.alarm_gain_share, args.by)
    print(format_selection(selection))
    if args.link or args.copy:
        if selection.best_checkpoint is None:
            if removed := unpoint_best(args.run_dir):
                print(f"removed {removed}: it named a checkpoint that is not the pick")
            why = "no checkpoint passes the guard" if selection.pick and selection.pick.none_passes else "no checkpoint"
            raise FileNotFoundError(f"{why}: RUN_DIR/best is not made")
        target = point_best(args.run_dir, selection.best_checkpoint.checkpoint, copy=args.copy)
        print(f"{'copied' if args.copy else 'linked'} {target} -> {selection.best_checkpoint.checkpoint}")
    return 0


def cmd_plot(args) -> int:
    from probdiff_callback.analysis.plot import plot_run
    from probdiff_callback.runs.run_files import read_run

    print(f"wrote {plot_run(read_run(args.run_dir, args.subdir), args.out)}")
    return 0


def cmd_crosscheck(args) -> int:
    from probdiff_callback.analysis.crosscheck import crosscheck, format_crosscheck
    from probdiff_callback.analysis.plot import plot_crosscheck
    from probdiff_callback.analysis.verdicts import check_verdicts
    from probdiff_callback.runs.run_files import read_run, write_json

    run = read_run(args.run_dir, args.subdir)
    rows, records = run.successful_or_raise("; was the run trained with ProbDiffCallback?"), run.records
    report = crosscheck(rows, records)
    verdict_text = None
    if args.verdicts is not None:
        report["verdicts"], verdict_text = check_verdicts(args.verdicts, rows, records, args.step, args.against)
    print(format_crosscheck(report))
    if verdict_text is not None:
        print(verdict_text)
    json_path = Path(args.json) if args.json else run.directory / "crosscheck.json"
    write_json(json_path, report)
    plot_path = plot_crosscheck(report, args.plot or run.directory / "crosscheck.png")
    print(f"wrote {json_path} and {plot_path}")
    return 0


def cmd_watch(args) -> int:
    from probdiff_callback.watch.command import Watch, run_watch

    if args.started_by_training and not args.follow:
        raise ValueError("--started-by-training follows the run until training ends: leave out --no-follow")
    return run_watch(
        Watch(
            Path(args.run_dir),
            args.subdir,
            args.follow,
            args.started_by_training,
            args.poll_seconds,
            helpers_after_training=args.helpers_after_training,
            own_process=_own_process,  # torch is imported after the checks of the run directory
        )
    )


def main(argv: list[str] | None = None) -> int:
    """Run one command; for programmatic use and tests (no process-wide settings change)."""
    return _dispatch(build_parser().parse_args(argv))


def entry_point() -> None:
    """The `probdiff` console script: `main`, plus settings only a process of its own may change.

    Importing torch + transformers and loading a model leaves hundreds of thousands of tracked
    objects and no garbage: the collector's full passes over them are wasted time while loading
    and at interpreter exit, so it is paused while loading and everything is frozen out of its
    passes at the end. On CPU, freed memory is kept for reuse (see
    `models.command_loading.reuse_freed_memory`).
    """
    global _own_process
    args = build_parser().parse_args()
    _own_process = True
    if args.command in ("eval", "score"):
        gc.disable()  # `load_model` turns it back on
    try:
        code = _dispatch(args)
    finally:
        gc.freeze()
    sys.exit(code)


def _dispatch(args) -> int:
    handler = {
        "eval": cmd_eval,
        "score": cmd_score,
        "compare": cmd_compare,
        "convert-qwen": cmd_convert,
        "select": cmd_select,
        "plot": cmd_plot,
        "crosscheck": cmd_crosscheck,
        "watch": cmd_watch,
    }[args.command]
    try:
        return handler(args)
    except (ValueError, FileNotFoundError, FileExistsError, EngineUnavailable, OutputDirError) as err:
        print(f"probdiff {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: what was finished is kept (and said) where the command keeps it
        print(f"probdiff {args.command}: interrupted (Ctrl-C)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    entry_point()
