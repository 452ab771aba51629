"""Prepare the training and held-out data of a ProbDiff recipe.

    python data/prepare.py translation   [--source DIR_OR_URL|hub] [--out DIR] [--seed N]
    python data/prepare.py summarization [--source DIR_OR_URL|hub] [--split-test N] ...
    python data/prepare.py <task> ... --shuffle-references --out data/processed-shuffled
    python data/prepare.py blog          [--source DIR_OR_URL] ...
    python data/prepare.py alignbench    [--source DIR_OR_FILE_OR_URL] [--train FILE] ...

Writes `train.jsonl` and `heldout.jsonl` to `data/processed/<task>/` (where the recipes look),
one JSON object per line: `{"id", "category", "messages": [{"role", "content"}, ...]}`; AlignBench
held-out rows also carry `reference` and `subcategory`. The output depends only on the inputs and
`--seed`. Train rows that share a held-out source (translation: a sentence of a pair, in either
direction; summarization: a document; otherwise the prompt) are removed and counted.

Sources: the paper's own splits, from its repository (github.com/xiatingyu/ProbDiff), by default.
  translation    `generation_task/data/<pair>/train.json` (5,000 `conversations` per pair) and `test.json`
                 (1,000 rows `{"<src>": .., "en": ..}`: first half into English, second half out of it, as
                 the paper's code reads them), for cs-en, de-en, ru-en, zh-en (WMT19).
  summarization  `generation_task/data/xsum/{train,test}.json` and `cnn/{train,test}.json` (CNN/DM): train
                 files of `conversations`, test files of rows `{document, summary}` (XSum) or `{article,
                 highlights}` (CNN/DM), 5,000 / 1,000 documents each.
  blog           `generation_task/data/redbook/train.json` (469 `conversations`) and `test.json` (100 rows
                 `{user, assistant}`), the Xiaohongshu set.
  alignbench     `alignbench/data/data_release.jsonl` (683 questions in 8 categories, the paper's copy: THUDM's
                 v1.1 differs in 242 of them) as held-out queries with their reference answers, and
                 `alignbench/data/gpt_generate_train.json` (`conversations`) as training data, or `--train FILE`.
`--source DIR` reads the same files from a local copy in the paper's layout (`DIR/<pair>/`, `DIR/xsum/`,
`DIR/cnn/` or `DIR/cnn_dm/`, `DIR/redbook/`, `DIR/alignbench/`), the task folder itself, or the file;
what DIR lacks is downloaded from the paper's repository. `--source URL` is a URL prefix in the same
layout (for alignbench also the release file's URL). `--source hub` takes WMT19 (`wmt/wmt19`: train
and validation splits), XSum (`EdinburghNLP/xsum`) and CNN/DM (`abisee/cnn_dailymail` 3.0.0) from the
Hugging Face hub instead: seeded samples of the same sizes, not the paper's.

`--split-test N` (summarization) makes training rows of the test documents themselves, for where the training
files cannot be had (offline, the paper's data copy holds XSum's 1,000 test documents only): per dataset, N test
documents drawn with `--seed` stay held out and all the others become training rows, disjoint by document. A dataset
whose test file the local `--source` lacks is skipped and named. `--shuffle-references` deliberately corrupts the
training rows for a broken-run study: their reference answers are permuted across rows of the same category (a
seeded derangement: no row keeps its own), so a model learns to answer with texts about other inputs; held-out rows
are left as they are. Write such a copy to its own folder (`--out data/processed-shuffled`) and train on it with
`train_file=data/processed-shuffled/<task>/train.jsonl`.

File formats are detected by content (the paper's `.json` files are sometimes JSON lines). A bad row,
or an upstream file whose format changed, stops the run with its file (or URL), line and what was
expected.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from probdiff_callback.core.queries import DataFileError
from probdiff_callback.data.alignbench import prepare_alignbench
from probdiff_callback.data.blog import prepare_blog
from probdiff_callback.data.chat_rows import shuffle_references
from probdiff_callback.data.leaks import LEAK_CHECKS, finish
from probdiff_callback.data.sources import HUB, Fetcher
from probdiff_callback.data.summarization import prepare_summarization, summarization_test_splits
from probdiff_callback.data.translation import prepare_translation
from probdiff_callback.runs.run_files import write_jsonl
from probdiff_callback.training import PROJECT_ROOT

DEFAULT_OUT = PROJECT_ROOT / "data" / "processed"
TASKS = ("translation", "summarization", "blog", "alignbench")


def prepare(
    task: str,
    source: str | None = None,
    out: Path = DEFAULT_OUT,
    seed: int = 0,
    train_file: str | None = None,
    split_test: int | None = None,
    shuffled: bool = False,
) -> dict:
    """Write `<out>/<task>/{train,heldout}.jsonl`; returns counts, the sources used (`sources`), the splits made by
    `split_test` (`splits`) and the rows whose reference was shuffled (`shuffled`)."""
    if task not in TASKS:
        raise SystemExit(f"error: unknown task {task!r}; tasks: {', '.join(TASKS)}")
    if train_file is not None and task != "alignbench":
        raise SystemExit("error: --train is for alignbench; other tasks read the paper's files or --source")
    if source == HUB and task not in ("translation", "summarization"):
        raise SystemExit(f"error: --source hub is for translation and summarization; {task} is the paper's own data")
    if split_test is not None and task != "summarization":
        raise SystemExit(
            f"error: --split-test is for summarization (its training files can be missing); {task} has its own"
        )
    with tempfile.TemporaryDirectory(prefix="probdiff-prepare-") as tmp:
        fetcher = Fetcher(Path(tmp))
        if task == "translation":
            train, heldout = prepare_translation(source, seed, fetcher)
        elif task == "summarization" and split_test is not None:
            train, heldout = summarization_test_splits(source, seed, fetcher, split_test)
        elif task == "summarization":
            train, heldout = prepare_summarization(source, seed, fetcher)
        elif task == "blog":
            train, heldout = prepare_blog(source, seed, fetcher)
        else:
            train, heldout = prepare_alignbench(source, train_file, seed, fetcher)
    train, heldout, stats = finish(task, train, heldout)
    if shuffled:
        train = shuffle_references(train, seed)
    target = Path(out) / task
    if train:
        write_jsonl(target / "train.jsonl", train)
    elif (target / "train.jsonl").exists():
        (target / "train.jsonl").unlink()  # a stale file must not pair with a new held-out set
    write_jsonl(target / "heldout.jsonl", heldout)
    counts: dict = {
        "train": len(train), "heldout": len(heldout), **stats, "sources": fetcher.used, "splits": fetcher.splits,
        "shuffled": len(train) if shuffled else 0,
    }  # fmt: skip
    for split, rows in (("train", train), ("heldout", heldout)):
        by_category: dict[str, int] = {}
        for item in rows:
            by_category[item["category"]] = by_category.get(item["category"], 0) + 1
        counts[f"{split}_by_category"] = by_category
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("task", choices=TASKS)
    parser.add_argument(
        "--source",
        default=None,
        help="a local directory/file, a URL prefix, or `hub` (translation, "
        "summarization) instead of the paper's repository",
    )
    parser.add_argument("--out", default=str(DEFAULT_OUT), help=f"output root; files go to OUT/<task>/ [{DEFAULT_OUT}]")
    parser.add_argument("--seed", type=int, default=0, help="seed of subsets of the hub or of plain pairs [0]")
    parser.add_argument(
        "--train",
        dest="train_file",
        default=None,
        help="alignbench only: your conversations instead of the paper's gpt_generate_train.json",
    )
    parser.add_argument(
        "--split-test",
        type=int,
        default=None,
        metavar="N",
        help="summarization: N test documents per dataset (drawn with --seed) held out, the others are training rows",
    )
    parser.add_argument(
        "--shuffle-references",
        action="store_true",
        help="corrupt the training rows on purpose: references permuted across rows (write to another --out)",
    )
    args = parser.parse_args(argv)
    try:
        counts = prepare(
            args.task, args.source, Path(args.out), args.seed, args.train_file, args.split_test, args.shuffle_references
        )
    except (DataFileError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    target = Path(args.out) / args.task
    print(f"{args.task}: {counts['train']} train rows, {counts['heldout']} held-out rows -> {target}")
    for what, where in counts["sources"]:
        print(f"  source   {what}: {where}")
    for split in counts["splits"]:
        print(f"  split    {split}")
    if counts["shuffled"]:
        print(
            f"  CORRUPTED on purpose: the references of all {counts['shuffled']} training rows were shuffled across "
            "rows (`reference_of` names the row each came from); held-out rows are intact"
        )
    for split in ("train", "heldout"):
        print(f"  {split:<8} " + ", ".join(f"{k}: {v}" for k, v in sorted(counts[f"{split}_by_category"].items())))
    print(
        f"  removed: {counts['train_in_heldout']} {LEAK_CHECKS[args.task]}, "
        f"{counts['train_repeats']} repeated train rows, {counts['heldout_repeats']} repeated held-out prompts"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
