"""Where a preparer's input files come from: the paper's repository (github.com/xiatingyu/ProbDiff) by default, a
local copy or a URL prefix in its layout (`--source`), or the Hugging Face hub (`--source hub`). `Fetcher` finds and
downloads the files of one run and remembers where each came from, so that the report names every source used and an
error in a downloaded file names its URL; `hub_rows` streams a seeded sample of a hub dataset. Kept apart from the
tasks because all four read their files through it, and apart from the rows because it knows nothing of their
contents.
"""

from __future__ import annotations

import contextlib
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from probdiff_callback.core.queries import DataFileError

PROBDIFF_RAW = "https://raw.githubusercontent.com/xiatingyu/ProbDiff/HEAD"
PAPER_DATA = f"{PROBDIFF_RAW}/generation_task/data"  # + <pair>/, xsum/, cnn/, redbook/
PAPER_ALIGNBENCH = f"{PROBDIFF_RAW}/alignbench/data"  # + data_release.jsonl, gpt_generate_train.json
HUB = "hub"  # --source hub: translation and summarization from the Hugging Face hub

HUB_STREAM_BUFFER = 10_000


def is_url(source: str) -> bool:
    return source.startswith(("http://", "https://"))


class Fetcher:
    """Finds and downloads the input files of one run, and remembers where each came from: the
    report names every source used, and an error in a downloaded file names its URL.
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
