"""Tokenizer actor: renders the chat template, tokenizes, validates against the context
length, registers the request with the Detokenizer and hands it to the engine."""
from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, ClassVar

import msgspec
import numpy as np

from actors.detokenizer.actor import TrackRequest
from actors.engine.config import DEFAULT_MAX_LOGPROBS
from actors.tokenizer.prompt_embeds import ENABLE_ERROR, check_hidden_size
from actors.engine.lora import LoRARequest
from actors.engine.messages import EngineCoreRequest
from actors.engine.sampling_params import SamplingParams
from actors.frontend.admission import WaitingRequests
from actors.runtime import Actor, ActorRef, Msg, Refusal
from actors.scheduler.actor import AddRequest
from actors.tokenizer.gguf_tokenizer import NO_TOKENIZER, TEXT_PROMPTS_REFUSED, TextTokenizer, TokenIdsOnly
from actors.tokenizer.multimodal import (ImageProcessor, MediaError, Processed, extract_images, images_of, modality_of,
                                         load_image)


OFF_LOOP_CHARS = 20_000          # longer prompts are tokenized in a thread


class PromptAccepted(msgspec.Struct):
    num_prompt_tokens: int
    prompt_token_ids: list[int] = []
    token_offsets: list[tuple[int, int]] | None = None    # asked for by a render (return_token_offsets)


class Generate(Msg):
    """Exactly one of ``prompt``, ``prompt_token_ids``, ``messages`` and ``prompt_embeds`` is set.
    ``arrival_time`` (time.time() when the request reached the server; 0.0 = now) starts its
    latency clocks."""
    reply_type: ClassVar[Any] = PromptAccepted
    request_id: str
    sampling_params: SamplingParams
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] = {}
    priority: int = 0
    arrival_time: float = 0.0
    add_special_tokens: bool = False       # BOS/EOS around a text prompt (or a rendered chat), as the tokenizer asks
    cache_salt: str | None = None          # mixed into the first block's hash: prefixes shared only within it
    parent_id: str = ""                    # with n > 1: the request this is one choice of (for metrics)
    n: int = 1                             # the choices of that request
    lora_request: LoRARequest | None = None   # the adapter it runs with (None: the base model)
    # with truncate_prompt_tokens: "left" keeps the last tokens, "right" the first; None: as the
    # tokenizer truncates (vLLM's default): a pooling request's first, another's last, and a text
    # prompt's own tokens cut so that the special tokens the tokenizer adds around them stay
    truncation_side: str | None = None
    chat_template: str | None = None       # the request's own template for messages (None: the model's)
    render_only: bool = False              # checked and tokenized as it would be admitted, not admitted (/render)
    return_token_offsets: bool = False     # with render_only: each token's characters in the prompt text
    chat_template_content_format: str | None = None   # how content reaches the template (None: the server's)
    prompt_embeds: np.ndarray | None = None  # vLLM's: the prompt as input embeddings, (tokens, hidden) float32
    trace_headers: dict[str, str] | None = None   # the caller's W3C trace context (for its OpenTelemetry span)
    # the offline API's images for a text or token-ids prompt ({"image": PIL image or a list}), each
    # in place of a placeholder of the prompt; a chat's come as its messages' image parts
    multi_modal_data: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None   # vLLM's: the processor's keywords for its images
    media_io_kwargs: dict[str, Any] | None = None       # vLLM's: how its videos are read ({"video": {"num_frames": 8}})


NO_REASONING_CONFIG = ("thinking_token_budget is set but reasoning_config is not configured. Please set "
                       "--reasoning-parser and/or --reasoning-config to use thinking_token_budget.")


class InvalidPrompt(ValueError, Refusal):
    """The prompt cannot be served as given (an HTTP 400)."""


class PromptTooLong(InvalidPrompt):
    """Prompt plus requested tokens exceed the model's context (context_length_exceeded)."""


TokenizerProtocol = Generate


class TokenizerActor(Actor):
    protocol = TokenizerProtocol
    concurrent = True            # stateless: requests need not queue behind each other

    def __init__(self, tokenizer: TextTokenizer | TokenIdsOnly, max_model_len: int, eos_token_ids: list[int],
                 detokenizer: ActorRef, engine: ActorRef, waiting: WaitingRequests,
                 on_prompt_tokens: Callable[[int], None] | None = None,
                 max_logprobs: int = DEFAULT_MAX_LOGPROBS, logits_size: int | None = None,
                 embeds_hidden_size: int | None = None, thinking_budgets: bool = False,
                 client_index: int = 0, pooling_len: int | None = None,
                 chunked_embed_len: int | None = None, lower_case: bool = False,
                 images: ImageProcessor | None = None) -> None:
        """``embeds_hidden_size``: with --enable-prompt-embeds, the rows prompt embeddings must have
        (None: such prompts are refused). ``thinking_budgets``: the engine has a resolved reasoning
        config (else a request's thinking_token_budget is refused). ``client_index``: this API
        server's (--api-server-count), on each request so its outputs come back here.
        ``pooling_len``: the most tokens a pooling request's prompt may have (the pooler
        config's max_embed_len where it is below max_model_len); ``chunked_embed_len``: with
        the pooler config's enable_chunked_processing, the most a pooling prompt rendered whole
        may have, to be embedded in pieces (sys.maxsize: no bound; None: no chunking).
        ``lower_case``: a pooling request's text is lower-cased before it is tokenized (a
        sentence-transformers checkpoint's ``do_lower_case``, as vLLM reads it). ``images``: a
        model that takes images, its checkpoint's processor (None: image input is refused)."""
        self.images = images
        self.lower_case = lower_case
        self.pooling_len = min(pooling_len or max_model_len, max_model_len)
        self.chunked_embed_len = chunked_embed_len
        self.client_index = client_index
        self.thinking_budgets = thinking_budgets
        self.tokenizer = tokenizer
        self.embeds_hidden_size = embeds_hidden_size
        self.max_logprobs = max_logprobs
        self.logits_size = logits_size or tokenizer.vocab_size     # the model's vocabulary: its logits
        self.waiting = waiting
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.detokenizer = detokenizer
        self.engine = engine
        self.on_prompt_tokens = on_prompt_tokens

    async def receive(self, msg: Generate) -> PromptAccepted:
        self.ctx.link((msg.request_id,))
        try:        # the server's requests were checked field by field; the offline API's come as given
            msg.sampling_params.check(self.logits_size, self.max_logprobs)
        except ValueError as exc:
            raise InvalidPrompt(str(exc)) from None
        if msg.sampling_params.thinking_token_budget is not None and not self.thinking_budgets:
            raise InvalidPrompt(NO_REASONING_CONFIG)
        if not self.tokenizer.has_text:
            self._check_token_ids_only(msg)
        truncate = msg.sampling_params.truncate_prompt_tokens
        limit = self._limit(msg)
        embeds = self._embeds(msg)
        msg, images = await self._images(msg)
        features = None
        if embeds is not None:            # placeholders for the positions the rows stand for
            ids, offsets = [0] * len(embeds), None
        else:
            chars = self._check_size(msg, limit, enforce=truncate is None)   # a truncated prompt may be long
            # a long text is tokenized in a thread (the tokenizer releases the GIL), so the
            # frontend's other requests and probes do not wait behind it
            ids = await asyncio.to_thread(self._prompt_ids, msg) if chars > OFF_LOOP_CHARS else self._prompt_ids(msg)
            offsets = self._offsets(msg, ids) if msg.render_only and msg.return_token_offsets else None
        if images:                        # each placeholder expanded into its image's positions
            assert self.images is not None
            if truncate is not None:
                raise InvalidPrompt("truncate_prompt_tokens is not supported with image, video or audio input (it "
                                    "would cut into an item's positions)")
            try:
                ids, features = self.images.expand(ids, images)
            except MediaError as exc:
                raise InvalidPrompt(str(exc)) from None
            offsets = None
        pooling = msg.sampling_params.pooling is not None     # a pooling request fills the context, no more
        if truncate is not None:          # vLLM's: the prompt's last tokens (the left side goes), or first
            keep = limit if truncate == -1 else truncate
            kept = self._truncated(msg, ids, keep, msg.truncation_side or ("right" if pooling else "left"))
            ids = [ids[i] for i in kept]
            if offsets is not None:
                offsets = [offsets[i] for i in kept]
            if embeds is not None:
                embeds = embeds[kept]
        n = len(ids)
        if n == 0:
            raise InvalidPrompt("the prompt is empty")
        if n > limit or (n == limit and not pooling):
            raise PromptTooLong(f"This model's maximum context length is {limit} tokens. "
                                f"However, your prompt has {n} tokens.")
        params = self._with_bad_word_ids(msg.sampling_params)
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len and not pooling:
            raise PromptTooLong(f"This model's maximum context length is {self.max_model_len} tokens. "
                                f"However, you requested {n + params.max_tokens} tokens ({n} in the "
                                f"prompt, {params.max_tokens} for the completion). Please reduce the "
                                f"prompt or max_tokens.")
        rows = params.prompt_logprob_token_ids
        if rows is not None:             # vLLM's check: a row per scored prompt position
            if embeds is not None:
                raise InvalidPrompt("prompt_logprob_token_ids is not compatible with prompt embeds.")
            start = params.prompt_logprob_start or 0
            if start >= n:
                raise InvalidPrompt(f"prompt_logprob_start ({start}) must be less than the prompt length ({n})")
            if len(rows) != n - 1 - start:
                raise InvalidPrompt(f"prompt_logprob_token_ids has {len(rows)} rows, but the prompt has "
                                    f"{n - 1 - start} scored rows (prompt_len - 1 - prompt_logprob_start).")
        if msg.render_only:
            if embeds is not None:
                raise InvalidPrompt("prompt_embeds cannot be rendered: they are not tokens")
            return PromptAccepted(n, ids, offsets)
        self.waiting.admit(msg.request_id, n)               # Overloaded: the queue is full
        arrival = msg.arrival_time or time.time()
        shown = [] if embeds is not None else ids           # prompt tokens a reader may see (none for embeds)
        self.detokenizer.tell(TrackRequest(msg.request_id, shown, params, arrival, msg.parent_id, msg.n,
                                           msg.trace_headers))
        self.engine.tell(AddRequest(EngineCoreRequest(
            msg.request_id, ids, params, arrival, self.eos_token_ids, msg.priority, msg.cache_salt,
            msg.lora_request, embeds, self.client_index, features)))
        if self.on_prompt_tokens is not None:
            self.on_prompt_tokens(n)
        return PromptAccepted(n, shown)

    async def _images(self, msg: Generate) -> tuple[Generate, list[Processed]]:
        """The request's images and videos read and processed (the offline API's, then its
        messages' parts, which become the chat template's image and video parts); none for a
        prompt without them. InvalidPrompt when the model takes none, or one cannot be read."""
        try:
            sources = images_of(msg.multi_modal_data)
            messages = msg.messages
            if messages is not None and self.images is not None:
                messages, found = extract_images(messages)
                sources += found
            if not sources:
                return msg, []
            if self.images is None:
                what = {"audio": "audio", "video": "videos"}.get(modality_of(sources[0]), "images")
                raise InvalidPrompt(f"this model takes no {what}: it is served on text (a multimodal checkpoint the "
                                    "transformers backend serves whole takes images)")
            if msg.prompt_embeds is not None:
                raise InvalidPrompt("prompt_embeds cannot come with images, videos or audio")
            self.images.check_count(sources)
            images = await asyncio.gather(*(load_image(source, self.images.config, msg.media_io_kwargs)
                                            for source in sources))
            processor = self.images
            kwargs = msg.mm_processor_kwargs
            items = await asyncio.to_thread(lambda: [processor.process(image, kwargs) for image in images])
        except MediaError as exc:
            raise InvalidPrompt(str(exc)) from None
        return msgspec.structs.replace(msg, messages=messages), items

    def _limit(self, msg: Generate) -> int:
        """The most tokens ``msg``'s prompt may have: the context, or a pooling prompt's bound
        (larger when it is rendered whole to be embedded in pieces)."""
        if msg.sampling_params.pooling is None:
            return self.max_model_len
        if msg.render_only and self.chunked_embed_len is not None:
            return self.chunked_embed_len
        return self.pooling_len

    def _embeds(self, msg: Generate) -> np.ndarray | None:
        """A prompt given as embeddings, checked (InvalidPrompt); None for the other prompts."""
        if msg.prompt_embeds is None:
            return None
        if self.embeds_hidden_size is None:
            raise InvalidPrompt(ENABLE_ERROR)
        rows = msg.prompt_embeds
        if rows.ndim != 2 or rows.dtype != np.float32 or len(rows) == 0:
            raise InvalidPrompt(f"prompt embeddings must be non-empty float32 rows (tokens, hidden), got "
                                f"{rows.dtype} of shape {rows.shape}")
        try:
            check_hidden_size(rows, self.embeds_hidden_size)
        except ValueError as exc:
            raise InvalidPrompt(str(exc)) from None
        if msg.sampling_params.prompt_logprobs is not None:
            raise InvalidPrompt("prompt_logprobs is not compatible with prompt embeds.")
        return rows

    @staticmethod
    def _check_token_ids_only(msg: Generate) -> None:
        """--skip-tokenizer-init: what would need text is refused, in vLLM's words where it has them."""
        if msg.messages is not None:
            raise InvalidPrompt(NO_TOKENIZER)
        if msg.prompt_token_ids is None and msg.prompt_embeds is None:
            raise InvalidPrompt(TEXT_PROMPTS_REFUSED)
        params = msg.sampling_params
        if params.stop:
            raise InvalidPrompt("stop strings are not supported with --skip-tokenizer-init (there is no text to "
                                "find them in): use stop_token_ids")
        if params.bad_words:
            raise InvalidPrompt("bad_words are not supported with --skip-tokenizer-init (there is no tokenizer to "
                                "read them with)")
        if params.structured_outputs is not None:
            raise InvalidPrompt("Structured outputs requires a tokenizer so it can't be used with "
                                "'skip_tokenizer_init'")

    def _check_size(self, msg: Generate, limit: int, enforce: bool = True) -> int:
        """The prompt's characters; PromptTooLong at once, before tokenizing, when there are
        so many that no tokenization could fit ``limit`` tokens (``enforce``; a pooling prompt may
        fill them, a generating one must leave one). The bound counts the characters other than
        whitespace, which some tokenizers drop (BERT's WordPiece): each token covers at most
        max_token_chars of them."""
        if msg.messages is not None:
            texts = [m["content"] for m in msg.messages if isinstance(m.get("content"), str)]
        else:
            texts = [msg.prompt or ""]
        chars = sum(map(len, texts))
        spaces = sum(t.count(" ") + t.count("\n") + t.count("\t") + t.count("\r") for t in texts)
        at_least = (chars - spaces) // self.tokenizer.max_token_chars
        if enforce and (at_least > limit or (at_least == limit and msg.sampling_params.pooling is None)):
            raise PromptTooLong(f"This model's maximum context length is {limit} tokens. "
                                f"However, your prompt has at least {at_least} tokens ({chars} characters).")
        return chars

    def _with_bad_word_ids(self, params: SamplingParams) -> SamplingParams:
        """Each bad word as token ids, as it reads at the start of the text and after a space
        (the two tokenizations differ in byte-level BPE); the sampler bans the last token of any
        of them whose other tokens the output ends with."""
        if not params.bad_words:
            return params
        ids = list(params.bad_words_token_ids)
        for word in params.bad_words:
            for text in (word.lstrip(), " " + word.lstrip()):
                tokens = self.tokenizer.encode(text, add_special_tokens=False)
                if tokens and tokens not in ids:
                    ids.append(tokens)
        return msgspec.structs.replace(params, bad_words_token_ids=ids)

    def _offsets(self, msg: Generate, ids: list[int]) -> list[tuple[int, int]] | None:
        """Each prompt token's characters in the text it was tokenized from (a chat's rendered
        template); None for token ids given as they are."""
        if msg.prompt_token_ids is not None:
            return None
        text = msg.prompt
        if msg.messages is not None:
            text = self.tokenizer.apply_chat_template(
                msg.messages, add_generation_prompt=msg.add_generation_prompt,
                continue_final_message=msg.continue_final_message, chat_template=msg.chat_template,
                content_format=msg.chat_template_content_format, **msg.chat_template_kwargs)
        return self.tokenizer.token_offsets(text or "", ids)

    def _truncated(self, msg: Generate, ids: list[int], keep: int, side: str) -> list[int]:
        """The positions of ``ids`` that truncation to ``keep`` tokens keeps, from ``side``. With no
        side asked for, a text prompt the tokenizer added special tokens to ([CLS] .. [SEP], BOS)
        keeps them and loses its own tokens instead, as transformers' ``truncation=True`` does
        (where vLLM leaves truncation to the tokenizer); otherwise the ids themselves are cut."""
        n = len(ids)
        if n <= keep:
            return list(range(n))
        if msg.truncation_side is None and msg.prompt is not None and msg.messages is None \
                and msg.prompt_token_ids is None and msg.add_special_tokens:
            core = self.tokenizer.encode(self._text(msg), add_special_tokens=False)
            head = next((h for h in range(n - len(core) + 1) if ids[h:h + len(core)] == core), None)
            if head is not None and len(core) < n:
                tail, room = n - head - len(core), keep - (n - len(core))
                if room > 0:
                    own = range(head, head + room) if side == "right" else range(n - tail - room, n - tail)
                    return [*range(head), *own, *range(n - tail, n)]
        return list(range(keep)) if side == "right" else list(range(n - keep, n))

    def _text(self, msg: Generate) -> str:
        """A text prompt as it is tokenized: lower-cased for a pooling request where the model's
        sentence-transformers config says ``do_lower_case``."""
        assert msg.prompt is not None
        return msg.prompt.lower() if self.lower_case and msg.sampling_params.pooling is not None else msg.prompt

    def _prompt_ids(self, msg: Generate) -> list[int]:
        if msg.messages is not None:
            try:
                return self.tokenizer.encode_chat(
                    msg.messages, add_generation_prompt=msg.add_generation_prompt,
                    continue_final_message=msg.continue_final_message, chat_template=msg.chat_template,
                    add_special_tokens=msg.add_special_tokens, content_format=msg.chat_template_content_format,
                    **msg.chat_template_kwargs)
            except Exception as exc:   # template errors (raise_exception, bad kwargs) are the input's
                raise InvalidPrompt(f"could not render the chat template: {exc}") from exc
        if msg.prompt_token_ids is not None:
            vocab = self.tokenizer.vocab_size
            bad = [t for t in msg.prompt_token_ids if not 0 <= t < vocab]
            if bad:
                raise InvalidPrompt(f"token ids out of range [0, {vocab}): {bad[:5]}")
            return list(msg.prompt_token_ids)
        if msg.prompt is not None:
            try:
                return self.tokenizer.encode(self._text(msg), add_special_tokens=msg.add_special_tokens)
            except Exception as exc:   # e.g. text that is not valid Unicode (lone surrogates)
                raise InvalidPrompt(f"could not tokenize the prompt: {exc}") from exc
        raise InvalidPrompt("one of prompt, prompt_token_ids or messages is required")
