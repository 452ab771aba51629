"""The training data of a recipe: which files (prepared, given, or the offline samples), their conversations, and
the conversations that truncation leaves without an assistant token."""

from __future__ import annotations

from pathlib import Path

from probdiff_callback.core.queries import DataFileError, Query, chat_messages, fixed_subset, load_queries, read_rows
from probdiff_callback.training import PROJECT_ROOT, say
from probdiff_callback.training.recipe import Recipe, RecipeError, default_data_file

PROCESSED_DIR = PROJECT_ROOT / "data" / "processed"
SAMPLES_DIR = PROJECT_ROOT / "data" / "samples"


def resolve_path(path: str) -> Path:
    """A relative path is taken from the working directory, else from the project root."""
    candidate = Path(path)
    if candidate.is_absolute() or candidate.exists():
        return candidate
    return PROJECT_ROOT / candidate if (PROJECT_ROOT / candidate).exists() else candidate


def data_files(recipe: Recipe) -> tuple[Path, Path, list[str]]:
    """(train file, held-out file, notices): the recipe's prepared files, or the samples when those are missing and
    `samples_fallback` allows it; a file the user named (train_file=, heldout_file=) must exist."""
    notices = []
    chosen = []
    for split, configured in (("train", recipe.train_file), ("heldout", recipe.heldout_file)):
        own_data = default_data_file(recipe.task, split)
        path = resolve_path(configured or own_data)
        if not path.is_file():
            if configured not in (None, own_data):
                raise RecipeError(missing_named_file(f"{split}_file", configured, path, own_data))
            sample = SAMPLES_DIR / recipe.task / f"{split}.jsonl"
            if recipe.samples_fallback and sample.is_file():
                notices.append(
                    f"{split} data: {path} not found; using the offline samples {sample} instead "
                    f"(prepare the real data with: python data/prepare.py {recipe.task})"
                )
                path = sample
            elif recipe.task == "alignbench" and split == "train":
                raise RecipeError(
                    f"AlignBench training data not found at {path}: run `python data/prepare.py alignbench`, which "
                    "downloads the paper's GPT-4-generated training set (alignbench/data/gpt_generate_train.json in "
                    "its repository) to data/processed/alignbench/train.jsonl; `--train FILE` takes your own "
                    "conversations instead; or set train_file=PATH. With model=tiny the recipe trains on "
                    f"{SAMPLES_DIR / 'alignbench' / 'train.jsonl'}."
                )
            else:
                raise RecipeError(
                    f"{split} data not found at {path}: run `python data/prepare.py {recipe.task}` "
                    f"or set {split}_file=PATH"
                )
        chosen.append(path)
    return chosen[0], chosen[1], notices


def missing_named_file(key: str, configured: str, path: Path, own_data: str) -> str:
    """The message for a data file the user named that is not there (never replaced by the samples: a typo would
    otherwise train on the wrong data without a word)."""
    where = "" if Path(configured).is_absolute() else f" (looked in {Path.cwd()} and {PROJECT_ROOT})"
    what = "is a directory, not a file" if path.is_dir() else f"no such file{where}"
    return (
        f"{key}={configured}: {what}. Give an existing JSON-lines file of conversations (docs/configuration.md, "
        f'"Your own files"), or leave {key} out to use the recipe\'s data ({own_data})'
    )


def read_conversations(path: Path) -> list[dict]:
    """Rows `{"id", "messages"}` of a prepared file; a row that is not a chat ending with the assistant
    stops with its file and line."""
    rows = []
    for index, (line, row) in enumerate(read_rows(path)):
        if "messages" not in row:
            raise DataFileError(
                f"{path}:{line}: expected `messages`: a list of {{role, content}} (roles system/user/assistant) "
                "ending with an assistant turn (see data/prepare.py)"
            )
        rows.append({"id": str(row.get("id", index)), "messages": chat_messages(row["messages"], f"{path}:{line}")})
    return rows


def load_data(recipe: Recipe) -> tuple[list[dict], list[dict], list[Query]]:
    """(training conversations, eval-loss conversations, ProbDiff queries): the prepared files, or the
    samples with a notice; a missing file or a bad row raises with its message."""
    train_file, heldout_file, notices = data_files(recipe)
    for notice in notices:
        say(notice)
    train_rows = read_conversations(train_file)
    eval_rows = fixed_subset(read_conversations(heldout_file), recipe.max_eval_samples, recipe.setting("seed"))
    queries = load_queries(heldout_file)
    n_probdiff = min(len(queries), recipe.probdiff.n_queries or len(queries))
    say(
        f"data: {len(train_rows)} training conversations ({train_file}), {len(eval_rows)} for the eval loss and "
        f"{n_probdiff} of {len(queries)} held-out queries for ProbDiff ({heldout_file})"
    )
    return train_rows, eval_rows, queries


def assistant_mask(tokenizer, messages: list[dict]) -> list[int]:
    """1 on the assistant tokens of a rendered conversation: by the template's {% generation %} markers where it
    has them, else by locating the assistant turns (chat_format.mask_assistant_turns)."""
    from trl.chat_template_utils import has_generation_markers

    from probdiff_callback.core.chat_format import fold_system_turns, mask_assistant_turns

    messages = fold_system_turns(tokenizer, messages)
    if has_generation_markers(tokenizer.chat_template or ""):
        encoded = tokenizer.apply_chat_template(
            messages, return_dict=True, return_assistant_tokens_mask=True, tokenize=True
        )
        return list(encoded["assistant_masks"])
    return mask_assistant_turns(tokenizer, messages).assistant_masks


def count_without_assistant_tokens(tokenizer, rows: list[dict], max_length: int) -> list[str]:
    """Ids of the rows that keep no assistant token after truncation to `max_length` (trl keeps the start
    and then drops such rows silently, so they are counted here before training)."""
    return [row["id"] for row in rows if 1 not in assistant_mask(tokenizer, row["messages"])[:max_length]]


def loss_datasets(tokenizer, train_rows: list[dict], eval_rows: list[dict], assistant_only: bool):
    """(train, eval) datasets for SFTTrainer and how the loss finds the assistant turns.

    trl's assistant-only loss needs {% generation %} markers in the template, and adds them itself to the templates
    it knows ("markers", "trl-patch": conversations go to trl as they are). For any other template ("spans") the
    conversations are tokenized here with a mask of their assistant turns, which trl turns into the labels; trl's
    own `assistant_only_loss` must then be off (it refuses tokenized rows), while the loss stays on assistant turns.
    """
    from datasets import Dataset

    from probdiff_callback.core.chat_format import fold_system_turns, loss_masking, mask_assistant_turns

    masking = loss_masking(tokenizer) if assistant_only else "off"

    def rows_for(rows: list[dict]) -> list[dict]:
        if masking != "spans":
            return [{"messages": fold_system_turns(tokenizer, r["messages"])} for r in rows]
        masked = [mask_assistant_turns(tokenizer, fold_system_turns(tokenizer, r["messages"])) for r in rows]
        return [{"input_ids": m.input_ids, "assistant_masks": m.assistant_masks} for m in masked]

    return Dataset.from_list(rows_for(train_rows)), Dataset.from_list(rows_for(eval_rows)), masking


LOSS_MASKING_NOTES = {
    "markers": "loss on assistant turns only (the chat template's {% generation %} markers, trl)",
    "trl-patch": "loss on assistant turns only (trl's marked version of this chat template)",
    "spans": "loss on assistant turns only (the chat template has no {% generation %} markers and trl does not know "
    "it: its assistant turns are located by rendering, end-of-turn token included)",
    "off": "loss on whole conversations (assistant_only_loss=false)",
}


def report_truncation(tokenizer, train_rows: list[dict], eval_rows: list[dict], max_length: int | None) -> None:
    """Conversations whose assistant turns lie wholly past max_length train nothing: trl drops them
    silently, so count and name them here."""
    if max_length is None:
        return  # no truncation
    for name, rows in (("training", train_rows), ("eval-loss", eval_rows)):
        lost = count_without_assistant_tokens(tokenizer, rows, max_length)
        if lost:
            shown = ", ".join(lost[:10]) + (" ..." if len(lost) > 10 else "")
            say(
                f"warning: {len(lost)} of {len(rows)} {name} conversations keep no assistant token after truncation "
                f"to max_length={max_length} and are left out by the trainer: {shown}"
            )
        else:
            say(f"{name} conversations: all {len(rows)} keep assistant tokens within max_length={max_length}")
