"""The Response Refinement Prompts of the reference code and the paper's appendix C."""

from __future__ import annotations

import re

REWRITER = (
    "I want you to act as a Response Rewriter.\n"
    "Your goal is to enhance the quality of the response given by an AI assistant to the #Given Prompt# through rewriting.\n"
    "But the rewritten response must be reasonable and must be understood by humans.\n"
    "Your rewriting cannot omit the non-text parts such as the emoji in #Given Prompt# and #Given Response#. \n"
    "If you think the response is already great enough, you can keep it unchanged.\n"
    "You should try your best not to change the length of the response.\n"
    "'#Given Response#', '#Rewritten Response#', 'given response' and 'rewritten response' are not allowed to appear in #Rewritten Response#.\n"
    "#Given Prompt#:\n{instruction}\n"
    "#Given Response#:\n{response}\n"
    "#Rewritten Response#:\n"
)

REWRITER_TRANSLATION = (
    "I want you to act as a Response Rewriter.\n"
    "Your goal is to enhance the quality of the response given by an AI assistant to the #Given Prompt# through rewriting.\n"
    "But the rewritten response must be reasonable and must be understood by humans.\n"
    "Your rewriting cannot omit the non-text parts such as the table and the code in #Given Prompt# and #Given Response#. \n"
    "Also, please do not omit the input in #Given Prompt#.\n"
    "You Should enhance the quality of the response using the following method:\n"
    "Please make the Response more relevant to #Given Prompt#.\n"
    "You should try your best not to make the #Rewritten Response# become verbose.\n"
    "'#Given Response#', '#Rewritten Response#', 'given response' and 'rewritten response' are not allowed to appear in #Rewritten Response#.\n"
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


def refinement_template(name_or_template: str) -> str:
    return REFINEMENT_PROMPTS.get(name_or_template, name_or_template)


def refinement_request(template: str, instruction: str, response: str) -> str:
    # One pass, not str.format or chained replace: queries and answers contain braces
    # (code, JSON), and a query may itself contain the text "{response}".
    fill = {"{instruction}": instruction, "{response}": response}
    return re.sub(r"\{instruction\}|\{response\}", lambda m: fill[m.group(0)], template)
