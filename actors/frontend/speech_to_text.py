"""POST /v1/audio/transcriptions and /v1/audio/translations: OpenAI's audio API as vLLM serves it,
for a model that takes audio and whose checkpoint's processor says how to ask for speech to text
(``SPEECH_TO_TEXT`` in actors/tokenizer/audio.py: Qwen2-Audio's).

The request is multipart/form-data with the audio ``file`` (any format libsndfile reads, at most
VLLM_MAX_AUDIO_CLIP_FILESIZE_MB) and vLLM's fields: ``model``, ``language`` (ISO 639-1, checked
against Whisper's table; one the model does not natively take is served with a warning, as in
vLLM), ``to_language`` (a translation's, English by default), ``response_format`` (``json``,
``text``), ``temperature`` (0 by default), ``top_p``, ``top_k``, ``min_p``, ``seed``, the penalties,
``max_completion_tokens``, ``stream`` with ``stream_include_usage`` and
``stream_continuous_usage_stats``. The clip is decoded and brought to the feature extractor's
rate; one longer than the model hears at once (Qwen2-Audio: its 30-second window; GLM-ASR: its
processor's bound, 655 s) is cut at its quietest moments into pieces of at
most that (vLLM's chunking), each asked about with the model's instruction (the chat template's
user turn of the audio and the instruction) and all generated at once; their texts are joined
with a space (none for languages written without). The answer: ``{"text", "usage": {"type":
"duration", "seconds"}}`` (a translation's ``{"text"}``), the text alone with ``text``, or SSE
chunks ``transcription.chunk`` / ``translation.chunk`` (``choices[0].delta.content``) then
``data: [DONE]``."""
from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from typing import TYPE_CHECKING, Any, AsyncIterator

from aiohttp import web

from actors.engine import vllm_env
from actors.engine.sampling_params import SamplingParams
from actors.frontend import sse
from actors.frontend.errors import bad_request, error_body, error_response, json_encoder, not_found
from actors.frontend.fanout import Choice, close_all, merged_outputs
from actors.frontend.params import served_name
from actors.frontend.streams import StreamTimeout
from actors.tokenizer.audio import (AUDIO, AUDIO_PART, SPEECH_TO_TEXT, AudioError, SpeechToText, decode_audio,
                                    resample, split_speech)
from actors.tokenizer.multimodal import MediaError, read_url

if TYPE_CHECKING:
    from actors.frontend.app import OpenAIServer

log = logging.getLogger("troupe.http")

TRANSCRIPTIONS, TRANSLATIONS = "/v1/audio/transcriptions", "/v1/audio/translations"
FORMATS = ("json", "text")
_FLOATS = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty")
_INTS = ("top_k", "seed", "max_completion_tokens")
_FLAGS = ("stream", "stream_include_usage", "stream_continuous_usage_stats")
_TEXTS = ("model", "language", "to_language", "prompt", "response_format", "hotwords")


def _languages() -> dict[str, str]:
    """ISO 639-1 code -> language name: Whisper's table, which vLLM checks a request's against."""
    from transformers.models.whisper.tokenization_whisper import LANGUAGES
    return LANGUAGES


async def _form(request: web.Request) -> tuple[bytes, dict[str, str]]:
    """The multipart form: the file's bytes (within VLLM_MAX_AUDIO_CLIP_FILESIZE_MB) and the
    other fields, as text."""
    if not request.content_type.startswith("multipart/"):
        raise bad_request("the request must be multipart/form-data, with the audio as its `file` field", "file")
    limit = vllm_env.audio_limits()[0]
    data: bytes | None = None
    fields: dict[str, str] = {}
    reader = await request.multipart()
    async for part in reader:
        name = part.name or ""
        if name == "file":
            chunks, size = [], 0
            while chunk := await part.read_chunk(1 << 16):
                size += len(chunk)
                if size > limit:
                    raise bad_request("Maximum file size exceeded", "audio_filesize_mb")
                chunks.append(chunk)
            data = b"".join(chunks)
            continue
        value = (await part.read(decode=True)).decode("utf-8", "replace")
        fields[name.removesuffix("[]")] = value
    if data is None:
        raise bad_request("the audio `file` field is required", "file")
    return data, fields


def typed(fields: dict[str, Any], where: str) -> dict[str, Any]:
    """A request's fields (a form's text, or a batch line's JSON values) typed as vLLM's request
    types them (400 naming one that is not); a field it does not know is logged and ignored."""
    out: dict[str, Any] = {}
    for name, given in fields.items():
        value = str(given).lower() if isinstance(given, bool) else str(given)
        try:
            if name in _FLOATS:
                out[name] = float(value)
            elif name in _INTS:
                out[name] = int(value)
            elif name in _FLAGS:
                if value.lower() not in ("true", "false", "1", "0"):
                    raise ValueError
                out[name] = value.lower() in ("true", "1")
            elif name in _TEXTS:
                out[name] = value
            else:
                log.warning("%s: the field %r is not supported and is ignored", where, name)
        except ValueError:
            kind = "a number" if name in _FLOATS else "an integer" if name in _INTS else "true or false"
            raise bad_request(f"`{name}` must be {kind}, got {value!r}", name) from None
    return out


def _sampling(fields: dict[str, Any]) -> SamplingParams:
    """vLLM's sampling fields of a transcription (its defaults: greedy, to the end of the context;
    the tokenizer checks them as it checks any request's)."""
    return SamplingParams(max_tokens=fields.get("max_completion_tokens"), temperature=fields.get("temperature", 0.0),
                          top_p=fields.get("top_p", 1.0), top_k=fields.get("top_k", 0) or 0,
                          min_p=fields.get("min_p", 0.0), seed=fields.get("seed"),
                          frequency_penalty=fields.get("frequency_penalty", 0.0),
                          presence_penalty=fields.get("presence_penalty", 0.0),
                          repetition_penalty=fields.get("repetition_penalty", 1.0))


def _instruction(rule: SpeechToText, task: str, fields: dict[str, Any]) -> str:
    """The instruction for ``task``, the request's languages checked (vLLM's rule: a code
    Whisper's table lacks is a 400; one the model does not natively take, a warning)."""
    names = _languages()
    for field in ("language", "to_language"):
        code = fields.get(field)
        if code is None:
            continue
        if code not in names:
            raise bad_request(f"Unsupported language: {code!r}.  Must be one of {list(rule.languages or names)}.", field)
        if rule.languages is not None and code not in rule.languages:
            log.warning("Language %r is not natively supported by the model; results may be less accurate. "
                        "Supported languages: %r", code, list(rule.languages))
    if task == "translate":
        return rule.translate.format(to=names[fields.get("to_language") or "en"].title())
    language = fields.get("language")
    return rule.transcribe_in.format(language=names[language].title()) if language else rule.transcribe


async def transcriptions(server: OpenAIServer, request: web.Request) -> web.StreamResponse:
    return await _speech_to_text(server, request, "transcribe")


async def translations(server: OpenAIServer, request: web.Request) -> web.StreamResponse:
    return await _speech_to_text(server, request, "translate")


def _rule(server: OpenAIServer, task: str) -> SpeechToText:
    """How the served model turns speech into text; 404 in vLLM's words for one that does not."""
    processor = server.engine().images
    rule = SPEECH_TO_TEXT.get(processor.name) if processor is not None and processor.takes(AUDIO) else None
    if rule is None:
        raise not_found(f"The model does not support {'Transcriptions' if task == 'transcribe' else 'Translations'} API")
    return rule


async def _speech_to_text(server: OpenAIServer, request: web.Request, task: str) -> web.StreamResponse:
    _rule(server, task)
    audio, fields = await _form(request)
    return await speech_answer(server, task, audio, typed(fields, request.path), request)


async def batch_speech(server: OpenAIServer, path: str, body: dict[str, Any]) -> web.StreamResponse:
    """A batch line's transcription or translation (vLLM's run_batch): the audio at the body's
    ``file_url`` (a data, http(s) or file URL, read as chat media URLs are), the other fields as
    the form's."""
    task = "transcribe" if path == TRANSCRIPTIONS else "translate"
    processor = server.engine().images
    _rule(server, task)
    if "file" in body:
        raise bad_request("The 'file' field is not supported in batch requests. Use 'file_url' instead.", "file")
    url = body.get("file_url")
    if not isinstance(url, str) or not url:
        raise bad_request("a batch line's audio is its `file_url`: a data, http(s) or file URL", "file_url")
    try:
        audio = await read_url(url, processor.config, AUDIO, vllm_env.audio_limits()[0])
    except MediaError as exc:
        raise bad_request(f"Failed to process {'transcription' if task == 'transcribe' else 'translation'}: {exc}",
                          "file_url") from None
    fields = typed({k: v for k, v in body.items() if k not in ("file_url", "stream", "stream_include_usage",
                                                                  "stream_continuous_usage_stats")}, path)
    if fields.get("response_format") == "text":       # a batch's answers are JSON (vLLM's run_batch's too)
        fields["response_format"] = "json"
    return await speech_answer(server, task, audio, fields)


async def speech_answer(server: OpenAIServer, task: str, audio: bytes, fields: dict[str, Any],
                        request: web.Request | None = None) -> web.StreamResponse:
    """The answer to ``task`` ("transcribe" or "translate") of ``audio`` (a file's bytes) with the
    typed ``fields``; streamed to ``request`` where the fields ask."""
    arrival = time.time()
    client = server.engine()
    processor = client.images
    rule = _rule(server, task)
    if fields.get("model") is not None and fields["model"] not in client.model_names \
            and fields["model"] not in client.lora_requests:
        raise not_found(f"The model `{fields['model']}` does not exist.", "model")
    fmt = fields.get("response_format", "json")
    if fmt not in FORMATS:
        raise bad_request("Currently only support response_format `text` or `json`", "response_format")
    stream = fields.get("stream", False)
    if not stream and (fields.get("stream_include_usage") or fields.get("stream_continuous_usage_stats")):
        raise bad_request("Stream options can only be defined when `stream=True`.", "stream_include_usage")
    params = _sampling(fields)
    instruction = _instruction(rule, task, fields)
    limits = vllm_env.audio_limits()
    try:
        clip = await asyncio.to_thread(decode_audio, audio, limits[1], limits[2])
    except AudioError as exc:
        raise bad_request(str(exc), "file") from None
    rate = processor.sampling_rate
    samples = await asyncio.to_thread(resample, clip.samples, clip.sampling_rate, rate)
    duration = len(clip.samples) / clip.sampling_rate
    pieces = await asyncio.to_thread(split_speech, samples, rate, processor.audio_window_s)
    templated = bool(getattr(client.tokenizer, "chat_template", None))
    base = (request.headers.get("X-Request-Id") if request is not None else None) or uuid.uuid4().hex
    answer_id = f"{'trsc' if task == 'transcribe' else 'trsl'}-{base}"
    rid = client.new_request_id()
    choices: list[Choice] = []
    try:
        for i, (_, piece) in enumerate(pieces):
            what: dict[str, Any] = {"multi_modal_data": {AUDIO: [(piece, rate)]}}
            if templated and rule.inline:
                what["messages"] = [{"role": "user", "content": processor.audio_placeholder + instruction}]
            elif templated:
                what["messages"] = [{"role": "user", "content": [AUDIO_PART, {"type": "text", "text": instruction}]}]
            else:
                what["prompt"] = processor.prompt_audio_placeholder + instruction
            handle = await server.submit(params, request_id=rid if len(pieces) == 1 else f"{rid}-{i}",
                                         arrival_time=arrival, lora_request=client.lora_request_for(fields.get("model")),
                                         **what)
            choices.append(Choice(i, i, handle))
    except BaseException:
        close_all(choices)
        raise
    separator = "" if (fields.get("language") or "") in rule.no_space else " "
    model = served_name(client, fields.get("model"))
    if stream and request is not None:
        events = _stream(choices, answer_id, model, task, separator, fields)
        return await sse.send_events(request, events, base)
    try:
        async for c, out in merged_outputs(choices):
            c.take(out)
            c.text.append(out.text)
    except StreamTimeout as exc:
        return error_response(504, str(exc))
    finally:
        close_all(choices)
    for c in choices:
        if c.last is None or c.last.error is not None:
            return error_response(c.last.error_status if c.last is not None and c.last.error_status else 500,
                                  f"the audio could not be {'transcribed' if task == 'transcribe' else 'translated'}: "
                                  f"{c.last.error if c.last is not None else 'it ended without output'}")
    text = separator.join("".join(c.text).strip() for c in choices)
    headers = {"X-Request-Id": base}
    if fmt == "text":
        return web.Response(text=text, content_type="text/plain", headers=headers)
    body: dict[str, Any] = {"text": text}
    if task == "transcribe":
        body["usage"] = {"type": "duration", "seconds": int(math.ceil(duration))}
    return web.Response(body=json_encoder.encode(body), content_type="application/json", headers=headers)


async def _stream(choices: list[Choice], answer_id: str, model: str, task: str, separator: str,
                  fields: dict[str, Any]) -> AsyncIterator[dict]:
    """vLLM's chunks: each piece's text as it comes (a piece after the first starts with the
    separator), its finish reason on its last; with stream_include_usage a usage chunk last."""
    created = int(time.time())
    kind = "transcription.chunk" if task == "transcribe" else "translation.chunk"
    usage_on = fields.get("stream_include_usage", False)
    continuous = usage_on and fields.get("stream_continuous_usage_stats", False)
    prompt_tokens = completion_tokens = 0

    def usage() -> dict[str, int]:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}
    try:
        for c in choices:
            prompt_tokens += c.handle.num_prompt_tokens
            started = False
            async for out in c.handle:
                if out.error is not None:
                    yield error_body(out.error, code=out.error_status or 500)
                    return
                completion_tokens += len(out.token_ids)
                text = out.text
                if c.index and not started and text:
                    text, started = separator + text, True
                if not out.finished and not text:
                    continue
                choice: dict[str, Any] = {"delta": {"content": text}}
                if out.finished:
                    choice.update(finish_reason=out.finish_reason, stop_reason=out.stop_reason)
                chunk = {"id": answer_id, "object": kind, "created": created, "model": model, "choices": [choice]}
                if continuous:
                    chunk["usage"] = usage()
                yield chunk
        if usage_on:
            yield {"id": answer_id, "object": kind, "created": created, "model": model, "choices": [],
                   "usage": usage()}
    finally:
        close_all(choices)
