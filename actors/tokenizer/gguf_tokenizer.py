"""Text <-> token ids for a GGUF model: a `tokenizers.Tokenizer` rebuilt from the file's metadata, plus its chat template.

A GGUF file has no tokenizer.json; it stores llama.cpp's description of one (vocabulary, merges,
token types, pre-tokenizer name, special ids). We read those keys straight from the file header
and build the equivalent Hugging Face `tokenizers` pipeline, without importing transformers:
byte-level BPE ("gpt2") and Gemma's SentencePiece BPE ("llama" in a gemma/gemma2/gemma3 file).
"""

from __future__ import annotations

import functools

import json
import os

from collections.abc import Callable, Sequence
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from actors.tokenizer.chat import ChatTemplate, detect_content_format, normalize_messages
from models.gguf_header import read_gguf_metadata

DecodeStep = Callable[[int], "str | None"]

# llama.cpp's token types (tokenizer.ggml.token_type)
TOKEN_TYPE_CONTROL = 3  # special tokens: <|im_start|>, <|endoftext|>; skipped by skip_special_tokens
TOKEN_TYPE_USER_DEFINED = 4  # added tokens matched whole in text but decoded like text, e.g. <think>
SPIECE_SPACE = "\u2581"  # "▁", SentencePiece's spelling of a space
_GEMMA_ARCHITECTURES = {"gemma", "gemma2", "gemma3"}

# Pre-tokenizer split regexes for llama.cpp `tokenizer.ggml.pre` names other than the GPT-2 default
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}
_IGNORE_MERGES_PRE = {"llama3", "llama-bpe"}  # llama.cpp looks whole words up in the vocab first for these


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the alphabet byte-level vocabularies are spelled in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def build_tokenizer(metadata: dict[str, Any]) -> Tokenizer:
    """The `tokenizers.Tokenizer` the GGUF `tokenizer.*` metadata describes: byte-level BPE ("gpt2"), or
    SentencePiece BPE ("llama") for Gemma files."""
    kind = metadata.get("tokenizer.ggml.model")
    arch = metadata.get("general.architecture")
    if kind == "gpt2":
        return _byte_level_bpe(metadata)
    if kind == "llama" and arch in _GEMMA_ARCHITECTURES:
        return _gemma_bpe(metadata)
    raise ValueError(
        f"tokenizer.ggml.model {kind!r} is not supported yet for architecture {arch!r}; supported: 'gpt2' "
        f"(byte-level BPE), and 'llama' (SentencePiece BPE) for the architectures {sorted(_GEMMA_ARCHITECTURES)}"
    )


def _gemma_bpe(metadata: dict[str, Any]) -> Tokenizer:
    """Gemma's SentencePiece BPE as its tokenizer.json (and transformers' GGUF converter) has it: spaces
    become "▁", no pre-splitting, byte fallback to <0xNN> tokens. The file lists no merges; they are every
    split of a token into two vocabulary pieces, ranked by the token's position in the vocabulary (Gemma's
    scores do not follow its merge order), longer left piece first."""
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    types: list[int] = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    special_ids = _special_ids(metadata, types)
    # llama.cpp stores tokens of two or more spaces as spaces; the model's vocabulary spells them with "▁"
    pieces = [SPIECE_SPACE * len(t) if t and set(t) == {" "} else t for t in tokens]
    vocab = {piece: i for i, piece in enumerate(pieces)}
    if len(vocab) != len(pieces):
        raise ValueError(f"the GGUF vocabulary has {len(pieces) - len(vocab)} duplicate tokens")
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None else "<unk>"
    tokenizer = Tokenizer(models.BPE(vocab, _merges_by_rank(pieces, vocab), unk_token=unk, fuse_unk=True,
                                     byte_fallback=True))
    tokenizer.normalizer = normalizers.Replace(" ", SPIECE_SPACE)
    tokenizer.decoder = decoders.Sequence([decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(),
                                           decoders.Fuse()])
    # Respelled whitespace tokens are left to the BPE, as transformers does.
    user_defined = [i for i, t in enumerate(types)
                    if t == TOKEN_TYPE_USER_DEFINED and i not in special_ids and pieces[i] == tokens[i]]
    tokenizer.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in sorted(special_ids)])
    tokenizer.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in user_defined])
    return tokenizer


def _merges_by_rank(pieces: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """(left, right) for every split of every piece into two vocabulary pieces: pieces in vocabulary
    order, and within one piece the longer left part first (~0.5M merges for Gemma's 262k pieces)."""
    merges = []
    for piece in pieces:
        for cut in range(len(piece) - 1, 0, -1):
            left = piece[:cut]
            if left in vocab:
                right = piece[cut:]
                if right in vocab:
                    merges.append((left, right))
    return merges


def _byte_level_bpe(metadata: dict[str, Any]) -> Tokenizer:
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    types: list[int] = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    special_ids = _special_ids(metadata, types)
    user_defined_ids = {i for i, t in enumerate(types) if t == TOKEN_TYPE_USER_DEFINED} - special_ids

    # Ordinary tokens must be spelled in the byte alphabet; re-spell any that a converter stored as raw text.
    # Special and user-defined tokens keep their text: they are matched whole, and ByteLevel decodes a token
    # holding characters outside the alphabet as its own UTF-8 text.
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        if i not in special_ids and i not in user_defined_ids and not set(token) <= alphabet:
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, i)
    merges = [tuple(merge.split(" ", 1)) for merge in metadata.get("tokenizer.ggml.merges", [])]

    pre = metadata.get("tokenizer.ggml.pre", "default")
    tokenizer = Tokenizer(models.BPE(vocab, merges, ignore_merges=pre in _IGNORE_MERGES_PRE))
    tokenizer.pre_tokenizer = _byte_level_pre_tokenizer(pre)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in sorted(special_ids)])
    tokenizer.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in sorted(user_defined_ids)])
    if tokenizer.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise ValueError(
            f"rebuilt tokenizer has {tokenizer.get_vocab_size(with_added_tokens=True)} ids, the GGUF lists "
            f"{len(tokens)} tokens (duplicate token strings?)"
        )
    return tokenizer


def _byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre == "smollm":  # llama.cpp: regexes ["\p{N}", GPT-2], i.e. every digit alone, then GPT-2's split
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    if pre in _PRE_SPLITS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_PRE_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # "default", "gpt2", unknown names


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _gpt2_files_bpe(path: str, config: dict[str, Any]) -> Tokenizer:
    """GPT-2's byte-level BPE from vocab.json and merges.txt (what transformers' GPT2Tokenizer reads,
    OPT's and RoBERTa's among them), as its fast tokenizer is built: no prefix space unless
    tokenizer_config.json asks, bytes decoded back; the special tokens it (or
    special_tokens_map.json) names, and its added tokens, kept whole."""
    from tokenizers import processors
    tok = Tokenizer(models.BPE.from_file(os.path.join(path, "vocab.json"), os.path.join(path, "merges.txt"),
                                         continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=bool(config.get("add_prefix_space", False)))
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    named = {**_read_json(os.path.join(path, "special_tokens_map.json")), **config}
    special: list[str] = []
    for key in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token"):
        value = named.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str) and value not in special:
            special.append(value)
    added = sorted(((int(i), t) for i, t in (config.get("added_tokens_decoder") or {}).items()), key=lambda p: p[0])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    for _, t in added:
        token = AddedToken(t["content"], special=bool(t.get("special")), normalized=bool(t.get("normalized")),
                           lstrip=bool(t.get("lstrip")), rstrip=bool(t.get("rstrip")),
                           single_word=bool(t.get("single_word")))
        (tok.add_special_tokens if t.get("special") else tok.add_tokens)([token])
    return tok


def _special_ids(metadata: dict[str, Any], types: list[int]) -> set[int]:
    """CONTROL tokens plus whichever of bos/eos/unk/pad the file names."""
    ids = {i for i, t in enumerate(types) if t == TOKEN_TYPE_CONTROL}
    for name in ("bos", "eos", "unknown", "padding"):
        token_id = metadata.get(f"tokenizer.ggml.{name}_token_id")
        if token_id is not None and 0 <= token_id < len(types):
            ids.add(token_id)
    return ids



@functools.lru_cache(maxsize=16)
def _compiled_template(source: str) -> ChatTemplate:
    """A request's own chat template, compiled once while it keeps being asked for."""
    return ChatTemplate(source)

class TextTokenizer:
    """Encode, decode and chat-format for one model; the slice of transformers' tokenizer API the engine uses."""
    has_text = True          # reads and writes text (TokenIdsOnly: --skip-tokenizer-init's, does not)

    def __init__(self, tokenizer: Tokenizer, metadata: dict[str, Any], source: str | None = None,
                 config: dict[str, Any] | None = None):
        self.backend_tokenizer = tokenizer
        self.source = source                 # the file or directory it was read from
        self._config = config                # a Hugging Face directory's tokenizer_config.json
        self._kind = metadata.get("tokenizer.ggml.model")
        types = metadata.get("tokenizer.ggml.token_type") or []
        self.vocab_size: int = len(metadata["tokenizer.ggml.tokens"])
        self.bos_token_id: int | None = metadata.get("tokenizer.ggml.bos_token_id")
        self.eos_token_id: int | None = metadata.get("tokenizer.ggml.eos_token_id")
        self.pad_token_id: int | None = metadata.get("tokenizer.ggml.padding_token_id")
        self.unk_token_id: int | None = metadata.get("tokenizer.ggml.unknown_token_id")
        self.add_bos_token: bool = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
        self.add_eos_token: bool = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
        self.all_special_ids: list[int] = sorted(_special_ids(metadata, types))
        # a Hugging Face tokenizer.json whose post-processor adds the special tokens (BERT's [CLS] and
        # [SEP], Llama 3's BOS) where tokenizer_config.json sets no BOS/EOS flags of its own: what
        # transformers' fast tokenizer adds with add_special_tokens, as it adds them
        self._post_processed = (config is not None and tokenizer.post_processor is not None
                                and not {"add_bos_token", "add_eos_token"} & config.keys())
        self.chat_template: str | None = metadata.get("tokenizer.chat_template") or None
        self._chat_template = ChatTemplate(self.chat_template) if self.chat_template else None
        self.content_format = "auto"      # --chat-template-content-format: auto, string or openai
        self.image_placeholder: dict[str, str] | None = None   # a model that takes images (videos): each one's placeholder

    @classmethod
    def from_gguf(cls, path: str) -> TextTokenizer:
        metadata = read_gguf_metadata(path)
        return cls(build_tokenizer(metadata), metadata, source=path)

    @classmethod
    def from_hf_dir(cls, path: str) -> TextTokenizer:
        """A Hugging Face checkpoint directory: tokenizer.json (or, in older saves, GPT-2's
        vocab.json and merges.txt), and tokenizer_config.json for the special tokens, the BOS flag
        and the chat template (or chat_template.jinja, or a processor's chat_template.json)."""
        config = _read_json(os.path.join(path, "tokenizer_config.json"))
        if os.path.isfile(os.path.join(path, "tokenizer.json")):
            tokenizer = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        elif os.path.isfile(os.path.join(path, "vocab.json")) and os.path.isfile(os.path.join(path, "merges.txt")):
            tokenizer = _gpt2_files_bpe(path, config)
        else:
            raise ValueError(f"{path} has no tokenizer.json (nor GPT-2's vocab.json and merges.txt): give one with "
                             "--tokenizer, or serve token ids without a tokenizer with --skip-tokenizer-init")
        # a saved padding or truncation applies only where a caller asks (as in transformers)
        tokenizer.no_padding()
        tokenizer.no_truncation()
        n = tokenizer.get_vocab_size(with_added_tokens=True)
        types = [0] * n
        for token_id, added in tokenizer.get_added_tokens_decoder().items():
            if added.special and token_id < n:
                types[token_id] = TOKEN_TYPE_CONTROL

        def token_id(key: str) -> int | None:
            tok = config.get(key)
            tok = tok.get("content") if isinstance(tok, dict) else tok
            return tokenizer.token_to_id(tok) if isinstance(tok, str) else None
        template = config.get("chat_template")
        if isinstance(template, list):   # named templates: use the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.isfile(jinja):
            with open(jinja) as f:
                template = f.read()
        processor_template = os.path.join(path, "chat_template.json")     # a processor's (Qwen2-VL's)
        if template is None and os.path.isfile(processor_template):
            template = _read_json(processor_template).get("chat_template")
        metadata = {
            "tokenizer.ggml.tokens": range(n), "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.bos_token_id": token_id("bos_token"),
            "tokenizer.ggml.eos_token_id": token_id("eos_token"),
            "tokenizer.ggml.padding_token_id": token_id("pad_token"),
            "tokenizer.ggml.unknown_token_id": token_id("unk_token"),
            "tokenizer.ggml.add_bos_token": bool(config.get("add_bos_token", False)),
            "tokenizer.ggml.add_eos_token": bool(config.get("add_eos_token", False)),
            "tokenizer.chat_template": template,
        }
        return cls(tokenizer, metadata, source=path, config=config)

    @classmethod
    def from_source(cls, kind: str, path: str) -> TextTokenizer:
        if kind == "gguf":
            return cls.from_gguf(path)
        if kind == "hf_dir":
            return cls.from_hf_dir(path)
        raise ValueError(f"no tokenizer for a model source of kind {kind!r}")

    def set_chat_template(self, source: str) -> None:
        """Use ``source`` (Jinja) instead of the checkpoint's chat template."""
        self._chat_template = ChatTemplate(source)
        self.chat_template = source

    def tokenizer_config(self) -> dict[str, Any]:
        """What vLLM's GET /tokenizer_info answers: tokenizer_config.json's equivalent. A Hugging
        Face directory's own file less its file paths, a GGUF file's special tokens and flags;
        token objects as their text, the added tokens by id, the chat template in use, and the
        transformers class that reads it (``tokenizer_class``)."""
        def text(value: Any) -> Any:
            if isinstance(value, dict):
                return value["content"] if isinstance(value.get("content"), str) else {k: text(v) for k, v in value.items()}
            return [text(v) for v in value] if isinstance(value, list) else value
        if self._config is not None:
            info = {k: text(v) for k, v in self._config.items()
                    if k not in ("vocab_file", "merges_file", "tokenizer_file", "chat_template")}
            cls = info.get("tokenizer_class") or "PreTrainedTokenizerFast"
        else:
            info = {"add_bos_token": self.add_bos_token, "add_eos_token": self.add_eos_token,
                    **{name: tok for name, tok in (("bos_token", self.bos_token), ("eos_token", self.eos_token),
                                                   ("pad_token", self._token(self.pad_token_id)),
                                                   ("unk_token", self._token(self.unk_token_id))) if tok is not None},
                    "clean_up_tokenization_spaces": False}
            cls = {"gpt2": "GPT2TokenizerFast", "llama": "LlamaTokenizerFast"}.get(self._kind, "PreTrainedTokenizerFast")
        info["added_tokens_decoder"] = {str(i): t.content for i, t in
                                        sorted(self.backend_tokenizer.get_added_tokens_decoder().items())}
        if self.source is not None:
            info["name_or_path"] = self.source
        if self.chat_template:
            info["chat_template"] = self.chat_template
        info["tokenizer_class"] = cls
        return info

    def _token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.backend_tokenizer.id_to_token(token_id)

    @property
    def bos_token(self) -> str | None:
        return self._token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return self._token(self.eos_token_id)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. Special-token text (`<|im_start|>`) always maps to its id; `add_special_tokens`
        adds BOS/EOS where the GGUF's add_bos_token/add_eos_token ask for them (a Hugging Face
        tokenizer.json's post-processor, where its flags are unset)."""
        if add_special_tokens and self._post_processed:
            return self.backend_tokenizer.encode_batch([text], add_special_tokens=True)[0].ids
        ids = self._ids(text)
        if add_special_tokens:
            ids = self._with_bos(ids)
            if self.add_eos_token and self.eos_token_id is not None:
                ids = [*ids, self.eos_token_id]
        return ids

    def encode_pair(self, first: str, second: str) -> list[int]:
        """Token ids of a text pair as transformers' fast tokenizer encodes ``text`` with
        ``text_pair`` (a cross-encoder's query and document): tokenizer.json's post-processor
        joins them and adds its special tokens (a GGUF file's vocabulary has none: the two
        joined, BOS first where the file asks)."""
        return self.encode_pair_with_types(first, second)[0]

    def encode_pair_with_types(self, first: str, second: str) -> tuple[list[int], list[int]]:
        """``encode_pair``'s ids and each one's token type (0: the first text's, 1: the second's,
        as tokenizer.json's post-processor types them; all 0 where it types none)."""
        enc = self.backend_tokenizer.encode(first, second, add_special_tokens=True)
        ids = list(enc.ids)
        if self.backend_tokenizer.post_processor is None:
            return self._with_bos(ids), [0] * len(self._with_bos(ids))
        return ids, list(enc.type_ids)

    def token_offsets(self, text: str, ids: Sequence[int]) -> list[tuple[int, int]] | None:
        """Each of ``ids``' (start, end) characters in ``text``, where ``ids`` are ``text``'s
        tokens (with BOS before or EOS after them: (0, 0), as transformers gives special
        tokens); None when they are not."""
        enc = self.backend_tokenizer.encode_batch([text], add_special_tokens=False)[0]
        core, offsets = list(enc.ids), [tuple(o) for o in enc.offsets]
        ids = list(ids)
        head = 1 if ids[:1] == [self.bos_token_id] and ids[1:len(core) + 1] == core else 0
        if ids[head:head + len(core)] != core or len(ids) - head - len(core) not in (0, 1):
            return None
        tail = ids[head + len(core):]
        if tail and tail != [self.eos_token_id]:
            return None
        return [(0, 0)] * head + offsets + [(0, 0)] * len(tail)

    def _with_bos(self, ids: list[int]) -> list[int]:
        """`ids` with BOS in front if the GGUF asks for it (add_bos_token) and it is not there already."""
        if self.add_bos_token and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            return [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_stream(self, context_ids: Sequence[int], skip_special_tokens: bool = True) -> DecodeStep | None:
        """Incremental decoding in the tokenizers library (one call per token instead of two
        decodes of a window): ``step(token_id)`` returns the text that token completes, None while
        its bytes end mid-character. ``context_ids``: the tokens before the first step (their text
        is not returned); the same text as ``decode`` over a window from them. None where the
        library has no incremental decoder (before tokenizers 0.21)."""
        backend = self.backend_tokenizer
        make = getattr(decoders, "DecodeStream", None)
        if make is None:
            return None
        try:
            stream = make(ids=list(context_ids), skip_special_tokens=skip_special_tokens)
        except TypeError:             # a library without ``ids``: the context stepped through
            stream = make(skip_special_tokens=skip_special_tokens)
            for token_id in context_ids:
                stream.step(backend, token_id)
        return lambda token_id: stream.step(backend, token_id)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        return [self.backend_tokenizer.id_to_token(i) for i in ids]

    def convert_tokens_to_string(self, tokens: Sequence[str]) -> str:
        """Token strings joined into text by the tokenizer's decoder (as transformers' fast
        tokenizers do)."""
        decoder = self.backend_tokenizer.decoder
        return decoder.decode(list(tokens)) if decoder is not None else "".join(tokens)

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, chat_template: str | None = None,
                            content_format: str | None = None, **template_kwargs: Any) -> str:
        """Render OpenAI-style `messages` (content as string or text parts) to prompt text, with
        `chat_template` (Jinja source) instead of the model's when given; `content_format`
        ("auto", "string" or "openai"; None: `self.content_format`) is how content reaches it.

        `template_kwargs` (tools, documents, enable_thinking, ...) become template variables and
        override the special-token strings (bos_token, eos_token, unk_token, pad_token) passed by default.
        """
        template = self._chat_template if chat_template is None else _compiled_template(chat_template)
        if template is None:
            raise ValueError("this model's GGUF has no tokenizer.chat_template; send a plain completion prompt instead")
        variables = {
            "bos_token": self.bos_token or "", "eos_token": self.eos_token or "",
            "unk_token": self._token(self.unk_token_id) or "", "pad_token": self._token(self.pad_token_id) or "",
            **template_kwargs,
        }
        return template.render(
            normalize_messages(messages, self.content_format_of(template.source, content_format), self.image_placeholder),
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, **variables,
        )

    def content_format_of(self, template_source: str, given: str | None = None) -> str:
        """How message content reaches ``template_source``: ``given`` (else the configured
        format), or for "auto" the one the template reads (vLLM's detection)."""
        given = given or self.content_format
        return given if given != "auto" else detect_content_format(template_source)

    def encode_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, add_special_tokens: bool = False,
                    **template_kwargs: Any) -> list[int]:
        """Prompt token ids for a chat: the rendered template, with its special tokens as single ids.

        BOS is prepended only when the GGUF's add_bos_token is set and the template did not write it;
        ``add_special_tokens`` (vLLM's chat field) also appends EOS where add_eos_token asks for it.
        """
        text = self.apply_chat_template(messages, add_generation_prompt, continue_final_message, **template_kwargs)
        return self.encode(text, add_special_tokens=True) if add_special_tokens else self._with_bos(self._ids(text))

    def _ids(self, text: str) -> list[int]:
        # encode_batch releases the GIL (encode does not): from a thread, a long text does not
        # hold up the event loop; the ids are the same
        return self.backend_tokenizer.encode_batch([text], add_special_tokens=False)[0].ids

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token stands for: a text of n characters has at least
        n / max_token_chars tokens."""
        return max(map(len, self.backend_tokenizer.get_vocab(with_added_tokens=True)), default=1)


class NoTokenizer(ValueError):
    """What needs a tokenizer was asked of a server that loads none (--skip-tokenizer-init)."""


TEXT_PROMPTS_REFUSED = "You cannot pass text prompts when `skip_tokenizer_init=True`"
NO_TOKENIZER = "Tokenizer not available when `skip_tokenizer_init=True`"


class TokenIdsOnly:
    """vLLM's --skip-tokenizer-init: no tokenizer is read. Prompts come as token ids, answers
    carry token ids (their text empty, as vLLM's); whatever would read or write text (a text
    prompt, a chat template, /tokenize) is a NoTokenizer error in vLLM's words."""
    has_text = False
    chat_template: str | None = None
    content_format = "auto"
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    unk_token_id: int | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    add_bos_token = False
    add_eos_token = False
    source: str | None = None
    max_token_chars = 1

    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int] = ()) -> None:
        self.vocab_size = vocab_size
        self.eos_token_id: int | None = eos_token_ids[0] if eos_token_ids else None
        self.all_special_ids: list[int] = sorted(eos_token_ids)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        raise NoTokenizer(TEXT_PROMPTS_REFUSED)

    def encode_chat(self, messages: Sequence[dict[str, Any]], *args: Any, **kwargs: Any) -> list[int]:
        raise NoTokenizer(NO_TOKENIZER)

    def encode_pair(self, first: str, second: str) -> list[int]:
        raise NoTokenizer(TEXT_PROMPTS_REFUSED)

    def encode_pair_with_types(self, first: str, second: str) -> tuple[list[int], list[int]]:
        raise NoTokenizer(TEXT_PROMPTS_REFUSED)

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], *args: Any, **kwargs: Any) -> str:
        raise NoTokenizer(NO_TOKENIZER)

    def set_chat_template(self, source: str) -> None:
        raise NoTokenizer("--chat-template cannot be used with --skip-tokenizer-init: there is no tokenizer "
                          "to render a chat with")

    def tokenizer_config(self) -> dict[str, Any]:
        raise NoTokenizer(NO_TOKENIZER)

    def token_offsets(self, text: str, ids: Sequence[int]) -> None:
        return None

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return ""                      # no text: answers are their token ids

    def decode_stream(self, context_ids: Sequence[int], skip_special_tokens: bool = True) -> DecodeStep:
        return lambda token_id: ""     # each token adds no text (and the window never grows)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        return [f"token_id:{i}" for i in ids]

    def convert_tokens_to_string(self, tokens: Sequence[str]) -> str:
        return ""
