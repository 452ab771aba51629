"""The translation task: WMT19 cs-en, de-en, ru-en and zh-en, from the paper's per-pair files (`<pair>/train.json`,
5,000 `conversations` in the reference code's prompt, and `<pair>/test.json`, 1,000 plain pairs, first half into
English and second half out of it) or from the hub's `wmt/wmt19` train and validation splits. It also holds the
prompt's pattern (`TRANSLATION_TARGET`), which the leak checks use to find a row's source sentence.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable
from pathlib import Path

from probdiff_callback.core.queries import DataFileError, read_rows

from .chat_rows import conversation_rows, row, text_field
from .sources import HUB, Fetcher, hub_rows

WMT19_PAIRS = ("cs-en", "de-en", "ru-en", "zh-en")
LANGUAGE_NAMES = {"cs": "Czech", "de": "German", "ru": "Russian", "zh": "Chinese", "en": "English"}
TRANSLATION_SIZES = (5000, 1000)  # per pair: train, held-out
# The reference code's prompts: "." in its training files, ":" in its test prompts.
TRANSLATION_TRAIN_PROMPT = "Translate the sentence into {language}.\n{text}"
TRANSLATION_HELDOUT_PROMPT = "Translate the sentence into {language}:\n{text}"
TRANSLATION_TARGET = re.compile(r"^Translate the sentence into (\w+)[.:]\s*\n")

TRANSLATION_EXPECTED = {
    "train": "a JSON list of `conversations` [{from, value}] whose user turn starts 'Translate the sentence into "
    '<Language>.\', or rows {"<src>": .., "en": ..}',
    "test": 'JSON lines {"<src>": .., "en": ..}, e.g. {"zh", "en"}',
}


def translation_category(prompt: str, pair: str, where: str) -> str:
    match = TRANSLATION_TARGET.match(prompt)
    if match is None:
        raise DataFileError(f"{where}: a translation prompt must start 'Translate the sentence into <Language>.'")
    other = pair.split("-")[0]
    if match.group(1) == "English":
        return f"{other}-en"
    if match.group(1) != LANGUAGE_NAMES[other]:
        raise DataFileError(f"{where}: prompt asks for {match.group(1)}, but this is the {pair} pair")
    return f"en-{other}"


def translation_pairs(rows: Iterable[tuple[str, dict]], pair: str) -> list[tuple[str, str]]:
    """(source-language text, English text) from `{"translation": {...}}` or flat `{"<src>": .., "en": ..}` rows."""
    other = pair.split("-")[0]
    out = []
    for where, item in rows:
        fields = item.get("translation", item)
        if not isinstance(fields, dict):
            raise DataFileError(f"{where}: `translation` must be an object with `{other}` and `en`")
        out.append((text_field(fields, other, where), text_field(fields, "en", where)))
    return out


def split_directions(pairs: list[tuple[str, str]], pair: str, template: str) -> list[dict]:
    """First half into English, second half out of it (as the paper's test files are read)."""
    other = pair.split("-")[0]
    half = len(pairs) // 2
    rows = []
    for index, (source, english) in enumerate(pairs):
        if index < half:
            rows.append(row(f"{other}-en", template.format(language="English", text=source), english))
        else:
            rows.append(row(f"en-{other}", template.format(language=LANGUAGE_NAMES[other], text=english), source))
    return rows


def translation_train_rows(path: Path, pair: str, seed: int, n_train: int) -> list[dict]:
    """The paper's conversations as they are (all of them), or a seeded subset of plain pairs."""
    rows = read_rows(path)
    if any("conversations" in r or "messages" in r for _, r in rows):
        out = []
        for where, messages, _ in conversation_rows(path, rows):
            prompt = next(m["content"] for m in messages if m["role"] == "user")
            out.append({"category": translation_category(prompt, pair, where), "messages": messages})
        return out
    pairs = translation_pairs(((f"{path}:{line}", r) for line, r in rows), pair)  # e.g. a dump of the hub dataset
    random.Random(f"{seed}-{pair}").shuffle(pairs)
    return split_directions(pairs[:n_train], pair, TRANSLATION_TRAIN_PROMPT)


def prepare_translation(source: str | None, seed: int, fetcher: Fetcher) -> tuple[list[dict], list[dict]]:
    n_train, n_heldout = TRANSLATION_SIZES
    train, heldout = [], []
    for pair in WMT19_PAIRS:
        if source == HUB:
            for split, size, bucket, template in (
                ("train", n_train, train, TRANSLATION_TRAIN_PROMPT),
                ("validation", n_heldout, heldout, TRANSLATION_HELDOUT_PROMPT),
            ):
                hub = ((f"wmt/wmt19 {pair} {split}", r) for r in hub_rows("wmt/wmt19", pair, split, size, seed))
                bucket += split_directions(translation_pairs(hub, pair), pair, template)
            fetcher.used.append((pair, "wmt/wmt19 train and validation (Hugging Face hub)"))
            continue
        train_file = fetcher.paper_file(source, f"{pair}/train.json")
        with fetcher.expecting(train_file, TRANSLATION_EXPECTED["train"]):
            train += translation_train_rows(train_file, pair, seed, n_train)
        test_file = fetcher.paper_file(source, f"{pair}/test.json")
        with fetcher.expecting(test_file, TRANSLATION_EXPECTED["test"]):
            # in file order, as the paper's code reads its test files
            rows = ((f"{test_file}:{line}", r) for line, r in read_rows(test_file))
            pairs = translation_pairs(rows, pair)[:n_heldout]
        heldout += split_directions(pairs, pair, TRANSLATION_HELDOUT_PROMPT)
    return train, heldout
