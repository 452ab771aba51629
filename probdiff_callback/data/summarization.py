"""The summarization task: XSum and CNN/DM, from the paper's files (`xsum/` and `cnn/` or `cnn_dm/`: training
`conversations` and test documents, 5,000 / 1,000 each) or from the hub's datasets, in the reference code's prompt.
`--split-test N` instead makes training rows of the test documents themselves, for where the training files cannot be
had: per dataset, N test documents drawn with the seed stay held out and the others train, disjoint by document. It
also holds the prompt's pattern (`summarized_document`), which the leak checks use to find a row's document.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable
from pathlib import Path

from probdiff_callback.core.queries import read_rows

from .chat_rows import CONVERSATIONS, conversation_rows, row, text_field
from .sources import HUB, PAPER_DATA, Fetcher, hub_rows, is_url

SUMMARIZATION_DATASETS = {
    # category: (folders, first the paper's; hub id, hub config, held-out split, document field, summary field)
    "xsum": (("xsum",), "EdinburghNLP/xsum", None, "test", "document", "summary"),
    "cnn_dm": (("cnn", "cnn_dm"), "abisee/cnn_dailymail", "3.0.0", "test", "article", "highlights"),
}
SUMMARIZATION_SIZES = (5000, 1000)
SUMMARIZATION_PROMPT = (
    "I want you to act as a Summarization Writer.\n"
    "Your goal is to provide a concise and coherent summary that captures the essential information and ideas "
    "expressed in the given content.\nHere is the content:\n{content}\nYour answer: "
)
SUMMARIZATION_CONTENT = re.compile(r"\nHere is the content:\n(.*)\nYour answer: ?$", re.S)


def summarized_document(prompt: str) -> str:
    """The document inside the reference summarization prompt; a prompt in another wording whole."""
    match = SUMMARIZATION_CONTENT.search(prompt)
    return match.group(1) if match is not None else prompt


def summarization_rows(items: Iterable[tuple[str, dict]], name: str) -> list[dict]:
    _, _, _, _, document_key, summary_key = SUMMARIZATION_DATASETS[name]
    out = []
    for where, item in items:
        # Either dataset's field names are accepted, so a file of one can be read under the other's name.
        document = item.get(document_key, item.get("document", item.get("article")))
        summary = item.get(summary_key, item.get("summary", item.get("highlights")))
        fields = {"document": document, "summary": summary}
        out.append(
            row(
                name,
                SUMMARIZATION_PROMPT.format(content=text_field(fields, "document", where)),
                text_field(fields, "summary", where),
            )
        )
    return out


def summarization_file(fetcher: Fetcher, source: str | None, folders: tuple[str, ...], split: str) -> Path:
    """`<folder>/<split>.json` from a local --source under any of the dataset's folder names (the paper's
    `cnn/`, or `cnn_dm/`), else from the URL prefix or the paper's repository, by the paper's name."""
    if source and not is_url(source):
        for folder in folders:
            found = fetcher.locate(source, f"{folder}/{split}.json", required=False, own_folder=False)
            if found is not None:
                return found
    prefix = source.rstrip("/") if source and is_url(source) else PAPER_DATA
    return fetcher.fetch(f"{prefix}/{folders[0]}/{split}.json", f"{folders[0]}/{split}.json")


def summarization_split(path: Path, name: str, split: str, size: int, seed: int) -> list[dict]:
    """The paper's training conversations as they are; document rows (its test files, or dumps of the hub
    datasets): test files in file order, as the paper's code reads them, training files a seeded subset."""
    rows = read_rows(path)
    if split == "train" and any("conversations" in r or "messages" in r for _, r in rows):
        return [{"category": name, "messages": messages} for _, messages, _ in conversation_rows(path, rows)]
    out = summarization_rows(((f"{path}:{line}", r) for line, r in rows), name)
    if split == "train":
        random.Random(f"{seed}-{name}-{split}").shuffle(out)
    return out[:size]


def split_test_documents(rows: list[dict], name: str, n_heldout: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(training rows, held-out rows) of one dataset's test documents: `n_heldout` drawn with `seed` stay held out,
    the others train; both in file order."""
    if not 0 < n_heldout < len(rows):
        raise SystemExit(
            f"error: --split-test {n_heldout}: {name} has {len(rows)} test documents; hold out 1 to {len(rows) - 1}"
        )
    chosen = set(random.Random(f"{seed}-{name}-split-test").sample(range(len(rows)), n_heldout))
    return [r for i, r in enumerate(rows) if i not in chosen], [r for i, r in enumerate(rows) if i in chosen]


def summarization_test_splits(
    source: str | None, seed: int, fetcher: Fetcher, n_heldout: int
) -> tuple[list[dict], list[dict]]:
    """--split-test: training and held-out rows, both from the test documents (see the module docstring)."""
    if source == HUB:
        raise SystemExit("error: --split-test splits the paper's test files; the hub has training splits of its own")
    train, heldout = [], []
    for name, (folders, _, _, _, document_key, summary_key) in SUMMARIZATION_DATASETS.items():
        if source and not is_url(source):
            path = next(
                (p for f in folders if (p := fetcher.locate(source, f"{f}/test.json", False, False)) is not None), None
            )
            if path is None:
                print(
                    f"  skipped  {name}: no {' or '.join(f + '/test.json' for f in folders)} under {source} "
                    f"(without --source the paper's repository has it)",
                    flush=True,
                )
                continue
        else:
            path = summarization_file(fetcher, source, folders, "test")
        with fetcher.expecting(path, f"JSON lines {{{document_key}, {summary_key}}}"):
            rows = summarization_split(path, name, "test", SUMMARIZATION_SIZES[1], seed)
        dataset_train, dataset_heldout = split_test_documents(rows, name, n_heldout, seed)
        fetcher.splits.append(
            f"{name}: {len(rows):,} test documents -> {len(dataset_train):,} train / {len(dataset_heldout):,} held out "
            f"(seed {seed})"
        )
        train += dataset_train
        heldout += dataset_heldout
    if not heldout:
        raise SystemExit(f"error: --split-test: no summarization test file under {source}")
    return train, heldout


def prepare_summarization(source: str | None, seed: int, fetcher: Fetcher) -> tuple[list[dict], list[dict]]:
    n_train, n_heldout = SUMMARIZATION_SIZES
    train, heldout = [], []
    for name, (folders, hub_id, config, heldout_split, document_key, summary_key) in SUMMARIZATION_DATASETS.items():
        for split, size, bucket, hub_split in (
            ("train", n_train, train, "train"),
            ("test", n_heldout, heldout, heldout_split),
        ):
            if source == HUB:
                hub = hub_rows(hub_id, config, hub_split, size, seed)
                bucket += summarization_rows(((f"{hub_id} {hub_split}", r) for r in hub), name)
                fetcher.used.append((f"{name} {split}", f"{hub_id} {hub_split} (Hugging Face hub)"))
                continue
            path = summarization_file(fetcher, source, folders, split)
            expected = f"JSON lines {{{document_key}, {summary_key}}}"
            if split == "train":
                expected = f"{CONVERSATIONS}, or {expected}"
            with fetcher.expecting(path, expected):
                bucket += summarization_split(path, name, split, size, seed)
    return train, heldout
