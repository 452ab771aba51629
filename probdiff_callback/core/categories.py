"""Category names: AlignBench's eight categories under one canonical label, whatever name a file uses."""

from __future__ import annotations

from collections.abc import Iterable

# AlignBench's `data_release.jsonl` names its categories in Chinese (文本写作, ...), the paper's tables in English
# (abbreviated "Writ." or in full, "Writing Ability"), and our prepared files and recipes by a short English label
# (Writing). All of them mean the same category, so every place that keys by category (per-category temperatures,
# per-category metrics, W&B keys) maps a name to the short English label first. English is the canonical form
# because metric keys must stay ASCII-safe for W&B and TensorBoard and the paper reports in English. Matching is
# exact (case included): MT-Bench's lowercase `writing` and `roleplay` are other benchmarks' categories.
# canonical label: (name in data_release.jsonl, the paper's abbreviation, the paper's full label),
# in the order of data_release.jsonl
ALIGNBENCH: dict[str, tuple[str, str, str]] = {
    "Professional": ("专业能力", "Pro.", "Professional Knowledge"),
    "Mathematics": ("数学计算", "Math.", "Mathematics"),
    "Fundamental": ("基本任务", "Fund.", "Fundamental Language Ability"),
    "Logical": ("逻辑推理", "Logic.", "Logical Reasoning"),
    "Writing": ("文本写作", "Writ.", "Writing Ability"),
    "Chinese": ("中文理解", "Chi.", "Advanced Chinese Understanding"),
    "Roleplay": ("角色扮演", "Role.", "Task-oriented Role Play"),
    "Open-ended": ("综合问答", "Open.", "Open-ended Questions"),
}

ALIASES: dict[str, str] = {alias: canonical for canonical, names in ALIGNBENCH.items() for alias in (canonical, *names)}


def canonical_category(name: str | None) -> str | None:
    """The canonical label of an AlignBench category under any of its names; other names unchanged."""
    if name is None:
        return None
    return ALIASES.get(name, name)


def is_alignbench(name: str | None) -> bool:
    return name in ALIASES


def describe(categories: Iterable[str]) -> str:
    """`Writing (文本写作)`-style list of canonical names, with the Chinese name where there is one."""
    return ", ".join(f"{c} ({ALIGNBENCH[c][0]})" if c in ALIGNBENCH else c for c in categories)


def unmatched_keys(keys: Iterable[str], categories: Iterable[str | None]) -> list[str]:
    """The keys (of a per-category setting) that name neither one of `categories` nor an AlignBench
    category, under any of their names."""
    known = {canonical_category(c) for c in categories if c is not None} | set(ALIGNBENCH)
    return [key for key in keys if canonical_category(key) not in known]
