"""data/prepare.py (probdiff_callback/data/prepare.py) on small files in each real format (written here), on the
paper's files when they are present, deterministic output, duplicate removal, and errors that name file and line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from probdiff_callback.core.queries import read_rows
from probdiff_callback.data import chat_rows, leaks, prepare, sources, summarization, translation

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT.parent / "shared" / "data" / "probdiff-reference"
SUMMARY_PROMPT_START = "I want you to act as a Summarization Writer.\n"


def write_json_list(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, ensure_ascii=False, indent=2), encoding="utf-8")


def write_json_lines(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def conversation(i: int, user: str, assistant: str) -> dict:
    return {"id": i, "conversations": [{"from": "user", "value": user}, {"from": "assistant", "value": assistant}]}


def check_rows(rows: list[dict], categories: set[str]) -> None:
    assert len({r["id"] for r in rows}) == len(rows)
    for row in rows:
        assert row["category"] in categories
        assert [m["role"] for m in row["messages"]] == ["user", "assistant"]
        assert all(isinstance(m["content"], str) and m["content"] for m in row["messages"])


# --- blog: the paper's redbook files (train.json is a JSON list, test.json JSON lines) -------------------
def blog_source(root: Path) -> Path:
    write_json_list(
        root / "redbook" / "train.json",
        [conversation(i, f"写一篇小红书文案 {i}", f"标题：第{i}篇 ✨") for i in range(5)]
        + [conversation(5, "held-out prompt 1", "a copy of a held-out prompt is removed")],
    )
    write_json_lines(
        root / "redbook" / "test.json", [{"user": f"held-out prompt {i}", "assistant": f"答 {i}"} for i in range(3)]
    )
    return root


def test_blog_formats_duplicates_and_determinism(tmp_path):
    source = blog_source(tmp_path / "src")
    counts = prepare.prepare("blog", str(source), tmp_path / "out")
    train, heldout = read(tmp_path / "out/blog/train.jsonl"), read(tmp_path / "out/blog/heldout.jsonl")
    assert (counts["train"], counts["heldout"], counts["train_in_heldout"]) == (5, 3, 1)
    check_rows(train + heldout, {"blog"})
    assert train[0]["messages"][0] == {"role": "user", "content": "写一篇小红书文案 0"}
    assert heldout[2]["messages"][1]["content"] == "答 2"
    first = (tmp_path / "out/blog/train.jsonl").read_bytes()
    prepare.prepare("blog", str(source / "redbook"), tmp_path / "out")  # the task folder itself works too
    assert (tmp_path / "out/blog/train.jsonl").read_bytes() == first


# --- translation: the paper's per-pair files -------------------------------------------------------------
def test_translation_directions_and_prompts(tmp_path):
    src = tmp_path / "src"
    for pair, lang in (("cs-en", "Czech"), ("de-en", "German"), ("ru-en", "Russian"), ("zh-en", "Chinese")):
        other = pair[:2]
        write_json_list(
            src / pair / "train.json",
            [
                conversation(0, f"Translate the sentence into English.\n{other} sentence", "English sentence"),
                conversation(1, f"Translate the sentence into {lang}.\nAnother English sentence", f"{other} text"),
            ],
        )
        write_json_lines(
            src / pair / "test.json", [{other: f"{other} test {i}", "en": f"en test {i}"} for i in range(4)]
        )
    counts = prepare.prepare("translation", str(src), tmp_path / "out")
    assert counts["train_by_category"] == {
        c: 1 for c in ("cs-en", "en-cs", "de-en", "en-de", "ru-en", "en-ru", "zh-en", "en-zh")
    }
    assert counts["heldout_by_category"] == {c: 2 for c in counts["train_by_category"]}
    heldout = read(tmp_path / "out/translation/heldout.jsonl")
    check_rows(heldout, set(counts["train_by_category"]))
    zh = [r for r in heldout if r["category"] in ("zh-en", "en-zh")]
    # first half into English, second half out of it, with the reference test prompt
    assert zh[0]["messages"] == [
        {"role": "user", "content": "Translate the sentence into English:\nzh test 0"},
        {"role": "assistant", "content": "en test 0"},
    ]
    assert zh[-1]["messages"] == [
        {"role": "user", "content": "Translate the sentence into Chinese:\nen test 3"},
        {"role": "assistant", "content": "zh test 3"},
    ]


def test_translation_wrong_language_names_file_and_line(tmp_path):
    src = tmp_path / "src"
    # cs-en is read first, so the error comes before any other pair is looked for
    write_json_list(
        src / "cs-en" / "train.json",
        [
            conversation(0, "Translate the sentence into English.\nx", "y"),
            conversation(1, "Translate the sentence into German.\nx", "y"),
        ],
    )
    with pytest.raises(
        prepare.DataFileError, match=r"cs-en/train.json:15: prompt asks for German, but this is the cs-en pair"
    ):
        prepare.prepare_translation(str(src), 0, prepare.Fetcher(tmp_path))


# --- summarization: XSum {document, summary} and CNN/DM {article, highlights} ---------------------------
def test_summarization_formats_and_seeded_subsets(tmp_path, monkeypatch):
    src = tmp_path / "src"
    write_json_lines(
        src / "xsum" / "train.jsonl", [{"document": f"doc {i}", "summary": f"sum {i}", "id": str(i)} for i in range(8)]
    )
    write_json_lines(
        src / "xsum" / "test.json",
        [{"document": f"test doc {i}", "summary": f"test sum {i}", "id": str(i)} for i in range(3)],
    )
    write_json_list(
        src / "cnn_dm" / "train.json",
        [{"article": f"article {i}", "highlights": f"hl {i}", "id": str(i)} for i in range(4)],
    )
    write_json_lines(src / "cnn_dm" / "test.jsonl", [{"article": "test article", "highlights": "hl"}])
    monkeypatch.setattr(summarization, "SUMMARIZATION_SIZES", (5, 2))
    prepare.prepare("summarization", str(src), tmp_path / "a", seed=1)
    prepare.prepare("summarization", str(src), tmp_path / "b", seed=1)
    prepare.prepare("summarization", str(src), tmp_path / "c", seed=2)
    a = read(tmp_path / "a/summarization/train.jsonl")
    assert a == read(tmp_path / "b/summarization/train.jsonl")
    assert a != read(tmp_path / "c/summarization/train.jsonl")
    assert [r["category"] for r in a].count("xsum") == 5 and [r["category"] for r in a].count("cnn_dm") == 4
    check_rows(a, {"xsum", "cnn_dm"})
    assert a[0]["messages"][0]["content"].startswith(SUMMARY_PROMPT_START) and a[0]["messages"][0]["content"].endswith(
        "\nYour answer: "
    )
    heldout = read(tmp_path / "a/summarization/heldout.jsonl")
    assert len(heldout) == 3 and {r["category"] for r in heldout} == {"xsum", "cnn_dm"}


@pytest.mark.slow
def test_bad_row_stops_with_file_and_line(tmp_path):
    src = tmp_path / "src"
    write_json_lines(src / "xsum" / "train.json", [{"document": "d", "summary": "s"}, {"document": "d2"}])
    write_json_lines(src / "xsum" / "test.json", [{"document": "d", "summary": "s"}])
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "data/prepare.py"),
            "summarization",
            "--source",
            str(src),
            "--out",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert f"{src / 'xsum' / 'train.json'}:2: missing or empty `summary`" in result.stderr
    (src / "redbook").mkdir()
    (src / "redbook" / "train.json").write_text(
        '{"conversations": [{"from": "user", "value": "q"}, {"from": "assistant", "value": "a"}]}\n{"broken": \n'
    )
    (src / "redbook" / "test.json").write_text('{"user": "q2", "assistant": "a2"}\n')
    with pytest.raises(prepare.DataFileError, match=r"redbook/train.json:2: not valid JSON"):
        prepare.prepare("blog", str(src), tmp_path / "o")


# --- alignbench: the release file; training data supplied by the user -----------------------------------
def test_alignbench_categories_reference_and_user_training_file(tmp_path):
    release = tmp_path / "data_release.jsonl"
    write_json_lines(
        release,
        [
            {
                "question_id": 1,
                "category": "专业能力",
                "subcategory": "音乐",
                "question": "问题一",
                "reference": "参考一\n",
            },
            {"question_id": 2, "category": "角色扮演", "subcategory": "x", "question": "问题二", "reference": "参考二"},
        ],
    )
    mine = tmp_path / "mine.jsonl"
    write_json_lines(
        mine,
        [
            {
                "messages": [{"role": "user", "content": "训练问题"}, {"role": "assistant", "content": "回答"}],
                "category": "文本写作",
            },
            {"conversations": [{"from": "human", "value": "问题一"}, {"from": "gpt", "value": "与评测题重复"}]},
        ],
    )
    counts = prepare.prepare("alignbench", str(release), tmp_path / "out", train_file=str(mine))
    heldout = read(tmp_path / "out/alignbench/heldout.jsonl")
    assert [(r["id"], r["category"], r["reference"]) for r in heldout] == [
        ("alignbench-1", "Professional", "参考一"),
        ("alignbench-2", "Roleplay", "参考二"),
    ]
    assert heldout[0]["messages"][1]["content"] == heldout[0]["reference"]
    assert counts["train"] == 1 and counts["train_in_heldout"] == 1
    assert read(tmp_path / "out/alignbench/train.jsonl")[0]["category"] == "Writing"


def test_unknown_alignbench_category(tmp_path):
    release = tmp_path / "data_release.jsonl"
    write_json_lines(release, [{"question_id": 1, "category": "其他", "question": "q", "reference": "r"}])
    with pytest.raises(prepare.DataFileError, match=r"data_release.jsonl:1: unknown category '其他'"):
        prepare.prepare("alignbench", str(release), tmp_path / "out")


# --- the paper's own files, when this checkout sits beside them -------------------------------------------
@pytest.mark.skipif(not REFERENCE.is_dir(), reason="../shared/data/probdiff-reference is not present")
def test_reference_files(tmp_path):
    out = tmp_path / "out"
    counts = prepare.prepare("blog", str(REFERENCE), out)
    assert (counts["train"] + counts["train_in_heldout"] + counts["train_repeats"], counts["heldout"]) == (469, 100)
    mine = tmp_path / "mine.jsonl"
    write_json_lines(
        mine, [{"messages": [{"role": "user", "content": "问题"}, {"role": "assistant", "content": "回答"}]}]
    )
    counts = prepare.prepare("alignbench", str(REFERENCE), out, train_file=str(mine))
    assert counts["heldout"] == 683
    assert set(counts["heldout_by_category"]) == {
        "Professional",
        "Mathematics",
        "Fundamental",
        "Logical",
        "Writing",
        "Chinese",
        "Roleplay",
        "Open-ended",
    }
    counts = prepare.prepare("translation", str(REFERENCE), out)
    assert counts["heldout"] == 4000 and set(counts["heldout_by_category"].values()) == {500}
    assert counts["train"] + counts["train_in_heldout"] + counts["train_repeats"] == 20000
    # the paper's own split reuses held-out sentences in training, in the other direction
    assert counts["train_in_heldout"] > 100
    rows = summarization.summarization_rows(
        ((f"xsum:{line}", row) for line, row in read_rows(REFERENCE / "xsum" / "test.json")), "xsum"
    )
    assert len(rows) == 1000 and rows[0]["messages"][0]["content"].startswith(SUMMARY_PROMPT_START)


# --- the hub path (datasets' streaming loader replaced by a stand-in: no network here) --------------------
def test_hub_sources_ids_splits_and_fields(tmp_path, monkeypatch):
    calls = []

    def fake_hub_rows(hub_id, config, split, n, seed):
        calls.append((hub_id, config, split, n))
        if hub_id == "wmt/wmt19":
            other = config.split("-")[0]
            return [{"translation": {other: f"{other} {split} {i}", "en": f"en {split} {i}"}} for i in range(4)]
        if hub_id == "EdinburghNLP/xsum":
            return [{"document": f"bbc {split} {i}", "summary": f"one line {i}", "id": str(i)} for i in range(3)]
        return [{"article": f"cnn {split} {i}", "highlights": f"hl {i}", "id": str(i)} for i in range(3)]

    for module in (translation, summarization):
        monkeypatch.setattr(module, "hub_rows", fake_hub_rows)
    counts = prepare.prepare("translation", "hub", tmp_path)
    assert sorted(c for c in calls if c[0] == "wmt/wmt19") == sorted(
        [("wmt/wmt19", pair, "train", 5000) for pair in translation.WMT19_PAIRS]
        + [("wmt/wmt19", pair, "validation", 1000) for pair in translation.WMT19_PAIRS]
    )
    assert counts["train_by_category"]["de-en"] == 2 and counts["train_by_category"]["en-de"] == 2
    train = read(tmp_path / "translation" / "train.jsonl")
    assert (
        train[0]["messages"][0]["content"] == "Translate the sentence into English.\ncs train 0"
    )  # the reference training prompt
    assert train[2]["messages"][0]["content"] == "Translate the sentence into Czech.\nen train 2"
    calls.clear()
    counts = prepare.prepare("summarization", "hub", tmp_path)
    assert sorted(calls) == [
        ("EdinburghNLP/xsum", None, "test", 1000),
        ("EdinburghNLP/xsum", None, "train", 5000),
        ("abisee/cnn_dailymail", "3.0.0", "test", 1000),
        ("abisee/cnn_dailymail", "3.0.0", "train", 5000),
    ]
    assert counts["train_by_category"] == {"xsum": 3, "cnn_dm": 3}
    heldout = read(tmp_path / "summarization" / "heldout.jsonl")
    assert heldout[-1]["messages"][1]["content"] == "hl 2" and "cnn test 2" in heldout[-1]["messages"][0]["content"]


def test_hub_unreachable_says_how_to_work_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(
        SystemExit, match=r"could not load EdinburghNLP/xsum \[train\].*pass a local copy with --source"
    ):
        sources.hub_rows("EdinburghNLP/xsum", None, "train", 2, 0)


# --- the paper's repository as the default source (downloads served here: no network) ---------------------
PAPER = "https://raw.githubusercontent.com/xiatingyu/ProbDiff/HEAD"


def json_lines(rows: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def serve(monkeypatch, files: dict[str, str]) -> list[str]:
    """Answer prepare.py's downloads from `files` (URL -> text), 404 for any other URL; returns the URLs asked for."""
    import io
    import urllib.error

    asked = []

    def urlopen(url, timeout=None):
        asked.append(url)
        if url not in files:
            raise urllib.error.HTTPError(url, 404, "Not Found", {}, None)
        return io.BytesIO(files[url].encode("utf-8"))

    monkeypatch.setattr(sources.urllib.request, "urlopen", urlopen)
    return asked


def paper_translation_files() -> dict[str, str]:
    files = {}
    for pair, language in (("cs-en", "Czech"), ("de-en", "German"), ("ru-en", "Russian"), ("zh-en", "Chinese")):
        other = pair[:2]
        files[f"{PAPER}/generation_task/data/{pair}/train.json"] = json.dumps(
            [
                conversation(0, f"Translate the sentence into English.\n{other} sentence A", "English sentence A"),
                conversation(1, f"Translate the sentence into {language}.\nEnglish sentence B", f"{other} sentence B"),
                # held-out test row 0 in the other direction: the same pair of sentences
                conversation(2, f"Translate the sentence into {language}.\nen test 0", f"{other} test 0"),
                # held-out test row 3 in its own direction, with the training prompt's "." instead of ":"
                conversation(3, f"Translate the sentence into {language}.\nen test 3", f"{other} test 3"),
            ]
        )
        test_rows = [{other: f"{other} test {i}", "en": f"en test {i}"} for i in range(4)]
        files[f"{PAPER}/generation_task/data/{pair}/test.json"] = json_lines(test_rows)
    return files


def test_translation_comes_from_the_paper_and_leaks_are_caught_in_both_directions(tmp_path, monkeypatch, capsys):
    asked = serve(monkeypatch, paper_translation_files())
    assert prepare.main(["translation", "--out", str(tmp_path)]) == 0
    expected = [
        f"{PAPER}/generation_task/data/{pair}/{split}.json"
        for pair in translation.WMT19_PAIRS
        for split in ("train", "test")
    ]
    assert sorted(asked) == sorted(expected)
    train = read(tmp_path / "translation/train.jsonl")
    assert len(train) == 8 and not any("test" in r["messages"][0]["content"] for r in train)
    printed = capsys.readouterr().out
    assert f"source   cs-en/train.json: {PAPER}/generation_task/data/cs-en/train.json" in printed
    assert "removed: 8 train rows sharing a sentence with held-out (either side of a pair, either direction)" in printed


def test_summarization_comes_from_the_papers_cnn_and_xsum_folders(tmp_path, monkeypatch):
    prompt = summarization.SUMMARIZATION_PROMPT.format
    data = f"{PAPER}/generation_task/data"
    files = {
        f"{data}/xsum/train.json": json.dumps([conversation(i, prompt(content=f"doc {i}"), f"s{i}") for i in range(3)]),
        f"{data}/xsum/test.json": json_lines([{"document": "bbc test", "summary": "s", "id": "1"}]),
        f"{data}/cnn/train.json": json.dumps(
            [
                conversation(0, prompt(content="cnn doc"), "hl"),
                conversation(1, prompt(content=" cnn  test\n"), "the held-out article"),
            ]
        ),
        f"{data}/cnn/test.json": json_lines(
            [{"article": "cnn test", "highlights": "hl 1"}, {"article": "cnn 2", "highlights": "hl 2"}]
        ),
    }
    asked = serve(monkeypatch, files)
    counts = prepare.prepare("summarization", None, tmp_path)
    assert sorted(asked) == sorted(files)
    # all of the paper's training conversations (no subset), its test rows in file order; the training
    # conversation whose document is a held-out one (up to whitespace) is dropped and counted
    assert counts["train_by_category"] == {"xsum": 3, "cnn_dm": 1} and counts["train_in_heldout"] == 1
    heldout = read(tmp_path / "summarization/heldout.jsonl")
    assert [r["messages"][1]["content"] for r in heldout] == ["s", "hl 1", "hl 2"]
    assert heldout[1]["messages"][0]["content"] == prompt(content="cnn test")


def test_source_directory_in_the_papers_layout_finds_cnn(tmp_path, monkeypatch):
    """`--source DIR` reads DIR/cnn/ (the paper's folder name); what DIR lacks is downloaded from the paper."""
    src = tmp_path / "src"
    write_json_lines(src / "cnn" / "test.json", [{"article": "local article", "highlights": "local hl"}])
    write_json_list(src / "cnn" / "train.json", [conversation(0, "Summarize: a local article", "local summary")])
    files = {
        f"{PAPER}/generation_task/data/xsum/train.json": json.dumps([conversation(0, "Summarize: bbc", "s")]),
        f"{PAPER}/generation_task/data/xsum/test.json": json_lines([{"document": "bbc test", "summary": "s"}]),
    }
    asked = serve(monkeypatch, files)
    counts = prepare.prepare("summarization", str(src), tmp_path / "out")
    assert sorted(asked) == sorted(files), "cnn/ was found locally"
    assert (src / "cnn" / "test.json").as_posix() in dict(counts["sources"])["cnn/test.json"]
    assert counts["heldout_by_category"] == {"xsum": 1, "cnn_dm": 1}


def test_changed_upstream_format_stops_naming_the_url_and_what_was_expected(tmp_path, monkeypatch):
    files = {
        f"{PAPER}/generation_task/data/xsum/train.json": json.dumps([conversation(0, "Summarize: bbc", "s")]),
        f"{PAPER}/generation_task/data/xsum/test.json": json_lines([{"text": "a renamed field", "label": "s"}]),
    }
    serve(monkeypatch, files)
    with pytest.raises(prepare.DataFileError) as err:
        prepare.prepare("summarization", None, tmp_path)
    message = str(err.value)
    assert message.startswith(f"{PAPER}/generation_task/data/xsum/test.json:1: missing or empty `document`")
    assert "expected JSON lines {document, summary}" in message and "upstream file may have changed" in message
    with pytest.raises(SystemExit, match=r"could not download .*/generation_task/data/redbook/train.json .*--source"):
        prepare.prepare("blog", None, tmp_path)  # not served: 404


def test_alignbench_downloads_questions_and_training_set_so_the_recipe_runs(tmp_path, monkeypatch):
    from probdiff_callback.training.data import data_files
    from probdiff_callback.training.recipe import load_recipe

    files = {
        f"{PAPER}/alignbench/data/data_release.jsonl": json_lines(
            [
                {
                    "question_id": 1,
                    "category": "数学计算",
                    "subcategory": "初等数学",
                    "question": "1+1=?",
                    "reference": "2",
                },
                {
                    "question_id": 2,
                    "category": "文本写作",
                    "subcategory": "诗歌",
                    "question": "写一首诗",
                    "reference": "春眠不觉晓",
                },
            ]
        ),
        f"{PAPER}/alignbench/data/gpt_generate_train.json": json.dumps(
            [
                conversation(0, "2+2=?", "4"),
                conversation(1, "写一首诗", "与评测题重复"),
                conversation(2, "介绍长城", "长城是……"),
            ]
        ),
    }
    asked = serve(monkeypatch, files)
    counts = prepare.prepare("alignbench", None, tmp_path)
    assert sorted(asked) == sorted(files)
    assert counts["heldout_by_category"] == {"Mathematics": 1, "Writing": 1}
    assert counts["train"] == 2 and counts["train_in_heldout"] == 1 and counts["train_by_category"] == {"alignbench": 2}
    recipe = load_recipe(
        [
            "recipe=alignbench",
            f"train_file={tmp_path}/alignbench/train.jsonl",
            f"heldout_file={tmp_path}/alignbench/heldout.jsonl",
        ]
    )
    train, heldout, notices = data_files(recipe)
    assert (train, heldout, notices) == (tmp_path / "alignbench/train.jsonl", tmp_path / "alignbench/heldout.jsonl", [])


def test_leak_keys_ignore_the_prompt_ending_and_whitespace():
    held = chat_rows.row("zh-en", "Translate the sentence into English:\n你好 世界", "Hello world")
    same_direction = chat_rows.row("zh-en", "Translate the sentence into English.\n你好  世界", "Hi, world")
    other_direction = chat_rows.row("en-zh", "Translate the sentence into Chinese.\nHello world", "你好，世界")
    unrelated = chat_rows.row("zh-en", "Translate the sentence into English.\n再见", "Goodbye")
    keys = leaks.leak_keys("translation", held)
    assert leaks.leak_keys("translation", same_direction) & keys
    assert leaks.leak_keys("translation", other_direction) & keys
    assert not leaks.leak_keys("translation", unrelated) & keys
    document = summarization.SUMMARIZATION_PROMPT.format(content="A  document.\n")
    assert leaks.leak_keys("summarization", chat_rows.row("xsum", document, "s")) == {"A document."}
    assert leaks.leak_keys("blog", chat_rows.row("blog", " 写 文案 ", "x")) == {"写 文案"}


# --- the offline XSum study: test documents split into training and held-out, and a corrupted copy -----------------
def xsum_only_source(root: Path, n: int = 20) -> Path:
    write_json_lines(
        root / "xsum" / "test.json",
        [
            {"document": f"Document number {i} tells of event {i}.", "summary": f"Summary {i}.", "id": str(i)}
            for i in range(n)
        ],
    )
    return root


def document_of(row: dict) -> str:
    return summarization.summarized_document(row["messages"][0]["content"])


def test_split_test_holds_out_seeded_documents_and_trains_on_the_rest(tmp_path, capsys):
    source = xsum_only_source(tmp_path / "src")
    assert (
        prepare.main(["summarization", "--source", str(source), "--split-test", "5", "--out", str(tmp_path / "a")]) == 0
    )
    printed = capsys.readouterr().out
    assert "split    xsum: 20 test documents -> 15 train / 5 held out (seed 0)" in printed
    assert "skipped  cnn_dm: no cnn/test.json or cnn_dm/test.json under" in printed  # named, not silently missing
    train, heldout = (read(tmp_path / "a" / "summarization" / f"{s}.jsonl") for s in ("train", "heldout"))
    check_rows(train + heldout, {"xsum"})
    assert len(train) == 15 and len(heldout) == 5
    # disjoint by document, every document used once, in the reference prompt with the reference summary
    documents = [document_of(r) for r in train + heldout]
    assert sorted(documents) == sorted(f"Document number {i} tells of event {i}." for i in range(20))
    assert all(r["messages"][0]["content"].startswith(SUMMARY_PROMPT_START) for r in train)
    assert all(r["messages"][1]["content"] == f"Summary {document_of(r).split()[2]}." for r in train + heldout)
    # deterministic for a seed, another draw for another seed
    prepare.main(["summarization", "--source", str(source), "--split-test", "5", "--out", str(tmp_path / "b")])
    assert (tmp_path / "b" / "summarization" / "heldout.jsonl").read_text() == (
        tmp_path / "a" / "summarization" / "heldout.jsonl"
    ).read_text()
    prepare.main(
        ["summarization", "--source", str(source), "--split-test", "5", "--seed", "1", "--out", str(tmp_path / "c")]
    )
    assert {document_of(r) for r in read(tmp_path / "c" / "summarization" / "heldout.jsonl")} != {
        document_of(r) for r in heldout
    }


def test_split_test_refuses_what_it_cannot_do(tmp_path):
    source = xsum_only_source(tmp_path / "src", n=4)
    with pytest.raises(SystemExit, match="hold out 1 to 3"):
        prepare.prepare("summarization", str(source), tmp_path / "out", split_test=4)
    with pytest.raises(SystemExit, match="--split-test is for summarization"):
        prepare.prepare("blog", str(source), tmp_path / "out", split_test=2)


def test_shuffled_references_are_a_derangement_of_the_training_rows_only(tmp_path, capsys):
    source = xsum_only_source(tmp_path / "src")
    args = ["summarization", "--source", str(source), "--split-test", "5"]
    prepare.main(args + ["--out", str(tmp_path / "clean")])
    prepare.main(args + ["--shuffle-references", "--out", str(tmp_path / "broken")])
    assert "CORRUPTED on purpose: the references of all 15 training rows were shuffled" in capsys.readouterr().out
    clean, broken = (read(tmp_path / kind / "summarization" / "train.jsonl") for kind in ("clean", "broken"))
    assert [r["messages"][0] for r in broken] == [r["messages"][0] for r in clean]  # the same documents
    answers = [r["messages"][1]["content"] for r in broken]
    assert sorted(answers) == sorted(r["messages"][1]["content"] for r in clean)  # the same summaries, moved
    assert all(a != c["messages"][1]["content"] for a, c in zip(answers, clean))  # no row keeps its own
    by_id = {r["id"]: r["messages"][1]["content"] for r in clean}
    assert all(r["messages"][1]["content"] == by_id[r["reference_of"]] for r in broken)
    for split in ("heldout",):
        assert (tmp_path / "broken" / "summarization" / f"{split}.jsonl").read_text() == (
            tmp_path / "clean" / "summarization" / f"{split}.jsonl"
        ).read_text()
    prepare.main(args + ["--shuffle-references", "--out", str(tmp_path / "again")])
    assert read(tmp_path / "again" / "summarization" / "train.jsonl") == broken


@pytest.mark.skipif(not REFERENCE.is_dir(), reason="../shared/data/probdiff-reference is not present")
def test_the_offline_xsum_study_split(tmp_path):
    counts = prepare.prepare("summarization", str(REFERENCE), tmp_path, split_test=200)
    assert counts["train"] == 800 and counts["heldout"] == 200 and counts["train_in_heldout"] == 0
    assert counts["splits"] == ["xsum: 1,000 test documents -> 800 train / 200 held out (seed 0)"]
    train, heldout = (read(tmp_path / "summarization" / f"{s}.jsonl") for s in ("train", "heldout"))
    assert not {document_of(r) for r in train} & {document_of(r) for r in heldout}
