"""Verdicts from outside judges (people, GPT-4, another model), set beside ProbDiff.

A verdict file is JSON lines, one verdict per query id, of one of two kinds (the first row decides;
every row must be of that kind):

- pairwise, as the paper's Figure 4: which of two models' answers to the query is better,
  `{"id": "...", "winner": "A" | "B" | "tie"}`. A and B are two evaluated steps of a run (the
  agreement command's `--step` and `--against`). ProbDiff's own call on a query is `metric.compare`'s
  rule: A wins where A is confident and B is not, B wins in the reverse case, else a tie. Reported:
  the agreement rate, the agreement on the queries both call decisive, and the confusion table.
- revision vs answer, as the paper's Table 6: whether a record's revision is better or worse than
  its answer, `{"id": "...", "revision": "better" | "worse" | "same"}` (or the paper's 1 / -1 / 0).
  The *conflict degree* is the share of queries whose judged direction contradicts the sign of d
  (revision judged better while d < 0, or worse while d > 0), over the matched queries with a valid d.

A row that is not JSON, lacks `id`, has an unknown value, repeats an id or is of the other kind
stops with its file and line. Ids on one side only (a verdict without a record, a record without a
verdict) are counted and reported, not errors.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from probdiff_callback.analysis.report import fmt, pct
from probdiff_callback.core.metric import compare, is_confident
from probdiff_callback.core.queries import DataFileError, read_rows
from probdiff_callback.core.records import Comparison, Record
from probdiff_callback.runs.run_files import HistoryRow, as_row

PAIRWISE = "pairwise"
REVISION = "revision"
KIND_KEYS = {PAIRWISE: "winner", REVISION: "revision"}
WINNERS = {"a": "A", "b": "B", "tie": "tie"}
REVISION_VALUES = {"better": 1, "worse": -1, "same": 0, 1: 1, -1: -1, 0: 0}
OUTCOMES = ("A", "tie", "B")
SHOWN_IDS = 5


@dataclass(frozen=True)
class VerdictFile:
    path: str
    kind: str  # pairwise | revision
    verdicts: dict[str, str | int]  # id -> "A" | "B" | "tie" (pairwise) or 1 | -1 | 0 (revision)


def _kind_of(row: dict, where: str) -> str:
    present = [kind for kind, key in KIND_KEYS.items() if key in row]
    if not present:
        raise DataFileError(
            f'{where}: neither "winner" (pairwise: A, B or tie) nor "revision" (better, worse or same) in this row'
        )
    if len(present) > 1:
        raise DataFileError(f'{where}: both "winner" and "revision"; a verdict file holds one kind of verdict')
    return present[0]


def _value(kind: str, raw: object, where: str) -> str | int:
    if kind == PAIRWISE:
        if isinstance(raw, str) and raw.strip().lower() in WINNERS:
            return WINNERS[raw.strip().lower()]
        raise DataFileError(f'{where}: "winner" must be "A", "B" or "tie" (got {raw!r})')
    key = raw.strip().lower() if isinstance(raw, str) else raw
    if isinstance(key, bool) or key not in REVISION_VALUES:
        raise DataFileError(f'{where}: "revision" must be "better", "worse" or "same" (or 1, -1, 0) (got {raw!r})')
    return REVISION_VALUES[key]  # type: ignore[index]


def read_verdicts(path: str | os.PathLike) -> VerdictFile:
    """The verdicts of a file, by query id; the first row's kind is the file's."""
    kind, first_line = None, 0
    verdicts: dict[str, str | int] = {}
    lines: dict[str, int] = {}
    for line, row in read_rows(path):
        where = f"{path}:{line}"
        if row.get("id") is None:
            raise DataFileError(f'{where}: no "id"; each verdict names the query it judges')
        row_kind = _kind_of(row, where)
        if kind is None:
            kind, first_line = row_kind, line
        elif row_kind != kind:
            raise DataFileError(
                f"{where}: a {row_kind} verdict, but line {first_line} made this a {kind} verdict file; "
                "one kind per file"
            )
        query_id = str(row["id"])
        if query_id in lines:
            raise DataFileError(f"{where}: id {query_id!r} repeats line {lines[query_id]}; one verdict per query")
        lines[query_id] = line
        verdicts[query_id] = _value(kind, row[KIND_KEYS[kind]], where)
    return VerdictFile(str(path), kind, verdicts)  # type: ignore[arg-type]


def _one_side(verdict_ids: Sequence[str], record_ids: Sequence[str]) -> dict:
    in_records = set(record_ids)
    judged = set(verdict_ids)
    only_verdicts = [i for i in verdict_ids if i not in in_records]
    only_records = [i for i in record_ids if i not in judged]
    return {
        "n_only_verdicts": len(only_verdicts),
        "only_verdicts": only_verdicts[:SHOWN_IDS],
        "n_only_records": len(only_records),
        "only_records": only_records[:SHOWN_IDS],
    }


def probdiff_winner(record_a: Record, record_b: Record, delta: float) -> str:
    """ProbDiff's call on one query, as `metric.compare` counts it: A, B or tie."""
    confident_a, confident_b = is_confident(record_a.d, delta), is_confident(record_b.d, delta)
    if confident_a and not confident_b:
        return "A"
    if confident_b and not confident_a:
        return "B"
    return "tie"


def pairwise_agreement(
    verdicts: VerdictFile, records_a: Sequence[Record], records_b: Sequence[Record], delta: float
) -> dict:
    """ProbDiff's win/tie/lose of A against B beside the judge's verdicts on the same queries."""
    if verdicts.kind != PAIRWISE:
        raise ValueError(f"{verdicts.path}: holds {verdicts.kind} verdicts, not pairwise ones")
    by_id_b = {str(r.id): r for r in records_b}
    both = [r for r in records_a if str(r.id) in by_id_b]
    matched = [r for r in both if str(r.id) in verdicts.verdicts]
    confusion = {ours: {theirs: 0 for theirs in OUTCOMES} for ours in OUTCOMES}
    for record in matched:
        ours = probdiff_winner(record, by_id_b[str(record.id)], delta)
        confusion[ours][verdicts.verdicts[str(record.id)]] += 1  # type: ignore[index]
    n = len(matched)
    agreed = sum(confusion[o][o] for o in OUTCOMES)
    decisive = sum(confusion[a][b] for a in ("A", "B") for b in ("A", "B"))
    decisive_agreed = confusion["A"]["A"] + confusion["B"]["B"]
    result = {
        "kind": PAIRWISE,
        "n": n,
        "agreement": agreed / n if n else math.nan,
        "n_agreed": agreed,
        "n_decisive": decisive,
        "decisive_agreement": decisive_agreed / decisive if decisive else math.nan,
        "confusion": confusion,  # ProbDiff's call -> the judge's call -> count
        "judge": {o: sum(confusion[ours][o] for ours in OUTCOMES) for o in OUTCOMES},
        "compare": compare(matched, [by_id_b[str(r.id)] for r in matched], delta) if matched else None,
        **_one_side(list(verdicts.verdicts), [str(r.id) for r in both]),
    }
    return result


def conflict_degree(verdicts: VerdictFile, records: Sequence[Record]) -> dict:
    """The paper's conflict degree of d against revision-vs-answer verdicts on the same records."""
    if verdicts.kind != REVISION:
        raise ValueError(f"{verdicts.path}: holds {verdicts.kind} verdicts, not revision-vs-answer ones")
    matched = [r for r in records if str(r.id) in verdicts.verdicts]
    table = {sign: {judged: 0 for judged in ("better", "same", "worse")} for sign in ("d > 0", "d = 0", "d < 0")}
    invalid = 0
    for record in matched:
        d = record.d
        if not math.isfinite(d):
            invalid += 1
            continue
        sign = "d > 0" if d > 0 else ("d < 0" if d < 0 else "d = 0")
        judged = {1: "better", 0: "same", -1: "worse"}[verdicts.verdicts[str(record.id)]]  # type: ignore[index]
        table[sign][judged] += 1
    valid = len(matched) - invalid
    conflicts = table["d > 0"]["worse"] + table["d < 0"]["better"]
    return {
        "kind": REVISION,
        "n": valid,
        "n_invalid_d": invalid,
        "n_conflicts": conflicts,
        "conflict_degree": conflicts / valid if valid else math.nan,
        "table": table,  # sign of d -> the judge's verdict on the revision -> count
        **_one_side(list(verdicts.verdicts), [str(r.id) for r in records]),
    }


def _one_side_line(result: Mapping) -> str | None:
    parts = []
    if result["n_only_verdicts"]:
        parts.append(
            f"{result['n_only_verdicts']} verdict ids have no record (e.g. {', '.join(result['only_verdicts'])})"
        )
    if result["n_only_records"]:
        parts.append(f"{result['n_only_records']} records have no verdict (e.g. {', '.join(result['only_records'])})")
    return "not matched: " + "; ".join(parts) if parts else None


def format_pairwise(result: Mapping, label_a: str, label_b: str) -> str:
    lines = [f"Pairwise verdicts: A = {label_a}, B = {label_b}, {result['n']} matched queries"]
    compared: Comparison | None = result["compare"]
    if compared is not None:
        lines.append(
            f"  ProbDiff (compare): A wins {compared.win}, ties {compared.tie}, loses {compared.lose}"
            f"  (Wilcoxon p {fmt(compared.wilcoxon_p, '.3g')})"
        )
    judge = result["judge"]
    lines.append(f"  judge:              A better {judge['A']}, tie {judge['tie']}, B better {judge['B']}")
    lines.append(
        f"  agreement {pct(result['agreement'])} ({result['n_agreed']} of {result['n']}); "
        f"on queries both call decisive {pct(result['decisive_agreement'])} ({result['n_decisive']} queries)"
    )
    corner = "ProbDiff \\ judge"
    lines.append(f"  {corner:<18}" + "".join(f"{o:>6}" for o in OUTCOMES))
    for ours in OUTCOMES:
        lines.append(f"  {ours:<18}" + "".join(f"{result['confusion'][ours][theirs]:>6}" for theirs in OUTCOMES))
    extra = _one_side_line(result)
    if extra:
        lines.append("  " + extra)
    return "\n".join(lines)


def format_conflict(result: Mapping, label: str) -> str:
    lines = [
        f"Revision-vs-answer verdicts at {label}: conflict degree {pct(result['conflict_degree'])} "
        f"({result['n_conflicts']} of {result['n']} queries: judged better while d < 0, or worse while d > 0)"
    ]
    lines.append(f"  {'':<8}" + "".join(f"{j:>8}" for j in ("better", "same", "worse")))
    for sign, row in result["table"].items():
        lines.append(f"  {sign:<8}" + "".join(f"{row[j]:>8}" for j in ("better", "same", "worse")))
    if result["n_invalid_d"]:
        lines.append(f"  left out: {result['n_invalid_d']} queries with an invalid (NaN) d")
    extra = _one_side_line(result)
    if extra:
        lines.append("  " + extra)
    return "\n".join(lines)


def check_verdicts(
    path: str | os.PathLike,
    rows: Sequence[HistoryRow | Mapping],
    records_by_step: Mapping[int, Sequence[Record]],
    step: int | None = None,
    against: int | None = None,
) -> tuple[dict, str]:
    """(result, text) of a verdict file against the run's records: pairwise verdicts compare `step` (A, by
    default the last evaluated step) with `against` (B, by default the baseline); revision-vs-answer
    verdicts judge the records of `step`."""
    verdicts = read_verdicts(path)
    evaluated = sorted(records_by_step)
    if not evaluated:
        raise FileNotFoundError("no step records to set the verdicts beside")
    chosen = evaluated[-1] if step is None else step
    if chosen not in records_by_step:
        raise ValueError(
            f"--step {chosen}: no records of that step; evaluated steps with records: {', '.join(map(str, evaluated))}"
        )
    rows = [as_row(r) for r in rows]
    delta = next(r.summary.delta for r in rows if r.global_step == chosen and r.summary is not None)
    if verdicts.kind != PAIRWISE:
        result = conflict_degree(verdicts, records_by_step[chosen])
        return {"file": str(path), "step": chosen, **result}, format_conflict(result, f"step {chosen}")
    baseline = next((r.global_step for r in rows if r.kind == "baseline"), None)
    other = baseline if against is None else against
    if other is None:
        raise ValueError("pairwise verdicts need two steps: this run has no baseline row, so give --against STEP")
    if other not in records_by_step:
        steps = ", ".join(map(str, evaluated))
        raise ValueError(f"--against {other}: no records of that step; evaluated steps with records: {steps}")
    result = pairwise_agreement(verdicts, records_by_step[chosen], records_by_step[other], delta)
    label_b = f"step {other}" + (" (base model)" if other == baseline else "")
    return {"file": str(path), "step": chosen, "against": other, **result}, format_pairwise(
        result, f"step {chosen}", label_b
    )
