"""What ProbDiff asks the model: the Response Refinement Prompts of the reference code and the paper's appendix C,
and the chat-formatted token ids of queries and refinement requests, cut in the middle to fit."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from probdiff_callback.core.chat_format import query_messages, render
from probdiff_callback.core.queries import Query

REWRITER = (
    "I want you to act as a Response Rewriter.\n"
    "Your goal is to enhance the quality of the response given by an AI assistant to the #Given Prompt# through rewriting.\n"  # noqa: E501 (the reference text, verbatim)
    "But the rewritten response must be reasonable and must be understood by humans.\n"
    "Your rewriting cannot omit the non-text parts such as the emoji in #Given Prompt# and #Given Response#. \n"
    "If you think the response is already great enough, you can keep it unchanged.\n"
    "You should try your best not to change the length of the response.\n"
    "'#Given Response#', '#Rewritten Response#', 'given response' and 'rewritten response' are not allowed to appear in #Rewritten Response#.\n"  # noqa: E501 (the reference text, verbatim)
    "#Given Prompt#:\n{instruction}\n"
    "#Given Response#:\n{response}\n"
    "#Rewritten Response#:\n"
)

REWRITER_TRANSLATION = (
    "I want you to act as a Response Rewriter.\n"
    "Your goal is to enhance the quality of the response given by an AI assistant to the #Given Prompt# through rewriting.\n"  # noqa: E501 (the reference text, verbatim)
    "But the rewritten response must be reasonable and must be understood by humans.\n"
    "Your rewriting cannot omit the non-text parts such as the table and the code in #Given Prompt# and #Given Response#. \n"  # noqa: E501 (the reference text, verbatim)
    "Also, please do not omit the input in #Given Prompt#.\n"
    "You Should enhance the quality of the response using the following method:\n"
    "Please make the Response more relevant to #Given Prompt#.\n"
    "You should try your best not to make the #Rewritten Response# become verbose.\n"
    "'#Given Response#', '#Rewritten Response#', 'given response' and 'rewritten response' are not allowed to appear in #Rewritten Response#.\n"  # noqa: E501 (the reference text, verbatim)
    "#Given Prompt#:\n{instruction}\n"
    "#Given Response#:\n{response}\n"
    "#Rewritten Response#:\n"
)

SIMPLE = (
    "According to the given #INSTRUCTION#, please modify the given #RESPONSE# to make it better.\n"
    "#INSTRUCTION#: {instruction}\n"
    "#RESPONSE#: {response}\n"
    "#Your Response#:"
)

REFINEMENT_PROMPTS = {"rewriter": REWRITER, "rewriter-translation": REWRITER_TRANSLATION, "simple": SIMPLE}


PLACEHOLDER_PATTERN = re.compile(r"\{instruction\}|\{response\}")  # where a template takes the query and the answer


def refinement_template(name_or_template: str) -> str:
    return REFINEMENT_PROMPTS.get(name_or_template, name_or_template)


def refinement_request(template: str, instruction: str, response: str) -> str:
    # One pass, not str.format or chained replace: queries and answers contain braces
    # (code, JSON), and a query may itself contain the text "{response}".
    fill = {"{instruction}": instruction, "{response}": response}
    return PLACEHOLDER_PATTERN.sub(lambda m: fill[m.group(0)], template)


ELLIPSIS = "\n...\n"


@dataclass
class PreparedQuery:
    query: Query
    text: str  # possibly cut in the middle
    truncated: bool
    prompt_ids: list[int]  # chat-formatted original query, the conditioning for scoring


def chat_prompt_ids(tokenizer, system_prompt: str | None, user_text: str) -> list[int]:
    """The query in the model's chat format, ready for the answer; `system_prompt=None`: the template's own."""
    text = render(tokenizer, query_messages(tokenizer, system_prompt, user_text), add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def truncate_middle(tokenizer, text: str, max_tokens: int) -> tuple[str, bool]:
    """Cut `text` to at most `max_tokens` tokens by dropping its middle; keeps the head (where
    instructions usually are) and the tail."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) <= max_tokens:
        return text, False
    marker = len(tokenizer(ELLIPSIS, add_special_tokens=False)["input_ids"])
    keep = max(max_tokens - marker, 2)
    head = tokenizer.decode(ids[: keep - keep // 2]).rstrip("\ufffd")
    tail = tokenizer.decode(ids[len(ids) - keep // 2 :]).lstrip("\ufffd")
    return head + ELLIPSIS + tail, True


def _n_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def refinement_prompt_ids(
    tokenizer, system_prompt: str | None, template: str, instruction: str, response: str, max_tokens: int
) -> tuple[list[int], bool]:
    """Chat ids of the refinement request for (instruction, response), cut to `max_tokens`, and
    whether it was cut.

    The request holds the query and the answer, so it outgrows the context where the query alone
    did not (a CNN/DM article with its summary passes 2,048 tokens, where Qwen v1's conversion
    stops being exact). It is cut as queries are, in the middle: the instruction first (it is
    context; the response is what gets rewritten), keeping it at least a quarter of the room,
    then the response. At most `max_tokens` unless the template alone is longer.
    """
    ids = chat_prompt_ids(tokenizer, system_prompt, refinement_request(template, instruction, response))
    if len(ids) <= max_tokens:
        return ids, False
    frame = len(chat_prompt_ids(tokenizer, system_prompt, refinement_request(template, "", "")))
    room = max(max_tokens - frame, 4)
    response_budget = min(_n_tokens(tokenizer, response), room - min(_n_tokens(tokenizer, instruction), room // 4))
    instruction_budget = room - response_budget
    for _ in range(4):  # tokens can merge across the cut pieces' edges: shrink by the excess and retry
        cut_instruction, _ = truncate_middle(tokenizer, instruction, max(instruction_budget, 2))
        cut_response, _ = truncate_middle(tokenizer, response, max(response_budget, 2))
        ids = chat_prompt_ids(tokenizer, system_prompt, refinement_request(template, cut_instruction, cut_response))
        excess = len(ids) - max_tokens
        if excess <= 0:
            break
        shrink_instruction = min(excess, max(instruction_budget - 2, 0))
        instruction_budget -= shrink_instruction
        response_budget -= excess - shrink_instruction
    return ids, True


def prepare_queries(
    tokenizer, queries: Sequence[Query], *, system_prompt: str | None, max_prompt_tokens: int
) -> list[PreparedQuery]:
    """Each query in its chat prompt, the query cut in the middle where the prompt would pass `max_prompt_tokens`."""
    overhead = len(chat_prompt_ids(tokenizer, system_prompt, ""))
    budget = max(max_prompt_tokens - overhead, 16)
    prepared = []
    for query in queries:
        text, truncated = truncate_middle(tokenizer, query.text, budget)
        prepared.append(PreparedQuery(query, text, truncated, chat_prompt_ids(tokenizer, system_prompt, text)))
    return prepared
