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
import contextlib
import random
import re
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from pathlib import Path

from probdiff_callback.core.categories import ALIGNBENCH, canonical_category, is_alignbench
from probdiff_callback.core.queries import DataFileError, chat_messages, read_rows
from probdiff_callback.runs.run_files import write_jsonl

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "data" / "processed"
TASKS = ("translation", "summarization", "blog", "alignbench")

PROBDIFF_RAW = "https://raw.githubusercontent.com/xiatingyu/ProbDiff/HEAD"
PAPER_DATA = f"{PROBDIFF_RAW}/generation_task/data"  # + <pair>/, xsum/, cnn/, redbook/
PAPER_ALIGNBENCH = f"{PROBDIFF_RAW}/alignbench/data"  # + data_release.jsonl, gpt_generate_train.json
HUB = "hub"  # --source hub: translation and summarization from the Hugging Face hub

# --- task constants (REFERENCE.md) ---------------------------------------------------------
WMT19_PAIRS = ("cs-en", "de-en", "ru-en", "zh-en")
LANGUAGE_NAMES = {"cs": "Czech", "de": "German", "ru": "Russian", "zh": "Chinese", "en": "English"}
TRANSLATION_SIZES = (5000, 1000)  # per pair: train, held-out
# The reference code's prompts: "." in its training files, ":" in its test prompts.
TRANSLATION_TRAIN_PROMPT = "Translate the sentence into {language}.\n{text}"
TRANSLATION_HELDOUT_PROMPT = "Translate the sentence into {language}:\n{text}"

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

BLOG_SIZES = (469, 100)

ALIGNBENCH_RELEASE = "data_release.jsonl"
ALIGNBENCH_TRAIN = "gpt_generate_train.json"

HUB_STREAM_BUFFER = 10_000


# --- reading ---------------------------------------------------------------------------------
def is_url(source: str) -> bool:
    return source.startswith(("http://", "https://"))


class Fetcher:
    """Finds and downloads the input files of one run, and remembers where each came from: the
    report names every source used, and an error in a downloaded file names its URL.

    (A plain class: tests load this script as a module without registering it, which `dataclass` needs.)
    """

    def __init__(self, cache: Path) -> None:
        self.cache = cache
        self.origins: dict[Path, str] = {}  # downloaded file -> its URL
        self.used: list[tuple[str, str]] = []  # (what, where from), for the report
        self.splits: list[str] = []  # how --split-test split each dataset, for the report

    def fetch(self, url: str, what: str) -> Path:
        """Download `url` into the cache (once per run) and return the local file."""
        target = self.cache / re.sub(r"[^A-Za-z0-9._-]", "_", url)
        if not target.is_file():
            print(f"downloading {url}", flush=True)
            try:
                with urllib.request.urlopen(url, timeout=60) as response:
                    target.write_bytes(response.read())
            except (urllib.error.URLError, TimeoutError, OSError) as err:
                raise SystemExit(
                    f"error: could not download {url} ({err}). Without network access, download it elsewhere and pass "
                    "its folder or path with --source (translation and summarization: --source hub takes the "
                    "Hugging Face hub's splits instead of the paper's)."
                ) from None
        self.origins[target] = url
        self.used.append((what, url))
        return target

    def locate(self, source: str, relative: str, required: bool = True, own_folder: bool = True) -> Path | None:
        """`relative` (e.g. `redbook/train.json`) under a URL prefix or a directory; with `own_folder` a
        directory may also be the file's own folder (`.../redbook`) or the file itself."""
        if is_url(source):
            return self.fetch(f"{source.rstrip('/')}/{relative}", relative)
        base = Path(source)
        name = relative.split("/")[-1]
        if not own_folder:
            candidates = [base / relative]
        else:
            candidates = [base / relative, base / name] if base.is_dir() else [base]
        stem = Path(name).stem
        for candidate in list(candidates):  # the paper's `.json` files are also found as `.jsonl` and vice versa
            candidates += [candidate.with_name(stem + ".json"), candidate.with_name(stem + ".jsonl")]
        for candidate in candidates:
            if candidate.is_file():
                self.used.append((relative, str(candidate)))
                return candidate
        if required:
            looked = ", ".join(map(str, candidates[:2]))
            raise SystemExit(f"error: {relative} not found under --source {source} (looked for {looked})")
        return None

    def paper_file(self, source: str | None, relative: str, default: str = PAPER_DATA) -> Path:
        """`relative` from `--source` where it holds it, else from the paper's repository (`default`)."""
        found = self.locate(source, relative, required=False) if source else None
        return found if found is not None else self.fetch(f"{default}/{relative}", relative)

    @contextlib.contextmanager
    def expecting(self, path: Path, expected: str) -> Iterator[None]:
        """Errors from reading `path` name its URL when it was downloaded and say what was expected."""
        try:
            yield
        except DataFileError as err:
            message = str(err)
            if path in self.origins:
                message = message.replace(str(path), self.origins[path])
                expected += "; the upstream file may have changed: pass a corrected copy with --source"
            raise DataFileError(f"{message} (expected {expected})") from None


def conversation_rows(path: Path, rows: list[tuple[int, dict]] | None = None) -> list[tuple[str, list[dict], dict]]:
    """(where, messages, row) for each row of a conversation file (`rows`: its rows, if already read)."""
    out = []
    for line, row in read_rows(path) if rows is None else rows:
        turns = row.get("messages", row.get("conversations"))
        if turns is None and isinstance(row.get("user"), str) and isinstance(row.get("assistant"), str):
            turns = [{"role": "user", "content": row["user"]}, {"role": "assistant", "content": row["assistant"]}]
        if turns is None:
            raise DataFileError(
                f"{path}:{line}: expected `messages`, `conversations` or `user` + `assistant` "
                f"(keys here: {', '.join(row) or 'none'})"
            )
        out.append((f"{path}:{line}", chat_messages(turns, f"{path}:{line}"), row))
    return out


def text_field(row: dict, key: str, where: str) -> str:
    value = row.get(key)
    if not isinstance(value, str) or not value.strip():
        raise DataFileError(f"{where}: missing or empty `{key}` (keys here: {', '.join(row) or 'none'})")
    return value.strip()


def hub_rows(hub_id: str, config: str | None, split: str, n: int, seed: int) -> list[dict]:
    """`n` rows of a hub dataset split, shuffled deterministically for `seed` (streamed: WMT19 train splits
    hold millions of pairs)."""
    try:
        from datasets import load_dataset

        stream = load_dataset(hub_id, config, split=split, streaming=True)
        return list(stream.shuffle(seed=seed, buffer_size=HUB_STREAM_BUFFER).take(n))
    except Exception as err:
        raise SystemExit(
            f"error: could not load {hub_id}{' ' + config if config else ''} [{split}] from the Hugging Face hub "
            f"({type(err).__name__}: {str(err)[:200]}). Without network access, pass a local copy with --source."
        ) from None


# --- building rows ---------------------------------------------------------------------------
def user_prompt(row: dict) -> str:
    return next(m["content"] for m in row["messages"] if m["role"] == "user")


def normalize(text: str) -> str:
    return " ".join(text.split())


def summarized_document(prompt: str) -> str:
    """The document inside the reference summarization prompt; a prompt in another wording whole."""
    match = SUMMARIZATION_CONTENT.search(prompt)
    return match.group(1) if match is not None else prompt


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


def shuffle_references(rows: list[dict], seed: int) -> list[dict]:
    """The rows with their reference answers (last assistant turns) permuted across rows of the same category by a
    seeded derangement (a random cycle: no row keeps its own), each row naming whose answer it now holds."""
    by_category: dict[str, list[int]] = {}
    for index, item in enumerate(rows):
        by_category.setdefault(item["category"], []).append(index)
    out = [dict(item) for item in rows]
    for category, indices in sorted(by_category.items()):
        if len(indices) < 2:
            raise SystemExit(
                f"error: --shuffle-references: category {category!r} has one training row, nothing to swap"
            )
        order = indices[:]
        random.Random(f"{seed}-{category}-shuffle").shuffle(order)
        for position, target in enumerate(order):  # each row takes the answer of the next one in a random cycle
            donor = rows[order[(position + 1) % len(order)]]
            messages = [dict(m) for m in rows[target]["messages"]]
            messages[-1] = {**messages[-1], "content": donor["messages"][-1]["content"]}
            out[target] = {**rows[target], "messages": messages, "reference_of": donor["id"]}
    return out


def row(category: str, user: str, assistant: str, **extra) -> dict:
    return {
        "category": category,
        "messages": [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}],
        **extra,
    }


# --- tasks -----------------------------------------------------------------------------------
TRANSLATION_TARGET = re.compile(r"^Translate the sentence into (\w+)[.:]\s*\n")


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


CONVERSATIONS = "a JSON list of `conversations` [{from, value}]"
TRANSLATION_EXPECTED = {
    "train": "a JSON list of `conversations` [{from, value}] whose user turn starts 'Translate the sentence into "
    '<Language>.\', or rows {"<src>": .., "en": ..}',
    "test": 'JSON lines {"<src>": .., "en": ..}, e.g. {"zh", "en"}',
}


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


def prepare_blog(source: str | None, seed: int, fetcher: Fetcher) -> tuple[list[dict], list[dict]]:
    splits = []
    for name, expected in (("train", CONVERSATIONS), ("test", "JSON lines {user, assistant}")):
        path = fetcher.paper_file(source, f"redbook/{name}.json")
        with fetcher.expecting(path, expected):
            splits.append([{"category": "blog", "messages": messages} for _, messages, _ in conversation_rows(path)])
    return splits[0], splits[1]


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


# --- main ------------------------------------------------------------------------------------
LEAK_CHECKS = {
    "translation": "train rows sharing a sentence with held-out (either side of a pair, either direction)",
    "summarization": "train rows sharing a document with held-out",
    "blog": "train rows whose prompt is in held-out",
    "alignbench": "train rows whose prompt is a held-out question",
}


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
