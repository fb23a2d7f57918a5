"""Torch-free tokenizer and chat template (the engine's incremental detokenizer builds on it).

The router tokenizes without importing torch or transformers (whose import pulls torch), so this
reads a transformers checkpoint's ``tokenizer.json`` with the ``tokenizers`` library and renders
its chat template with jinja2 the way transformers does (sandboxed, same globals). The engine uses
the same class, so the router and the pools always agree on token ids.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer

from cluster.config import ClusterConfig
from cluster.config.model_paths import require_model_dir

LONG_TEXT_CHARS = 16 << 10  # longer texts are tokenized without holding the GIL


class ChatTemplateError(ValueError):
    pass


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


class Tokenizer:
    """A transformers tokenizer directory (``tokenizer.json`` + config), loaded without torch."""

    def __init__(self, model_dir: str | Path) -> None:
        path = Path(model_dir)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(
                f"{tok_file}: missing; pdserve needs a fast-tokenizer file (tokenizer.json) "
                "in the model directory"
            )
        self._tok = _HFTokenizer.from_file(str(tok_file))
        config = _read_json(path / "tokenizer_config.json")
        model_config = _read_json(path / "config.json")
        gen_config = _read_json(path / "generation_config.json")
        self.bos_token: str | None = _token_str(config.get("bos_token"))
        self.eos_token: str | None = _token_str(config.get("eos_token"))
        self.clean_up_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        self.chat_template = _load_chat_template(path, config)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

        eos_ids: list[int] = []
        for source in (gen_config.get("eos_token_id"), model_config.get("eos_token_id")):
            if isinstance(source, int):
                eos_ids.append(source)
            elif isinstance(source, list):
                eos_ids.extend(int(x) for x in source)
        if self.eos_token is not None:
            tid = self._tok.token_to_id(self.eos_token)
            if tid is not None:
                eos_ids.append(tid)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_ids))
        self._template: Any = None
        # No token covers more characters than this (a byte-level vocabulary spells a byte as
        # one character), so a prompt that cannot fit is refused untokenized; a normalizer may
        # shrink the text first (NFKC joins characters): no bound then.
        self.max_chars_per_token: int | None = None
        if self._tok.normalizer is None:
            vocab = self._tok.get_vocab(with_added_tokens=True)
            self.max_chars_per_token = max(len(k) for k in vocab) if vocab else None

    # -- encoding ------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > LONG_TEXT_CHARS:
            # ``encode`` holds the GIL throughout (seconds for MiB: every thread of the process
            # stalls); ``encode_batch`` releases it, same ids.
            (enc,) = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)
            return list(enc.ids)
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The conversation as the model's template renders it. ``continue_final_message``:
        the text ends inside the last message (its end-of-turn cut), so the model continues
        it; ``template_kwargs``: extra template variables (e.g. ``enable_thinking``)."""
        if not self.chat_template:
            raise ChatTemplateError("messages: this model has no chat template; send a prompt")
        validate_messages(messages)
        check_chat_options(add_generation_prompt, continue_final_message, template_kwargs)
        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(
                x, ensure_ascii=False, indent=indent
            )
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(self.chat_template)
        text: str = self._template.render(
            **dict(template_kwargs or {}),
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )
        return cut_after_final_message(text, messages) if continue_final_message else text

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        # The template already places any special tokens (as transformers does).
        text = self.apply_chat_template(
            messages,
            add_generation_prompt,
            continue_final_message=continue_final_message,
            template_kwargs=template_kwargs,
        )
        return self.encode(text, add_special_tokens=False)

    # -- decoding ------------------------------------------------------------------------------

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text: str = self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        if self.clean_up_spaces:
            text = _clean_up_tokenization(text)
        return text

    def token_to_id(self, token: str) -> int | None:
        tid: int | None = self._tok.token_to_id(token)
        return tid


def validate_messages(messages: Sequence[Mapping[str, Any]]) -> None:
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise ValueError("messages: must be a list of {role, content} objects")
    if not messages:
        raise ValueError("messages: must not be empty")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{i}]: must be an object with role and content")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}].role: must be a non-empty string")
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content: must be a string")


# Template variables the renderer sets itself: chat_template_kwargs may not replace them.
RESERVED_TEMPLATE_VARIABLES = frozenset(
    {"messages", "add_generation_prompt", "bos_token", "eos_token", "raise_exception"}
)


def check_chat_options(
    add_generation_prompt: bool,
    continue_final_message: bool,
    template_kwargs: Mapping[str, Any] | None,
) -> None:
    """The chat options' combinations, as transformers and vLLM refuse them."""
    if continue_final_message and add_generation_prompt:
        raise ValueError(
            "continue_final_message: cannot be true with add_generation_prompt true (a new "
            "turn, or the last message continued: not both)"
        )
    for key in template_kwargs or {}:
        if not isinstance(key, str) or not key.isidentifier():
            raise ValueError(f"chat_template_kwargs: {key!r} is not a template variable name")
        if key in RESERVED_TEMPLATE_VARIABLES:
            raise ValueError(f"chat_template_kwargs.{key}: set by pdserve, not by the request")


def cut_after_final_message(text: str, messages: Sequence[Mapping[str, Any]]) -> str:
    """``text`` ended right after the last message's content (its end-of-turn markup dropped),
    as transformers' ``continue_final_message`` does."""
    final = str(messages[-1]["content"])
    for needle in (final, final.strip()):
        if needle and needle in text:
            return text[: text.rindex(needle) + len(needle)]
    raise ValueError(
        "continue_final_message: the final message does not appear in the rendered chat "
        "(empty, or changed by the template)"
    )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open() as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _token_str(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _load_chat_template(path: Path, config: Mapping[str, Any]) -> str | None:
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    template = config.get("chat_template")
    if isinstance(template, str):
        return template
    if isinstance(template, list):  # named templates: take "default"
        for entry in template:
            if isinstance(entry, dict) and entry.get("name") == "default":
                return str(entry.get("template"))
    ct_json = _read_json(path / "chat_template.json")
    value = ct_json.get("chat_template")
    return value if isinstance(value, str) else None


# transformers' clean_up_tokenization, in its order: " ." -> ".", ..., " ' " -> "'", " n't" -> ...
_CLEAN_UP = [(f" {s}", s) for s in ".?!,"] + [(" ' ", "'")]
_CLEAN_UP += [(f" {s}", s) for s in ("n't", "'m", "'s", "'ve", "'re")]


def _clean_up_tokenization(text: str) -> str:
    for a, b in _CLEAN_UP:
        text = text.replace(a, b)
    return text


class FakeTokenizer:
    """Tokenizer of the ``fake`` runner's model: token ``t`` reads `` t<t>``; id 0 is EOS."""

    chat_template = "fake"
    max_chars_per_token: int | None = None  # a word is one token, however long

    def __init__(self, vocab_size: int, eos_token_id: int = 0, ascii_tokens: bool = False) -> None:
        self.vocab_size = vocab_size
        self.ascii_tokens = ascii_tokens  # ids 1..127 read as their ASCII character
        self.eos_token_ids: tuple[int, ...] = (eos_token_id,)
        self.eos_token = f"t{eos_token_id}"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = []
        for word in text.split():
            if word[:1] == "t" and word[1:].isdigit() and 0 < int(word[1:]) < self.vocab_size:
                ids.append(int(word[1:]))
            else:
                ids.append(1 + sum(word.encode()) % (self.vocab_size - 1))
        return ids

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """``role: content`` per message; template variables appear as ``[key=value]``."""
        validate_messages(messages)
        check_chat_options(add_generation_prompt, continue_final_message, template_kwargs)
        extra = "".join(f"[{k}={v}] " for k, v in sorted((template_kwargs or {}).items()))
        text = extra + " ".join(f"{m['role']}: {m['content']}" for m in messages)
        if continue_final_message:
            return cut_after_final_message(text, messages)
        return text + (" assistant:" if add_generation_prompt else "")

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        return self.encode(
            self.apply_chat_template(
                messages,
                add_generation_prompt,
                continue_final_message=continue_final_message,
                template_kwargs=template_kwargs,
            )
        )

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        eos = self.eos_token_ids if skip_special_tokens else ()
        return "".join(self.token_text(t) for t in token_ids if t not in eos)

    def token_text(self, t: int) -> str:
        return chr(t) if self.ascii_tokens and 0 < t < 128 else f" t{t}"

    def token_to_id(self, token: str) -> int | None:
        ids = self.encode(token)
        return ids[0] if len(ids) == 1 else None


def load_tokenizer(config: ClusterConfig) -> Tokenizer | FakeTokenizer:
    """The tokenizer the config's model uses (torch-free; the router's entry point)."""
    if config.model.runner == "fake":
        fm = config.testing.fake_model
        return FakeTokenizer(fm.vocab_size, fm.eos_token_id, fm.ascii_tokens)
    return Tokenizer(require_model_dir(config))
