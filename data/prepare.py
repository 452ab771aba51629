"""Prepare the training and held-out data of a ProbDiff recipe.

    python data/prepare.py translation   [--source DIR_OR_URL] [--out DIR] [--seed N]
    python data/prepare.py summarization [--source DIR] ...
    python data/prepare.py blog          [--source DIR_OR_URL] ...
    python data/prepare.py alignbench    [--source FILE_OR_URL] [--train FILE] ...

Writes `train.jsonl` and `heldout.jsonl` to `data/processed/<task>/` (where the recipes look),
one JSON object per line: `{"id", "category", "messages": [{"role", "content"}, ...]}`; AlignBench
held-out rows also carry `reference` and `subcategory`. The output depends only on the inputs and
`--seed`. Train rows whose user prompt also appears in the held-out set are removed and counted.

Sources (the splits of the ProbDiff paper):
  translation    WMT19 cs-en, de-en, ru-en, zh-en from the Hugging Face hub (`wmt/wmt19`): per pair
                 5,000 train pairs (train split) and 1,000 held-out pairs (validation split), half
                 into English and half out of it. `--source DIR` reads `DIR/<pair>/train.json` (the
                 paper's `conversations` files, or rows `{"translation": {...}}` / `{"cs": .., "en": ..}`)
                 and `DIR/<pair>/test.json` (rows `{"<src>": .., "en": ..}`; first half into English,
                 second half out of it, as the paper's code reads them); what DIR lacks comes from the hub.
  summarization  XSum (`EdinburghNLP/xsum`) and CNN/DM (`abisee/cnn_dailymail` 3.0.0), 5,000 train and
                 1,000 held-out documents each. `--source DIR` reads `DIR/{xsum,cnn_dm}/{train,test}.json[l]`
                 (rows `{document, summary}` or `{article, highlights}`); what DIR lacks comes from the hub.
  blog           The paper's Xiaohongshu set (469 train, 100 held-out): `redbook/train.json` (a JSON list of
                 `conversations`) and `redbook/test.json` (JSON lines `{user, assistant}`) from the paper's
                 repository, or from `--source` (a URL prefix or directory holding `redbook/`, or that folder).
                 A URL --source for translation likewise holds `<pair>/train.json` and `<pair>/test.json`.
  alignbench     AlignBench's `data_release.jsonl` (683 questions, 8 categories) as held-out queries with
                 their reference answers. The paper's 10,245 GPT-4-generated training samples are not public:
                 pass your own conversations with `--train FILE` (rows with `messages` or `conversations`).

File formats are detected by content (the paper's `.json` files are sometimes JSON lines). A bad row
stops the run with its file and line.
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterable
from pathlib import Path

from probdiff_callback.io import DataFileError, read_rows, write_jsonl

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "data" / "processed"
TASKS = ("translation", "summarization", "blog", "alignbench")

PROBDIFF_RAW = "https://raw.githubusercontent.com/xiatingyu/ProbDiff/HEAD"
BLOG_SOURCE = f"{PROBDIFF_RAW}/generation_task/data"  # + redbook/train.json, redbook/test.json
ALIGNBENCH_SOURCE = "https://raw.githubusercontent.com/THUDM/AlignBench/HEAD/data/data_release.jsonl"

# --- task constants (REFERENCE.md) ---------------------------------------------------------
WMT19_PAIRS = ("cs-en", "de-en", "ru-en", "zh-en")
LANGUAGE_NAMES = {"cs": "Czech", "de": "German", "ru": "Russian", "zh": "Chinese", "en": "English"}
TRANSLATION_SIZES = (5000, 1000)  # per pair: train, held-out
# The reference code's prompts: "." in its training files, ":" in its test prompts.
TRANSLATION_TRAIN_PROMPT = "Translate the sentence into {language}.\n{text}"
TRANSLATION_HELDOUT_PROMPT = "Translate the sentence into {language}:\n{text}"

SUMMARIZATION_DATASETS = {
    # name: (hub id, hub config, held-out split, document field, summary field)
    "xsum": ("EdinburghNLP/xsum", None, "test", "document", "summary"),
    "cnn_dm": ("abisee/cnn_dailymail", "3.0.0", "test", "article", "highlights"),
}
SUMMARIZATION_SIZES = (5000, 1000)
SUMMARIZATION_PROMPT = (
    "I want you to act as a Summarization Writer.\n"
    "Your goal is to provide a concise and coherent summary that captures the essential information and ideas "
    "expressed in the given content.\nHere is the content:\n{content}\nYour answer: "
)

BLOG_SIZES = (469, 100)

ALIGNBENCH_CATEGORIES = {
    "专业能力": "Professional",
    "数学计算": "Mathematics",
    "基本任务": "Fundamental",
    "逻辑推理": "Logical",
    "文本写作": "Writing",
    "中文理解": "Chinese",
    "角色扮演": "Roleplay",
    "综合问答": "Open-ended",
}

HUB_STREAM_BUFFER = 10_000


# --- reading ---------------------------------------------------------------------------------
def is_url(source: str) -> bool:
    return source.startswith(("http://", "https://"))


def fetch(url: str, cache: Path) -> Path:
    """Download `url` into `cache` (once per run) and return the local file."""
    target = cache / re.sub(r"[^A-Za-z0-9._-]", "_", url)
    if not target.is_file():
        print(f"downloading {url}", flush=True)
        try:
            with urllib.request.urlopen(url, timeout=60) as response:
                target.write_bytes(response.read())
        except (urllib.error.URLError, TimeoutError, OSError) as err:
            raise SystemExit(
                f"error: could not download {url} ({err}). Without network access, download the file elsewhere "
                "and pass its folder or path with --source."
            ) from None
    return target


def locate(source: str, relative: str, cache: Path, required: bool = True) -> Path | None:
    """`relative` (e.g. `redbook/train.json`) under a URL prefix or a directory; a directory may also be
    the file's own folder (`.../redbook`) or the file itself."""
    if is_url(source):
        return fetch(f"{source.rstrip('/')}/{relative}", cache)
    base = Path(source)
    name = relative.split("/")[-1]
    candidates = [base / relative, base / name] if base.is_dir() else [base]
    stem = Path(name).stem
    for candidate in list(candidates):  # the paper's `.json` files are also found as `.jsonl` and vice versa
        candidates += [candidate.with_name(stem + ".json"), candidate.with_name(stem + ".jsonl")]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    if required:
        raise SystemExit(f"error: {relative} not found under --source {source} (looked for {', '.join(map(str, candidates[:2]))})")
    return None


def turns_to_messages(turns: object, where: str) -> list[dict]:
    """`conversations` ({from, value}) or `messages` ({role, content}) as chat messages."""
    roles = {"user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant", "system": "system"}
    if not isinstance(turns, list) or not turns:
        raise DataFileError(f"{where}: expected a non-empty list of turns")
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            raise DataFileError(f"{where}: a turn is {type(turn).__name__}, expected an object")
        role = turn.get("role", turn.get("from"))
        content = turn.get("content", turn.get("value"))
        if role not in roles:
            raise DataFileError(f"{where}: unknown role {role!r}; expected one of {', '.join(roles)}")
        if not isinstance(content, str) or not content.strip():
            raise DataFileError(f"{where}: a {role} turn has no text")
        messages.append({"role": roles[role], "content": content})
    if not any(m["role"] == "user" for m in messages) or messages[-1]["role"] != "assistant":
        raise DataFileError(f"{where}: a conversation needs a user turn and must end with an assistant turn")
    return messages


def conversation_rows(path: Path, rows: list[tuple[int, dict]] | None = None) -> list[tuple[str, list[dict], dict]]:
    """(where, messages, row) for each row of a conversation file (`rows`: its rows, if already read)."""
    out = []
    for line, row in read_rows(path) if rows is None else rows:
        turns = row.get("messages", row.get("conversations"))
        if turns is None and isinstance(row.get("user"), str) and isinstance(row.get("assistant"), str):
            turns = [{"role": "user", "content": row["user"]}, {"role": "assistant", "content": row["assistant"]}]
        if turns is None:
            raise DataFileError(
                f"{path}:{line}: expected `messages`, `conversations` or `user` + `assistant` (keys here: {', '.join(row) or 'none'})"
            )
        out.append((f"{path}:{line}", turns_to_messages(turns, f"{path}:{line}"), row))
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


def finish(task: str, train: list[dict], heldout: list[dict]) -> tuple[list[dict], list[dict], dict]:
    """Ids, duplicate removal (train rows whose prompt is in held-out, and repeats within a split)."""
    stats = {"train_in_heldout": 0, "train_repeats": 0, "heldout_repeats": 0}
    seen_heldout, kept_heldout = set(), []
    for row in heldout:
        key = normalize(user_prompt(row))
        if key in seen_heldout:
            stats["heldout_repeats"] += 1
            continue
        seen_heldout.add(key)
        kept_heldout.append(row)
    seen_train, kept_train = set(), []
    for row in train:
        key = normalize(user_prompt(row) + "\0" + row["messages"][-1]["content"])
        if normalize(user_prompt(row)) in seen_heldout:
            stats["train_in_heldout"] += 1
        elif key in seen_train:
            stats["train_repeats"] += 1
        else:
            seen_train.add(key)
            kept_train.append(row)
    out = []
    for split, rows in (("train", kept_train), ("heldout", kept_heldout)):
        out.append([{"id": item.get("id", f"{task}-{split}-{index:05d}"), **item} for index, item in enumerate(rows)])
    return out[0], out[1], stats


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


def prepare_translation(source: str | None, seed: int, cache: Path) -> tuple[list[dict], list[dict]]:
    n_train, n_heldout = TRANSLATION_SIZES
    train, heldout = [], []
    for pair in WMT19_PAIRS:
        train_file = locate(source, f"{pair}/train.json", cache, required=False) if source else None
        test_file = locate(source, f"{pair}/test.json", cache, required=False) if source else None
        if train_file is not None:
            rows = read_rows(train_file)
            if any("conversations" in r or "messages" in r for _, r in rows):
                for where, messages, _ in conversation_rows(train_file, rows):
                    prompt = next(m["content"] for m in messages if m["role"] == "user")
                    category = translation_category(prompt, pair, where)
                    train.append({"category": category, "messages": messages})
            else:  # plain pairs (e.g. a dump of the hub dataset): a seeded subset of n_train
                pairs = translation_pairs(((f"{train_file}:{line}", r) for line, r in rows), pair)
                random.Random(f"{seed}-{pair}").shuffle(pairs)
                train += split_directions(pairs[:n_train], pair, TRANSLATION_TRAIN_PROMPT)
        else:
            hub = hub_rows("wmt/wmt19", pair, "train", n_train, seed)
            train += split_directions(translation_pairs(((f"wmt/wmt19 {pair} train", r) for r in hub), pair), pair, TRANSLATION_TRAIN_PROMPT)
        if test_file is not None:  # in file order, as the paper's code reads its test files
            pairs = translation_pairs(((f"{test_file}:{line}", r) for line, r in read_rows(test_file)), pair)[:n_heldout]
        else:
            hub = hub_rows("wmt/wmt19", pair, "validation", n_heldout, seed)
            pairs = translation_pairs(((f"wmt/wmt19 {pair} validation", r) for r in hub), pair)
        heldout += split_directions(pairs, pair, TRANSLATION_HELDOUT_PROMPT)
    return train, heldout


def summarization_rows(items: Iterable[tuple[str, dict]], name: str) -> list[dict]:
    _, _, _, document_key, summary_key = SUMMARIZATION_DATASETS[name]
    out = []
    for where, item in items:
        # Either dataset's field names are accepted, so a file of one can be read under the other's name.
        document = item.get(document_key, item.get("document", item.get("article")))
        summary = item.get(summary_key, item.get("summary", item.get("highlights")))
        fields = {"document": document, "summary": summary}
        out.append(row(name, SUMMARIZATION_PROMPT.format(content=text_field(fields, "document", where)), text_field(fields, "summary", where)))
    return out


def prepare_summarization(source: str | None, seed: int, cache: Path) -> tuple[list[dict], list[dict]]:
    if source and is_url(source):
        raise SystemExit("error: summarization --source must be a local directory (XSum and CNN/DM come from the hub)")
    n_train, n_heldout = SUMMARIZATION_SIZES
    train, heldout = [], []
    for name, (hub_id, config, heldout_split, _, _) in SUMMARIZATION_DATASETS.items():
        for split, size, bucket, hub_split in (("train", n_train, train, "train"), ("test", n_heldout, heldout, heldout_split)):
            local = locate(source, f"{name}/{split}.json", cache, required=False) if source else None
            if local is not None:
                items = [(f"{local}:{line}", r) for line, r in read_rows(local)]
                rows = summarization_rows(items, name)
                random.Random(f"{seed}-{name}-{split}").shuffle(rows)
                bucket += rows[:size]
            else:
                hub = hub_rows(hub_id, config, hub_split, size, seed)
                bucket += summarization_rows(((f"{hub_id} {hub_split}", r) for r in hub), name)
    return train, heldout


def prepare_blog(source: str | None, seed: int, cache: Path) -> tuple[list[dict], list[dict]]:
    source = source or BLOG_SOURCE
    splits = []
    for name in ("train", "test"):
        path = locate(source, f"redbook/{name}.json", cache)
        splits.append([{"category": "blog", "messages": messages} for _, messages, _ in conversation_rows(path)])
    return splits[0], splits[1]


def prepare_alignbench(source: str | None, train_file: str | None, seed: int, cache: Path) -> tuple[list[dict], list[dict]]:
    path = fetch(source or ALIGNBENCH_SOURCE, cache) if not source or is_url(source) else locate(source, "alignbench/data_release.jsonl", cache)
    heldout = []
    for line, item in read_rows(path):
        where = f"{path}:{line}"
        category = item.get("category")
        if category not in ALIGNBENCH_CATEGORIES and category not in ALIGNBENCH_CATEGORIES.values():
            raise DataFileError(f"{where}: unknown category {category!r}; AlignBench has {', '.join(ALIGNBENCH_CATEGORIES)}")
        question, reference = text_field(item, "question", where), text_field(item, "reference", where)
        extra = {"id": f"alignbench-{item['question_id']}"} if "question_id" in item else {}
        heldout.append(
            row(ALIGNBENCH_CATEGORIES.get(category, category), question, reference, reference=reference, subcategory=item.get("subcategory"), **extra)
        )
    train = []
    if train_file is not None:
        for where, messages, item in conversation_rows(Path(train_file)):
            category = item.get("category")
            train.append({"category": ALIGNBENCH_CATEGORIES.get(category, category), "messages": messages})
    return train, heldout


# --- main ------------------------------------------------------------------------------------
def prepare(task: str, source: str | None = None, out: Path = DEFAULT_OUT, seed: int = 0, train_file: str | None = None) -> dict:
    """Write `<out>/<task>/{train,heldout}.jsonl`; returns counts."""
    if task not in TASKS:
        raise SystemExit(f"error: unknown task {task!r}; tasks: {', '.join(TASKS)}")
    if train_file is not None and task != "alignbench":
        raise SystemExit("error: --train is for alignbench (its training data is not public); other tasks read --source")
    with tempfile.TemporaryDirectory(prefix="probdiff-prepare-") as tmp:
        cache = Path(tmp)
        if task == "translation":
            train, heldout = prepare_translation(source, seed, cache)
        elif task == "summarization":
            train, heldout = prepare_summarization(source, seed, cache)
        elif task == "blog":
            train, heldout = prepare_blog(source, seed, cache)
        else:
            train, heldout = prepare_alignbench(source, train_file, seed, cache)
    train, heldout, stats = finish(task, train, heldout)
    target = Path(out) / task
    if train:
        write_jsonl(target / "train.jsonl", train)
    elif (target / "train.jsonl").exists():
        (target / "train.jsonl").unlink()  # a stale file must not pair with a new held-out set
    write_jsonl(target / "heldout.jsonl", heldout)
    counts = {"train": len(train), "heldout": len(heldout), **stats}
    for split, rows in (("train", train), ("heldout", heldout)):
        by_category: dict[str, int] = {}
        for item in rows:
            by_category[item["category"]] = by_category.get(item["category"], 0) + 1
        counts[f"{split}_by_category"] = by_category
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("task", choices=TASKS)
    parser.add_argument("--source", default=None, help="a local directory/file or a URL prefix instead of the default source")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help=f"output root; files go to OUT/<task>/ [{DEFAULT_OUT}]")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed for the translation and summarization subsets [0]")
    parser.add_argument("--train", dest="train_file", default=None, help="alignbench only: your training conversations (JSON lines or list)")
    args = parser.parse_args(argv)
    try:
        counts = prepare(args.task, args.source, Path(args.out), args.seed, args.train_file)
    except (DataFileError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    target = Path(args.out) / args.task
    print(f"{args.task}: {counts['train']} train rows, {counts['heldout']} held-out rows -> {target}")
    for split in ("train", "heldout"):
        print(f"  {split:<8} " + ", ".join(f"{k}: {v}" for k, v in sorted(counts[f"{split}_by_category"].items())))
    print(
        f"  removed: {counts['train_in_heldout']} train rows whose prompt is in held-out, "
        f"{counts['train_repeats']} repeated train rows, {counts['heldout_repeats']} repeated held-out prompts"
    )
    if args.task == "alignbench" and not counts["train"]:
        print(
            "  no training data written: AlignBench's training set (10,245 GPT-4 samples in the paper) is not public. "
            f"Pass your own conversations with --train FILE (written to {target / 'train.jsonl'})."
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
