"""probdiff_callback/core/queries.py: queries and pairs from files, rows, chats; bad rows named by file and line."""

import json
from pathlib import Path

import pytest

from probdiff_callback.core.queries import DataFileError, load_pairs, load_queries

REFERENCE = Path(__file__).resolve().parents[2] / "shared" / "data" / "probdiff-reference"


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_jsonl_and_json_list_detected_by_content(tmp_path):
    rows = [{"instruction": "a"}, {"question": "b", "question_id": 7, "category": "math"}]
    lines = write(tmp_path, "q.json", "\n".join(json.dumps(r) for r in rows) + "\n")
    listed = write(tmp_path, "q.jsonl", json.dumps(rows, indent=2))
    for path in (lines, listed):
        queries = load_queries(path)
        assert [(q.id, q.text, q.category) for q in queries] == [("0", "a", None), ("7", "b", "math")]


def test_a_line_holding_unicode_line_separators_is_one_row(tmp_path):
    """JSON strings may hold U+2028, U+2029 and U+0085 unescaped (Xiaohongshu posts do; json.dumps with
    ensure_ascii=False writes them so): each JSON Lines row ends at a newline only."""
    texts = ["第一段\u2028第二段", "a\u2029b\x85c"]
    path = write(tmp_path, "q.jsonl", "".join(json.dumps({"instruction": t}, ensure_ascii=False) + "\n" for t in texts))
    assert [q.text for q in load_queries(path)] == texts


def test_query_fields_and_turns(tmp_path):
    rows = [
        {"id": "x", "query": "from query"},
        {"user": "from user", "assistant": "ignored"},
        {"conversations": [{"from": "user", "value": "from conversations"}, {"from": "assistant", "value": "no"}]},
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "from messages"}]},
        {"turns": ["first turn", "second turn"], "question_id": 81},
    ]
    path = write(tmp_path, "q.jsonl", "\n".join(json.dumps(r) for r in rows))
    assert [q.text for q in load_queries(path)] == [
        "from query",
        "from user",
        "from conversations",
        "from messages",
        "first turn",
    ]
    assert load_queries(path)[4].id == "81"


def test_bad_row_names_file_and_line(tmp_path):
    path = write(tmp_path, "bad.jsonl", '{"query": "ok"}\n\n{"answer": "no query here"}\n')
    with pytest.raises(DataFileError, match=r"bad\.jsonl:3: no query found.*keys here: answer"):
        load_queries(path)
    path = write(tmp_path, "broken.jsonl", '{"query": "ok"}\n{"query": "unterminated\n')
    with pytest.raises(DataFileError, match=r"broken\.jsonl:2: not valid JSON"):
        load_queries(path)
    path = write(tmp_path, "list.json", '[\n  {"query": "ok"},\n  {"query": ""}\n]')
    with pytest.raises(DataFileError, match=r"list\.json:3: no query found"):
        load_queries(path)
    path = write(tmp_path, "dup.jsonl", '{"id": 1, "query": "a"}\n{"id": 1, "query": "b"}\n')
    with pytest.raises(DataFileError, match=r"dup\.jsonl:2: id '1' repeats line 1"):
        load_queries(path)
    path = write(tmp_path, "scalar.jsonl", '{"query": "a"}\n"just a string"\n')
    with pytest.raises(DataFileError, match=r"scalar\.jsonl:2: expected a JSON object"):
        load_queries(path)
    with pytest.raises(DataFileError, match="holds no rows"):
        load_queries(write(tmp_path, "empty.jsonl", "\n"))


def test_pairs_need_all_three_texts(tmp_path):
    path = write(
        tmp_path,
        "p.jsonl",
        json.dumps({"id": "a", "query": "q", "response": "r", "revised": "v"})
        + "\n"
        + json.dumps({"id": "b", "query": "q", "response": "r"})
        + "\n",
    )
    with pytest.raises(DataFileError, match=r"p\.jsonl:2: missing or non-string revised"):
        load_pairs(path)


@pytest.mark.skipif(not REFERENCE.is_dir(), reason="the paper's data is only on development machines (../shared)")
@pytest.mark.parametrize(
    "relative, count, first_category",
    # AlignBench's Chinese category names load under their canonical English label (see `canonical_category`)
    [
        ("redbook/test.json", 100, None),
        ("alignbench/data_release.jsonl", 683, "Professional"),
        ("mtbench/question.jsonl", 80, "writing"),
        ("alpaca_eval/test.json", 805, None),
        ("redbook/train.json", 469, None),
    ],
)
def test_paper_files_load_as_they_are(relative, count, first_category):
    queries = load_queries(REFERENCE / relative)
    assert len(queries) == count
    assert queries[0].category == first_category
    assert all(q.text.strip() for q in queries)
