"""Chat templates as vLLM takes them: the model's own, or one given at start-up
(``--chat-template``, a file or the template itself) or per request (``chat_template``, only
where the server trusts it), with ``chat_template_kwargs`` for the template's own variables
(Qwen3's ``enable_thinking``, a system default's date...) and ``continue_final_message``
(the reply continues the conversation's last message, e.g. an assistant prefix, instead of
opening a new turn). Everything is checked before anything is rendered; an error starts with
the name of the option at fault. No jax here.
"""

from __future__ import annotations

import functools
import inspect
from pathlib import Path
from typing import Any


class ChatTemplateError(ValueError):
    """A chat template that does not compile (its message starts with the option's name)."""


@functools.cache
def reserved_kwargs() -> frozenset[str]:
    """Names ``chat_template_kwargs`` may not set: ``apply_chat_template``'s own parameters (in
    the installed transformers) and the template's ``messages``."""
    from transformers import PreTrainedTokenizerBase

    params = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
    return frozenset(name for name, p in params.items() if p.kind != p.VAR_KEYWORD) | {"messages"}


def check_syntax(template: str, what: str = "chat_template") -> str:
    """``template`` if it is a str that compiles as transformers compiles chat templates (its
    sandbox and extensions), else an error naming ``what``. Compiling a big template takes
    a while (~1 s for 50 KB): the server does it on its tokenizer thread."""
    import jinja2
    from transformers.utils.chat_template_utils import _compile_jinja_template

    if not isinstance(template, str) or not template:
        raise TypeError(f"{what} must be a non-empty str (a Jinja template), got {template!r:.80}")
    try:
        _compile_jinja_template(template)  # (cached: the render compiles it once)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"{what} is not a valid Jinja template: {e.message} (line {e.lineno})") from None
    except (SyntaxError, RecursionError, MemoryError) as e:  # nesting deeper than Python compiles
        raise ChatTemplateError(f"{what} is not a usable Jinja template: {type(e).__name__}: {e}") from None
    return template


def load_chat_template(value: str) -> str:
    """``--chat-template``: the file ``value`` names, or ``value`` itself when it holds Jinja's
    characters (as vLLM reads it, its escapes such as ``\\n`` decoded); checked."""
    path = Path(value)
    try:
        is_file = path.is_file()
    except OSError:  # a template too long for a file name
        is_file = False
    if is_file:
        return check_syntax(path.read_text(encoding="utf-8"), f"--chat-template {value}")
    if not any(c in value for c in "{}\n"):
        raise FileNotFoundError(f"--chat-template {value!r}: no such file, and it is not a template")
    try:  # escapes such as \n decoded, other characters kept as they are
        template = value.encode("latin-1", "backslashreplace").decode("unicode_escape")
    except UnicodeDecodeError as e:
        raise ValueError(f"--chat-template: a bad escape in the template: {e.reason}") from None
    return check_syntax(template, "--chat-template")


def template_kwargs(*, add_generation_prompt: Any = True, continue_final_message: Any = False,
                    chat_template: Any = None, chat_template_kwargs: Any = None,
                    compile: bool = True) -> dict[str, Any]:
    """The keyword arguments of ``apply_chat_template`` (less the conversation and tools) for
    these options, checked (``compile``: ``chat_template`` compiled too, else only its type)."""
    for name, value in (("add_generation_prompt", add_generation_prompt),
                        ("continue_final_message", continue_final_message)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    if add_generation_prompt and continue_final_message:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true: the reply either "
                         "continues the last message or opens a new turn (set add_generation_prompt to false)")
    if chat_template is not None and compile:
        check_syntax(chat_template)
    elif chat_template is not None and (not isinstance(chat_template, str) or not chat_template):
        raise TypeError(f"chat_template must be a non-empty str (a Jinja template), got {chat_template!r:.80}")
    extra = {}
    if chat_template_kwargs is not None:
        if not isinstance(chat_template_kwargs, dict):
            raise TypeError(f"chat_template_kwargs must be a dict of the template's variables, got "
                            f"{type(chat_template_kwargs).__name__}")
        for key in chat_template_kwargs:
            if not isinstance(key, str) or not key.isidentifier():
                raise ValueError(f"chat_template_kwargs[{key!r}]: a template variable's name must be an identifier")
            if key in reserved_kwargs():
                raise ValueError(f"chat_template_kwargs[{key!r}]: {key} is not the template's to take (set it by "
                                 "its own option, if it has one)")
        extra = dict(chat_template_kwargs)
    return {**extra, "chat_template": chat_template, "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message}
