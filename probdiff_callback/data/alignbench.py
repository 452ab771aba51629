"""The alignbench task: the paper's copy of AlignBench's release file (`data_release.jsonl`, 683 questions in 8
categories, THUDM's v1.1 differs in 242 of them) as held-out queries with their reference answers and subcategories,
and the paper's GPT-4-generated `gpt_generate_train.json`, or the user's own conversations (`--train FILE`), as
training data. The release file may be given on its own (`--source FILE` or its URL); the training file is then looked
for beside it.
"""

from __future__ import annotations

from pathlib import Path

from probdiff_callback.core.categories import ALIGNBENCH, canonical_category, is_alignbench
from probdiff_callback.core.queries import DataFileError, read_rows

from .chat_rows import CONVERSATIONS, conversation_rows, row, text_field
from .sources import PAPER_ALIGNBENCH, Fetcher, is_url

ALIGNBENCH_RELEASE = "data_release.jsonl"
ALIGNBENCH_TRAIN = "gpt_generate_train.json"


def alignbench_file(fetcher: Fetcher, source: str | None, name: str) -> Path:
    """`name` from --source (a directory holding `alignbench/`, a URL prefix, or the release file itself,
    beside which the training file is looked for), else from the paper's repository."""
    if source is not None and is_url(source):
        if not source.endswith((".json", ".jsonl")):
            return fetcher.fetch(f"{source.rstrip('/')}/{name}", name)
        if name == ALIGNBENCH_RELEASE:
            return fetcher.fetch(source, name)
    elif source is not None:
        folder = Path(source).parent if Path(source).is_file() else Path(source)
        if Path(source).is_file() and name == ALIGNBENCH_RELEASE:
            fetcher.used.append((name, source))
            return Path(source)
        for relative in (f"alignbench/{name}", f"alignbench/data/{name}"):
            found = fetcher.locate(str(folder), relative, required=False)
            if found is not None:
                return found
    return fetcher.fetch(f"{PAPER_ALIGNBENCH}/{name}", name)


def prepare_alignbench(
    source: str | None, train_file: str | None, seed: int, fetcher: Fetcher
) -> tuple[list[dict], list[dict]]:
    path = alignbench_file(fetcher, source, ALIGNBENCH_RELEASE)
    heldout = []
    with fetcher.expecting(path, "JSON lines {question_id, category, subcategory, question, reference}"):
        for line, item in read_rows(path):
            where = f"{path}:{line}"
            category = item.get("category")
            if not is_alignbench(category):
                names = ", ".join(f"{names[0]} ({label})" for label, names in ALIGNBENCH.items())
                raise DataFileError(f"{where}: unknown category {category!r}; AlignBench has {names}")
            question, reference = text_field(item, "question", where), text_field(item, "reference", where)
            extra = {"id": f"alignbench-{item['question_id']}"} if "question_id" in item else {}
            heldout.append(
                row(
                    canonical_category(category),
                    question,
                    reference,
                    reference=reference,
                    subcategory=item.get("subcategory"),
                    **extra,
                )
            )
    if train_file is not None:
        train_path = Path(train_file)
        fetcher.used.append((ALIGNBENCH_TRAIN, f"{train_file} (--train)"))
    else:  # the paper's GPT-4-generated training set
        train_path = alignbench_file(fetcher, source, ALIGNBENCH_TRAIN)
    train = []
    with fetcher.expecting(train_path, f"{CONVERSATIONS} or rows with `messages` [{{role, content}}]"):
        for _, messages, item in conversation_rows(train_path):
            train.append({"category": canonical_category(item.get("category")) or "alignbench", "messages": messages})
    return train, heldout
