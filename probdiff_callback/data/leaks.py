"""What every task's rows go through last (`finish`): ids, and the removal of training rows that hold a held-out
row, of repeated training rows and of repeated held-out prompts, each counted for the report. What makes a training
row hold a held-out one depends on the task (`leak_keys`: a sentence of a translation pair, a summarized document,
otherwise the prompt), so this module reads the translation and summarization prompts through their modules, and
`LEAK_CHECKS` says in the report what was checked.
"""

from __future__ import annotations

from .summarization import summarized_document
from .translation import TRANSLATION_TARGET

LEAK_CHECKS = {
    "translation": "train rows sharing a sentence with held-out (either side of a pair, either direction)",
    "summarization": "train rows sharing a document with held-out",
    "blog": "train rows whose prompt is in held-out",
    "alignbench": "train rows whose prompt is a held-out question",
}


def user_prompt(row: dict) -> str:
    return next(m["content"] for m in row["messages"] if m["role"] == "user")


def normalize(text: str) -> str:
    return " ".join(text.split())


def leak_keys(task: str, item: dict) -> set[str]:
    """The normalized texts by which a training row would hold a held-out row.

    Translation: both sentences of the pair (the source after the prompt's first line, and the
    reference translation), so that a held-out sentence is caught under the training prompt's "."
    (held-out prompts end in ":") and in the other direction (its translation as the source).
    Summarization: the document inside the prompt. The other tasks: the user prompt.
    """
    prompt = user_prompt(item)
    if task == "translation":
        match = TRANSLATION_TARGET.match(prompt)
        source = prompt[match.end() :] if match is not None else prompt
        return {normalize(source), normalize(item["messages"][-1]["content"])}
    if task == "summarization":
        return {normalize(summarized_document(prompt))}
    return {normalize(prompt)}


def finish(task: str, train: list[dict], heldout: list[dict]) -> tuple[list[dict], list[dict], dict]:
    """Ids, and duplicate removal: held-out rows whose prompt repeats, train rows that leak a held-out
    row (`leak_keys`) and train rows that repeat (prompt and answer).

    Leaking train rows are dropped, not the held-out ones: the held-out set is the paper's split and
    stays comparable with its numbers. The count is reported, never dropped silently.
    """
    stats = {"train_in_heldout": 0, "train_repeats": 0, "heldout_repeats": 0}
    seen_heldout, kept_heldout = set(), []
    heldout_keys: set[str] = set()
    for item in heldout:
        key = normalize(user_prompt(item))
        if key in seen_heldout:
            stats["heldout_repeats"] += 1
            continue
        seen_heldout.add(key)
        heldout_keys |= leak_keys(task, item)
        kept_heldout.append(item)
    seen_train, kept_train = set(), []
    for item in train:
        key = normalize(user_prompt(item) + "\0" + item["messages"][-1]["content"])
        if leak_keys(task, item) & heldout_keys:
            stats["train_in_heldout"] += 1
        elif key in seen_train:
            stats["train_repeats"] += 1
        else:
            seen_train.add(key)
            kept_train.append(item)
    out = []
    for split, rows in (("train", kept_train), ("heldout", kept_heldout)):
        out.append([{"id": item.get("id", f"{task}-{split}-{index:05d}"), **item} for index, item in enumerate(rows)])
    return out[0], out[1], stats
