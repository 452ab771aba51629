"""A chat model's own format, read off its chat template: the conversation a query becomes (the template's own
default system prompt, or a given one where the template takes a system role), the token that ends a turn, and the
assistant turns of a rendered conversation (for a loss on those turns only, whatever the template).

Every answer comes from rendering the template on probe conversations, so it holds for ChatML, Llama 3, Gemma,
Mistral and templates we have never seen, without a table of model families.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# Probe texts: plain ASCII that no template rewrites and no query contains.
_PROBE_SYSTEM = "PROBDIFF-PROBE-SYSTEM-3b9e"
_PROBE_USER = "PROBDIFF-PROBE-USER-3b9e"
_PROBE_ANSWER = "PROBDIFF-PROBE-ANSWER-3b9e"
_PROBE_NEXT = "PROBDIFF-PROBE-NEXT-3b9e"


class ChatTemplateError(ValueError):
    """A chat template that cannot do what is asked of it; the message says what and how to go on."""


def render(tokenizer, messages: Sequence[dict], *, add_generation_prompt: bool) -> str:
    if tokenizer.chat_template is None:
        raise ChatTemplateError(
            f"the tokenizer of {tokenizer.name_or_path!r} has no chat template; ProbDiff needs the model's chat format"
        )
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt)


_probes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _probed(tokenizer, probe: Callable[[Any], Any]) -> Any:
    """`probe(tokenizer)`, once per tokenizer and chat template (a template can be swapped after loading)."""
    template = tokenizer.chat_template
    key = (probe.__name__, template if isinstance(template, str) else repr(template))
    cache = _probes.setdefault(tokenizer, {})
    if key not in cache:
        cache[key] = probe(tokenizer)
    return cache[key]


def _accepts_system_role(tokenizer) -> bool:
    probe = [{"role": "system", "content": _PROBE_SYSTEM}, {"role": "user", "content": _PROBE_USER}]
    try:
        return _PROBE_SYSTEM in render(tokenizer, probe, add_generation_prompt=True)
    except ChatTemplateError:
        raise
    except Exception:  # templates refuse with raise_exception(...), a jinja2 TemplateError
        return False


def accepts_system_role(tokenizer) -> bool:
    """Whether the template renders a system message (Gemma's refuses one; a template that drops it silently does
    not take it either)."""
    return _probed(tokenizer, _accepts_system_role)


def query_messages(tokenizer, system_prompt: str | None, user_text: str) -> list[dict]:
    """The conversation a query becomes: the user turn alone, so the template adds its own default system prompt
    (Qwen's "You are a helpful assistant.", SmolLM's own, none for Llama 3); with `system_prompt`, that as the system
    turn, or, where the template refuses a system role, at the head of the user turn, as such templates do
    themselves."""
    if system_prompt is None:
        return [{"role": "user", "content": user_text}]
    if accepts_system_role(tokenizer):
        return [{"role": "system", "content": system_prompt}, {"role": "user", "content": user_text}]
    return [{"role": "user", "content": f"{system_prompt}\n\n{user_text}"}]


def fold_system_turns(tokenizer, messages: Sequence[dict]) -> list[dict]:
    """A training conversation the template can render: a leading system turn moves to the head of the first user
    turn when the template refuses a system role; otherwise the conversation as it is."""
    messages = list(messages)
    if not messages or messages[0]["role"] != "system" or accepts_system_role(tokenizer):
        return messages
    system, rest = messages[0]["content"], messages[1:]
    if rest and rest[0]["role"] == "user":
        return [{**rest[0], "content": f"{system}\n\n{rest[0]['content']}"}, *rest[1:]]
    return [{"role": "user", "content": system}, *rest]


def _end_of_turn(tokenizer) -> tuple[str, int] | None:
    # An assistant turn followed by a user turn: some templates leave the last assistant turn open.
    probe = [
        {"role": "user", "content": _PROBE_USER},
        {"role": "assistant", "content": _PROBE_ANSWER},
        {"role": "user", "content": _PROBE_NEXT},
    ]
    text = render(tokenizer, probe, add_generation_prompt=False)
    after = text[text.index(_PROBE_ANSWER) + len(_PROBE_ANSWER) : text.index(_PROBE_NEXT)]
    encoded = tokenizer(after, add_special_tokens=False, return_offsets_mapping=True)
    if not encoded["input_ids"]:
        return None
    token_id = encoded["input_ids"][0]
    added = tokenizer.added_tokens_decoder.get(token_id)
    if added is None or not added.special:  # a newline or a word: the template marks no end of turn by a token
        return None
    start, end = encoded["offset_mapping"][0]
    return after[start:end], token_id


def end_of_turn(tokenizer) -> tuple[str, int] | None:
    """(text, id) of the special token the template writes right after an assistant turn (`<|im_end|>`,
    `<|eot_id|>`, `<end_of_turn>`, `</s>`), or None when it writes none."""
    return _probed(tokenizer, _end_of_turn)


def stop_token_ids(tokenizer, generation_config=None) -> list[int]:
    """Ids that end an answer: the model's generation-config end ids, the template's end-of-turn token and the
    tokenizer's end-of-sequence token."""
    ids: set[int] = set()
    eos = getattr(generation_config, "eos_token_id", None)
    ids.update([eos] if isinstance(eos, int) else list(eos or []))
    turn_end = end_of_turn(tokenizer)
    if turn_end is not None:
        ids.add(turn_end[1])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    if not ids:
        raise ChatTemplateError(
            f"{tokenizer.name_or_path!r}: no end-of-turn token in the chat template, no eos_token_id in the "
            "generation config or the tokenizer: answers would never stop. Set the tokenizer's eos_token."
        )
    return sorted(ids)


def ensure_pad_token(tokenizer) -> str | None:
    """Give a tokenizer without a pad token its end-of-sequence token as pad (padding is masked everywhere we pad);
    the message to show, or None when it had one."""
    if tokenizer.pad_token is not None:
        return None
    if tokenizer.eos_token is None:
        raise ChatTemplateError(f"{tokenizer.name_or_path!r} has neither a pad token nor an eos token to pad with")
    tokenizer.pad_token = tokenizer.eos_token
    return f"{tokenizer.name_or_path}: no pad token; padding with its eos token {tokenizer.eos_token!r} (masked)"


@dataclass
class MaskedConversation:
    input_ids: list[int]
    assistant_masks: list[int]  # 1 on the tokens of assistant turns (their end-of-turn token included)


def _assistant_spans(tokenizer, messages: Sequence[dict], text: str) -> list[tuple[int, int]]:
    turn_end = end_of_turn(tokenizer)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prefix = render(tokenizer, messages[:i], add_generation_prompt=True)
        start = len(prefix)
        content, found = str(message["content"]), -1
        if text.startswith(prefix):
            found = text.find(content, start)
            if found < 0 or text[start:found].strip():  # templates often trim the content
                content = content.strip()
                found = text.find(content, start)
        if found < 0 or text[start:found].strip():
            raise ChatTemplateError(
                f"the chat template of {tokenizer.name_or_path!r} does not render turn {i + 1} after the turns before "
                "it as they render alone (it is not prefix-preserving), so the assistant turns cannot be told apart "
                "for an assistant-only loss. Train on whole conversations with assistant_only_loss=false, or give "
                "the tokenizer a template with {% generation %} markers."
            )
        end = found + len(content)
        if turn_end is not None and text.startswith(turn_end[0], end):
            end += len(turn_end[0])
        spans.append((start, end))
    return spans


def mask_assistant_turns(tokenizer, messages: Sequence[dict]) -> MaskedConversation:
    """Token ids of the rendered conversation and a mask of its assistant turns, for templates without
    `{% generation %}` markers: each assistant turn is located by rendering the turns before it with the generation
    prompt (its start) and finding its content after that (its end, plus the end-of-turn token, which the model must
    learn to emit)."""
    text = render(tokenizer, messages, add_generation_prompt=False)
    spans = _assistant_spans(tokenizer, messages, text)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    masks = [int(any(start <= begin < end for start, end in spans)) for begin, _ in encoded["offset_mapping"]]
    return MaskedConversation(list(encoded["input_ids"]), masks)


def loss_masking(tokenizer) -> str:
    """How the assistant-only loss finds the assistant turns of this template: "markers" (the template has
    `{% generation %}` markers), "trl-patch" (trl swaps in a marked version of this known template) or "spans"
    (`mask_assistant_turns`)."""
    from trl.chat_template_utils import get_training_chat_template, has_generation_markers

    template = tokenizer.chat_template
    if template is not None and has_generation_markers(template):
        return "markers"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            patched = get_training_chat_template(tokenizer)
    except Exception:  # trl knows templates by their exact text and refuses the others
        patched = None
    return "trl-patch" if patched is not None else "spans"
