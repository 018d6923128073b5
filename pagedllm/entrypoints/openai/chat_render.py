"""Chat messages to prompt token ids, with the model's chat template.

Special tokens written inside a message (``<|im_end|>\\n<|im_start|>system`` in a user's text)
are plain text by default, as OpenAI treats them: only the special tokens the template itself
writes become control tokens, so a user cannot forge a turn. How: each special-token string found
in a message's ``content`` or ``name`` is replaced by a marker holding a per-request random nonce
before rendering; the rendered text is cut at the template's special tokens (as the tokenizer
itself cuts it), and each piece between them is tokenized as plain text
(``split_special_tokens``) with the markers put back. Conversations without such strings are
tokenized exactly as before. ``allow_special_tokens_in_content=true`` (a request field) keeps the
old behaviour: the rendered text is tokenized with every special token recognized.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

from pagedllm.entrypoints.llm import apply_chat_template
from pagedllm.entrypoints.openai.errors import APIError, value_error
from pagedllm.entrypoints.openai.protocol import ChatMessage
from pagedllm.entrypoints.openai.tool_calls.template import template_override, tool_message_fields
from pagedllm.entrypoints.openai.validation import check_generation_prompt


def message_text(m: ChatMessage, i: int) -> str:
    """The text of message ``i`` (the text parts of a content list joined with newlines).

    Raises:
        APIError: 400 (``param="messages"``) for a content part that is not text, or an empty
            list (OpenAI refuses it too).
    """
    content = m.content
    if not isinstance(content, list):
        return content or ""
    if not content:
        raise APIError(
            400,
            f"messages[{i}].content is an empty array: give a string or at least one part",
            param="messages",
        )
    texts = []
    for part in content:
        if part.type != "text":
            raise APIError(
                400,
                f"messages[{i}].content: only text parts are supported, got {part.type!r}",
                param="messages",
            )
        if part.text is None:
            raise APIError(
                400, f"messages[{i}].content: a text part needs a 'text' string", param="messages"
            )
        texts.append(part.text)
    return "\n".join(texts)


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The ``{"role", "content"[, "name", "tool_calls", "tool_call_id"]}`` dicts the chat
    template takes (tool fields: ``tool_calls/template.py``).

    Raises:
        APIError: 400 (``param="messages"``) for a content part that is not text.
    """
    out = []
    for i, m in enumerate(messages):
        d: dict[str, Any] = {"role": m.role, "content": message_text(m, i)}
        if m.name is not None:
            d["name"] = m.name
        d.update(tool_message_fields(m, i))
        out.append(d)
    return out


def special_token_strings(tokenizer: Any) -> list[str]:
    """The tokenizer's special tokens (control tokens), longest first."""
    found = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(tok, "special", False):
            found.add(str(tok.content))
    return sorted((s for s in found if s), key=len, reverse=True)


class _Markers:
    """Replaces special-token strings by ``[nonce:k]`` markers and remembers them."""

    def __init__(self, specials: list[str]) -> None:
        self.nonce = uuid.uuid4().hex
        self.find = re.compile("|".join(re.escape(s) for s in specials))
        self.originals: list[str] = []

    def mark(self, text: str) -> str:
        def sub(m: re.Match) -> str:
            self.originals.append(m.group(0))
            return f"[{self.nonce}:{len(self.originals) - 1}]"

        return self.find.sub(sub, text)

    def restore(self, text: str) -> str:
        return re.sub(rf"\[{self.nonce}:(\d+)\]", lambda m: self.originals[int(m.group(1))], text)


#: Template variables a request's ``chat_template_kwargs`` may not override (the renderer sets
#: them itself).
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages",
        "conversation",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "chat_template",
        "return_dict",
        "return_tensors",
        "tokenizer_kwargs",
    }
)


class TemplateOptions:
    """A request's own chat template (``chat_template``) and extra template variables
    (``chat_template_kwargs``); a rendering error is blamed on ``chat_template`` when the request
    brought its own template, else on ``messages``.

    Raises:
        APIError: 400 (``param="chat_template_kwargs"``) for a reserved variable name.
    """

    def __init__(self, template: str | None = None, kwargs: dict[str, Any] | None = None) -> None:
        bad = sorted(set(kwargs or {}) & RESERVED_TEMPLATE_KWARGS)
        if bad:
            raise APIError(
                400,
                f"chat_template_kwargs may not set {', '.join(bad)} (set by the server)",
                param="chat_template_kwargs",
            )
        self.template = template or None
        self.kwargs = dict(kwargs or {})
        self.param = "chat_template" if self.template else "messages"

    def failure(self, e: Exception) -> APIError:
        """The 400 of a template that failed to render (``e``: the Jinja / transformers error)."""
        what = "the request's chat_template" if self.template else "the chat template"
        msg = str(e).removeprefix("messages could not be rendered by the chat template: ")
        return APIError(400, f"messages could not be rendered by {what}: {msg}", param=self.param)


def _render_text(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    cont: bool,
    template_kwargs: dict[str, Any],
    options: TemplateOptions,
) -> str:
    try:
        return str(
            tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=add_generation_prompt and not cont,
                continue_final_message=cont,
                **template_kwargs,
            )
        )
    except Exception as e:  # jinja errors, bad roles
        raise options.failure(e) from None


def render_messages(
    tokenizer: Any,
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    continue_final_message: bool,
    allow_special_tokens_in_content: bool = False,
    options: TemplateOptions | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Token ids of ``messages`` rendered with the chat template (``options``: the request's
    own template and variables); special-token strings inside the messages are plain text
    unless ``allow_special_tokens_in_content``. ``tools`` (OpenAI-shaped) go to the template;
    when tools are involved, the request brought no template and the model's template does not
    know them, the shipped tool template renders instead (``tool_calls/template.py``).

    Raises:
        APIError: 400 (``param="messages"``) for an empty list, a non-text part, or what the
            template refuses (``param="chat_template"`` when the request brought its template).
    """
    options = options or TemplateOptions()
    if not messages:
        raise APIError(400, "messages must not be empty", param="messages")
    dicts = message_dicts(messages)
    template = options.template or template_override(tokenizer, tools, messages)
    specials = special_token_strings(tokenizer)
    markers = _Markers(specials) if specials and not allow_special_tokens_in_content else None
    if markers is not None:
        for d in dicts:
            for key in ("content", "name"):
                if key in d:
                    d[key] = markers.mark(d[key])
    if markers is None or not markers.originals:
        try:
            return apply_chat_template(
                tokenizer,
                dicts,
                add_generation_prompt,
                continue_final_message,
                template,
                options.kwargs,
                tools,
            )
        except ValueError as e:
            raise (options.failure(e) if options.template else value_error(e)) from None
    text = _render_text(
        tokenizer,
        dicts,
        add_generation_prompt,
        continue_final_message,
        {"tools": tools, "chat_template": template, **options.kwargs},
        options,
    )
    # The template's own special tokens stay control tokens; the text between them (where the
    # markers are) is tokenized as plain text, as the tokenizer would tokenize it.
    ids: list[int] = []
    for k, piece in enumerate(re.split(f"({markers.find.pattern})", text)):
        if k % 2:
            ids.append(int(tokenizer.convert_tokens_to_ids(piece)))
        elif piece:
            plain = markers.restore(piece)
            ids += tokenizer(plain, add_special_tokens=False, split_special_tokens=True).input_ids
    return ids


def render_request_messages(
    tokenizer: Any, req: Any, tools: list[dict[str, Any]] | None = None
) -> list[int]:
    """Prompt token ids of a chat or tokenize request's ``messages``: its generation-prompt
    flags checked (``check_generation_prompt``), then ``render_messages``.

    Args:
        req: a ``ChatCompletionRequest`` or ``TokenizeRequest`` with ``messages`` set.
        tools: the tools to show the template (``ToolConfig.tools``), if any.

    Raises:
        APIError: 400 naming ``continue_final_message`` or the faulty message field.
    """
    add_gp = check_generation_prompt(
        req.add_generation_prompt, req.continue_final_message, req.model_fields_set
    )
    return render_messages(
        tokenizer,
        req.messages,
        add_gp,
        req.continue_final_message,
        req.allow_special_tokens_in_content,
        TemplateOptions(req.chat_template, req.chat_template_kwargs),
        tools,
    )
