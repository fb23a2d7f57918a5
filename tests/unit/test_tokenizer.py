"""The torch-free tokenizer agrees with transformers', and streaming deltas are exact."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.common.tokenizer import Tokenizer
from cluster.engine.detokenizer import IncrementalDetokenizer

TEXTS = ["Hello world", "  spaced   out ", "naïve café — 東京 🚀", "def f(x):\n    return x", ""]


@pytest.fixture(scope="module")
def pair(tiny_model_dir: Path) -> tuple[Tokenizer, object]:
    from transformers import AutoTokenizer

    return Tokenizer(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir)


def test_encode_decode_match_transformers(pair: tuple[Tokenizer, object]) -> None:
    ours, hf = pair
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf.encode(text), text  # type: ignore[attr-defined]
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)  # type: ignore[attr-defined]


def test_chat_options_match_transformers(
    pair: tuple[Tokenizer, object], tiny_model_dir: Path
) -> None:
    """add_generation_prompt, continue_final_message and extra template variables
    (chat_template_kwargs) render as transformers renders them."""
    hf = pair[1]
    ours = Tokenizer(tiny_model_dir)
    template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
        "{% if enable_thinking is defined and not enable_thinking %}<nothink>{% endif %}"
    )
    ours.chat_template = template
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " I am "}]
    for add, cont, extra in [
        (True, False, {}),
        (False, False, {}),
        (True, False, {"enable_thinking": False}),
        (False, True, {}),
    ]:
        want = hf.apply_chat_template(  # type: ignore[attr-defined]
            msgs,
            chat_template=template,
            tokenize=False,
            add_generation_prompt=add,
            continue_final_message=cont,
            **extra,
        )
        got = ours.apply_chat_template(
            msgs, add, continue_final_message=cont, template_kwargs=extra
        )
        assert got == want, (add, cont, extra)
    assert got.endswith("<assistant> I am ")  # as transformers: the content as sent
    with pytest.raises(ValueError, match="continue_final_message"):
        ours.apply_chat_template(msgs, True, continue_final_message=True)


def test_chat_template_matches_transformers(pair: tuple[Tokenizer, object]) -> None:
    ours, hf = pair
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
    ]
    expected = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)  # type: ignore[attr-defined]
    assert ours.apply_chat_template(messages) == expected
    assert ours.encode_chat(messages) == ours.encode(expected, add_special_tokens=False)
    with pytest.raises(ValueError, match=r"messages\[0\]\.content"):
        ours.encode_chat([{"role": "user", "content": None}])
    with pytest.raises(ValueError, match="messages: must not be empty"):
        ours.encode_chat([])


def test_eos_ids_come_from_the_checkpoint(pair: tuple[Tokenizer, object]) -> None:
    ours, _ = pair
    assert ours.eos_token_ids == (2,)


def test_incremental_deltas_concatenate_to_the_full_text(pair: tuple[Tokenizer, object]) -> None:
    ours, _ = pair
    ids = ours.encode("naïve café — 東京 🚀 and more text")
    detok = IncrementalDetokenizer(ours)
    text = ""
    for t in ids:
        assert detok.add(t) is None
        text += detok.delta(finished=False)
    text += detok.delta(finished=True)
    assert text == ours.decode(ids)
    assert "\ufffd" not in text


def test_stop_string_truncates_and_is_never_streamed(pair: tuple[Tokenizer, object]) -> None:
    ours, _ = pair
    ids = ours.encode("one, two, three, four")
    detok = IncrementalDetokenizer(ours, stop=["three"])
    streamed = ""
    matched = None
    for t in ids:
        matched = detok.add(t)
        streamed += detok.delta(finished=matched is not None)
        if matched:
            break
    assert matched == "three"
    assert streamed == "one, two, "
    assert "thr" not in streamed


def test_long_texts_tokenize_without_holding_the_gil(real_model_dir: Path) -> None:
    """B10: a few hundred KiB of text are tokenized while other threads keep running (the
    router tokenizes big prompts off its event loop), to the same ids as a short encode."""
    import random
    import threading
    import time

    from cluster.common.tokenizer import LONG_TEXT_CHARS, Tokenizer

    tok = Tokenizer(real_model_dir)
    rng = random.Random(1)
    words = (
        "".join(rng.choice("abcdefghij") for _ in range(rng.randint(2, 9))) for _ in range(80000)
    )
    text = " ".join(words)
    assert len(text) > 10 * LONG_TEXT_CHARS
    started = threading.Event()
    ids: list[int] = []

    def run() -> None:
        started.wait()
        ids.extend(tok.encode(text))

    worker = threading.Thread(target=run)
    worker.start()
    gaps, last = [], time.monotonic()
    started.set()
    while worker.is_alive():
        time.sleep(0.002)
        now = time.monotonic()
        gaps.append(now - last)
        last = now
    worker.join()
    assert len(gaps) > 10 and max(gaps) < 0.5, (len(gaps), max(gaps))  # not one long stall
    assert ids == list(tok._tok.encode(text).ids)
