"""The blog task: the paper's Xiaohongshu posts, `redbook/train.json` (469 `conversations`) for training and
`redbook/test.json` (100 rows `{user, assistant}`) held out, taken as they are. The smallest preparer: the posts have
no hub source, so it only reads the two files through the `Fetcher` (`--source` or the paper's repository).
"""

from __future__ import annotations

from .chat_rows import CONVERSATIONS, conversation_rows
from .sources import Fetcher

BLOG_SIZES = (469, 100)


def prepare_blog(source: str | None, seed: int, fetcher: Fetcher) -> tuple[list[dict], list[dict]]:
    splits = []
    for name, expected in (("train", CONVERSATIONS), ("test", "JSON lines {user, assistant}")):
        path = fetcher.paper_file(source, f"redbook/{name}.json")
        with fetcher.expecting(path, expected):
            splits.append([{"category": "blog", "messages": messages} for _, messages, _ in conversation_rows(path)])
    return splits[0], splits[1]
