"""Audio input, as vLLM takes it, on a tiny random Qwen2-Audio checkpoint (an audio tower, a
projector, a Qwen2: Troupe's own class, the tower and projector built by transformers) saved with
its processor by transformers: offline (``multi_modal_data={"audio": ...}``, ``input_audio`` chat
parts) and over HTTP (``input_audio`` parts, ``audio_url`` parts as data, http and file URLs), the
greedy tokens are those of transformers' own ``generate`` over the same clips (brought to the
feature extractor's 16 kHz first), in prefill chunks that split a clip; the prefix cache serves a
clip's blocks to the same clip only; unreadable, overlong and surplus clips are refused by name."""
from __future__ import annotations

import base64
import io
import json
import urllib.error
import urllib.request
import uuid

import openai
import pytest

from helpers import audio_file, http_folder, save_tiny_qwen2_audio, tone
from server import Server

pytestmark = pytest.mark.slow

CLIP = "<|audio_bos|><|AUDIO|><|audio_eos|>"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def qwen2_audio(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2_audio")
    hf, processor = save_tiny_qwen2_audio(path)
    return str(path), hf, processor


def hf_answer(qwen2_audio, text: str, clips: list) -> list[int]:
    """transformers' greedy tokens for ``text`` (one CLIP per clip) with ``clips`` at 16 kHz."""
    import torch
    _, hf, processor = qwen2_audio
    inputs = processor(text=text, audio=clips, sampling_rate=16000, return_tensors="pt")
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def tower_rows(qwen2_audio, clip):
    """The rows transformers' Qwen2-Audio puts at a clip's positions (its projector's outputs
    over the clip's own frames), as vLLM's audio_embeds take them."""
    import torch
    _, hf, processor = qwen2_audio
    inputs = processor(text=CLIP, audio=[clip], sampling_rate=16000, return_tensors="pt")
    seen = []
    hook = hf.model.multi_modal_projector.register_forward_hook(lambda module, args, out: seen.append(out))
    try:
        with torch.no_grad():
            hf(**inputs)
    finally:
        hook.remove()
    positions = int((inputs["input_ids"] == hf.config.audio_token_id).sum())
    return seen[0][0, :positions].float()


def test_the_towers_rows_over_a_clips_own_positions_are_transformers_over_the_padded_window(qwen2_audio):
    """Troupe's Qwen2-Audio runs the encoder over the clip's own positions alone; transformers
    runs it over the whole window with the padding masked out: the rows agree, for a short clip,
    odd and even frame counts, and one that fills the window."""
    import torch

    from models.registry import load_model
    from models.resolve import resolve_model
    path, _, processor = qwen2_audio
    model, _ = load_model(resolve_model(path))
    for seconds in (0.05, 0.3, 1.31, 2.0):
        clip = tone(seconds)
        inputs = processor(text=CLIP, audio=[clip], sampling_rate=16000, return_tensors="np")
        with torch.no_grad():
            got = model.embed_multimodal("audio", {k: inputs[k] for k in ("input_features", "feature_attention_mask")})
        torch.testing.assert_close(got, tower_rows(qwen2_audio, clip), atol=1e-5, rtol=1e-5)


def greedy():
    from actors.api import SamplingParams
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0)


def test_clips_answer_as_transformers_qwen2_audio_does_in_prefill_chunks_that_split_them(qwen2_audio):
    """Clips given as (samples, rate) pairs (one at 8 kHz, resampled to 16 kHz), as samples
    alone (taken at 16 kHz) and as a chat's input_audio part (a WAV file) answer as transformers
    does; a clip's 32 positions are computed in chunks of 16 prompt tokens; the prefix cache
    serves the clip's blocks again to the same clip, to no other; placeholders and clips must pair
    up, within --limit-mm-per-prompt, and images are refused by name; with --enable-mm-embeds the
    clip's embeddings (vLLM's (clips, positions, hidden) tensor) answer as the clip does."""
    from actors.api import LLM
    from actors.tokenizer.audio import resample
    from helpers import random_image
    a, b8 = tone(1.3), tone(0.9, 8000, period=3.0, seed=1)
    one = f"t5 t9 {CLIP} " + " ".join(f"t{i}" for i in range(20, 40))
    two = f"t5 {CLIP} t6 {CLIP} t7"
    want_one = hf_answer(qwen2_audio, one, [a])
    want_two = hf_answer(qwen2_audio, two, [a, resample(b8, 8000, 16000)])
    assert want_one != hf_answer(qwen2_audio, one, [tone(1.3, seed=5)])
    with LLM(model=qwen2_audio[0], max_model_len=256, max_num_batched_tokens=16,
             limit_mm_per_prompt={"audio": 2}, enable_mm_embeds=True) as llm:
        got = llm.generate([{"prompt": one, "multi_modal_data": {"audio": (a, 16000)}},
                            {"prompt": two, "multi_modal_data": {"audio": [(a, 16000), (b8, 8000)]}}], greedy())
        assert [list(r.outputs[0].token_ids) for r in got] == [want_one, want_two]
        assert len(got[0].prompt_token_ids) == 2 + 34 + 20      # bos, 32 audio positions, eos
        again = llm.generate({"prompt": one, "multi_modal_data": {"audio": a}}, greedy())[0]
        assert list(again.outputs[0].token_ids) == want_one and again.num_cached_tokens == 48
        other = llm.generate({"prompt": one, "multi_modal_data": {"audio": tone(1.3, seed=5)}}, greedy())[0]
        assert other.num_cached_tokens == 0      # the same text, another clip: no block past the clip shared
        wav = base64.b64encode(audio_file(a)).decode()
        messages = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}},
                                                 {"type": "text", "text": "t7"}]}]
        assert list(llm.chat(messages, greedy())[0].outputs[0].token_ids) == hf_answer(
            qwen2_audio, f"t1 {CLIP} t7 t3", [a])
        rows = tower_rows(qwen2_audio, a)
        given = llm.generate({"prompt": one, "multi_modal_data": {"audio": rows[None]}}, greedy())[0]
        assert list(given.outputs[0].token_ids) == want_one and len(given.prompt_token_ids) == 56
        with pytest.raises(ValueError, match="`audio_embeds` hidden_size 32 does not match the model's hidden_size 64"):
            llm.generate({"prompt": one, "multi_modal_data": {"audio": [rows[:, :32]]}}, greedy())
        with pytest.raises(ValueError, match=r"the prompt has 1 audio placeholders \('<\|AUDIO\|>'\) for 2 audios"):
            llm.generate({"prompt": one, "multi_modal_data": {"audio": [a, a]}}, greedy())
        with pytest.raises(ValueError, match=r"At most 2 audio\(s\) may be provided in one prompt"):
            llm.generate({"prompt": one, "multi_modal_data": {"audio": [a, a, a]}}, greedy())
        with pytest.raises(ValueError, match=r"this model takes no images \(Qwen2AudioProcessor takes audio\)"):
            llm.generate({"prompt": one, "multi_modal_data": {"image": random_image(1)}}, greedy())


# -- over HTTP ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """A folder of audio files (a 16 kHz WAV, a 22.05 kHz stereo FLAC, a 44.1 kHz MP3, text that
    is no audio, a WAV longer than the server allows), served over HTTP on 127.0.0.1 too."""
    import numpy as np
    root = tmp_path_factory.mktemp("audio")
    (root / "a.wav").write_bytes(audio_file(tone(1.3)))
    left, right = tone(1.0, 22050, seed=2), tone(1.0, 22050, period=11.0, seed=3)
    (root / "b.flac").write_bytes(audio_file(np.stack([left, right], axis=1), 22050, "FLAC"))
    (root / "c.mp3").write_bytes(audio_file(tone(0.8, 44100, seed=4), 44100, "MP3"))
    (root / "notes.txt").write_text("not audio")
    (root / "long.wav").write_bytes(audio_file(tone(5.5)))
    with http_folder(root) as base:
        yield root, base


@pytest.fixture(scope="module")
def server(qwen2_audio, media):
    s = Server("--model", qwen2_audio[0], "--threads", "1", "--max-model-len", "256", "--allowed-local-media-path",
               str(media[0]), "--enable-mm-embeds", env={"VLLM_MAX_AUDIO_DECODE_DURATION_S": "5"})
    try:
        yield s
    finally:
        s.stop()


def post(server, body: dict, path: str = "/v1/chat/completions") -> tuple[int, dict]:
    req = urllib.request.Request(server.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read().decode())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode())


def chat(server, part: dict, text: str = "t5 t6") -> tuple[int, dict]:
    return post(server, {"messages": [{"role": "user", "content": [part, {"type": "text", "text": text}]}],
                         "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True})


def clip_of(path, rate: int = 16000):
    """A file's clip as the server reads it (channels averaged), brought to 16 kHz."""
    import soundfile

    from actors.tokenizer.audio import resample
    samples, native = soundfile.read(str(path), dtype="float32", always_2d=True)
    return resample(samples.mean(axis=1), native, rate)


def test_chat_takes_input_audio_audio_urls_as_data_http_or_allowed_files_and_audio_embeds(server, media,
                                                                                           qwen2_audio):
    import torch
    root, base = media
    want = hf_answer(qwen2_audio, f"t1 {CLIP} t5 t6 t3", [clip_of(root / "a.wav")])
    data = base64.b64encode((root / "a.wav").read_bytes()).decode()
    for part in ({"type": "input_audio", "input_audio": {"data": data, "format": "wav"}},
                 {"type": "audio_url", "audio_url": {"url": f"data:audio/wav;base64,{data}"}},
                 {"type": "audio_url", "audio_url": {"url": f"{base}/a.wav"}},
                 {"type": "audio_url", "audio_url": {"url": f"file://{root / 'a.wav'}"}}):
        status, body = chat(server, part)
        assert status == 200, body
        assert body["choices"][0]["token_ids"] == want, part["type"]
    buf = io.BytesIO()
    torch.save(tower_rows(qwen2_audio, clip_of(root / "a.wav")), buf)
    status, body = chat(server, {"type": "audio_embeds", "audio_embeds": base64.b64encode(buf.getvalue()).decode()})
    assert status == 200 and body["choices"][0]["token_ids"] == want, body
    for name in ("b.flac", "c.mp3"):          # other rates and formats, a stereo file's channels averaged
        status, body = chat(server, {"type": "audio_url", "audio_url": {"url": f"{base}/{name}"}})
        assert status == 200, body
        assert body["choices"][0]["token_ids"] == hf_answer(qwen2_audio, f"t1 {CLIP} t5 t6 t3",
                                                            [clip_of(root / name)]), name


def test_audio_that_cannot_or_may_not_be_read_is_a_400_saying_why(server, media):
    root, base = media
    cases = [({"type": "input_audio", "input_audio": {"data": "not base64!", "format": "wav"}},
              "input_audio's data is not valid base64"),
             ({"type": "input_audio", "input_audio": {"data": base64.b64encode(b"RIFF....").decode()}},
              "Invalid or unsupported audio file"),
             ({"type": "audio_url", "audio_url": {"url": f"{base}/notes.txt"}}, "Invalid or unsupported audio file"),
             ({"type": "audio_url", "audio_url": {"url": f"{base}/long.wav"}},
              "Audio exceeds maximum allowed duration of 5s (file contains 5.5s at 16000Hz)"),
             ({"type": "audio_url", "audio_url": {"url": "file:///etc/hostname"}}, "must be a subpath of"),
             ({"type": "audio_url", "audio_url": {"url": ""}}, "an audio_url part needs a non-empty url"),
             ({"type": "image_url", "image_url": {"url": f"{base}/a.wav"}},
              "this model takes no images (Qwen2AudioProcessor takes audio)")]
    for part, reason in cases:
        status, body = chat(server, part)
        assert status == 400 and reason in body["error"]["message"], (part, body)


# -- /v1/audio/transcriptions and /v1/audio/translations ------------------------------------------

def form(fields: dict, file: bytes | None, name: str = "clip.wav") -> tuple[bytes, str]:
    """A multipart/form-data body (and its content type) of ``fields`` and the audio ``file``."""
    boundary = uuid.uuid4().hex
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
             for k, v in fields.items()]
    if file is not None:
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{name}"\r\n'
                     "Content-Type: application/octet-stream\r\n\r\n".encode() + file + b"\r\n")
    return b"".join(parts) + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def speech(server, path: str, fields: dict, file: bytes | None) -> tuple[int, str, str]:
    """POST the form to ``path``: (status, content type, body text)."""
    body, kind = form(fields, file)
    req = urllib.request.Request(server.url + path, body, {"Content-Type": kind})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.headers.get_content_type(), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get_content_type(), e.read().decode()


def asked(server, clip_bytes: bytes, instruction: str) -> str:
    """The chat endpoint's greedy answer to the audio and ``instruction``, to the end of the context."""
    audio = {"type": "input_audio", "input_audio": {"data": base64.b64encode(clip_bytes).decode(), "format": "wav"}}
    status, body = post(server, {"messages": [{"role": "user", "content": [audio, {"type": "text", "text": instruction}]}],
                                 "temperature": 0})
    assert status == 200, body
    return body["choices"][0]["message"]["content"].strip()


def test_transcriptions_and_translations_answer_as_chat_does_with_the_instruction(server, media):
    """The audio API's answer is the chat endpoint's to the user turn of the clip and the model's
    instruction (greedy, to the end of the context): json with the clip's duration, or the text
    alone; streamed, its deltas make the same text, then a usage chunk; translations name the
    target language (English unless to_language says)."""
    root, _ = media
    wav = (root / "a.wav").read_bytes()
    want = asked(server, wav, "Please transcribe this audio into text.")
    status, kind, body = speech(server, "/v1/audio/transcriptions", {"model": "qwen2_audio"}, wav)
    assert status == 404 and "The model `qwen2_audio` does not exist" in body
    status, kind, body = speech(server, "/v1/audio/transcriptions", {}, wav)
    assert status == 200 and kind == "application/json", body
    assert json.loads(body) == {"text": want, "usage": {"type": "duration", "seconds": 2}}
    assert speech(server, "/v1/audio/transcriptions", {"response_format": "text"}, wav)[1:] == ("text/plain", want)
    sdk = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = sdk.models.list().data[0].id
    assert sdk.audio.transcriptions.create(model=model, file=("a.wav", wav)).text == want
    assert sdk.audio.transcriptions.create(model=model, file=("a.wav", wav), response_format="text").strip() == want
    french = speech(server, "/v1/audio/transcriptions", {"language": "fr"}, wav)[2]
    assert json.loads(french)["text"] == asked(server, wav, "Please transcribe this French audio into text.")
    status, _, body = speech(server, "/v1/audio/transcriptions", {"stream": "true", "stream_include_usage": "true"},
                             wav)
    chunks = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]
    assert body.rstrip().endswith("data: [DONE]") and chunks[0]["object"] == "transcription.chunk"
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks if c["choices"]).strip() == want
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    status, _, body = speech(server, "/v1/audio/translations", {}, wav)
    assert status == 200 and json.loads(body) == {"text": asked(server, wav, "Please translate this audio into English.")}
    status, _, body = speech(server, "/v1/audio/translations", {"to_language": "de"}, wav)
    assert json.loads(body) == {"text": asked(server, wav, "Please translate this audio into German.")}


def test_a_clip_longer_than_the_window_is_transcribed_in_pieces_cut_where_it_is_quiet(server):
    """The tiny model hears 2 s at once: a 4.5-second clip with quiet moments near 1.5 s and 3.3 s
    is cut there (vLLM's chunking: the quietest 0.1 s in the last second before the window's end),
    and the answer is the pieces' answers joined by a space."""
    import numpy as np

    from actors.tokenizer.audio import split_speech
    samples = tone(4.5, seed=9)
    samples[24000:25600] *= 0.01
    samples[52800:54400] *= 0.01
    pieces = split_speech(samples, 16000, 2.0)
    assert [start for start, _ in pieces] == [0, 24000, 52800]
    want = " ".join(asked(server, audio_file(piece), "Please transcribe this audio into text.") for _, piece in pieces)
    status, _, body = speech(server, "/v1/audio/transcriptions", {}, audio_file(samples))
    assert status == 200 and json.loads(body) == {"text": want, "usage": {"type": "duration", "seconds": 5}}
    assert np.concatenate([piece for _, piece in pieces]).shape == samples.shape


def test_the_audio_api_refuses_what_it_cannot_serve_by_name(server, media):
    root, _ = media
    wav = (root / "a.wav").read_bytes()
    cases = [({"language": "xx"}, wav, "Unsupported language: 'xx'"),
             ({"response_format": "srt"}, wav, "Currently only support response_format `text` or `json`"),
             ({"temperature": "warm"}, wav, "`temperature` must be a number"),
             ({"stream_include_usage": "true"}, wav, "Stream options can only be defined when `stream=True`."),
             ({}, b"not audio at all", "Invalid or unsupported audio file"),
             ({}, None, "the audio `file` field is required")]
    for fields, file, reason in cases:
        status, _, body = speech(server, "/v1/audio/transcriptions", fields, file)
        assert status == 400 and reason in json.loads(body)["error"]["message"], (fields, body)
    status, body = post(server, {"file": "clip.wav"}, path="/v1/audio/transcriptions")
    assert status == 400 and "multipart/form-data" in body["error"]["message"]


def test_the_batch_runner_transcribes_and_translates_audio_named_by_file_url(server, media, qwen2_audio, tmp_path):
    """vLLM's run_batch lines for the audio API: the audio by ``file_url`` (a data URL, an http URL),
    answered as the server answers the same clip; a line with a ``file`` field is refused by name."""
    import subprocess
    import sys
    root, base = media
    wav = (root / "a.wav").read_bytes()
    data = "data:audio/wav;base64," + base64.b64encode(wav).decode()
    lines = [{"custom_id": "a", "method": "POST", "url": "/v1/audio/transcriptions", "body": {"file_url": data}},
             {"custom_id": "b", "method": "POST", "url": "/v1/audio/translations",
              "body": {"file_url": f"{base}/a.wav", "to_language": "de", "response_format": "text"}},
             {"custom_id": "c", "method": "POST", "url": "/v1/audio/transcriptions", "body": {"file": "a.wav"}}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    done = subprocess.run([sys.executable, "-m", "tools.batch", "--no-progress", "-i", str(tmp_path / "in.jsonl"),
                           "-o", str(tmp_path / "out.jsonl"), "--model", qwen2_audio[0], "--max-model-len", "256",
                           "--threads", "1"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    got = {r["custom_id"]: r["response"] for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    assert got["a"]["status_code"] == 200
    assert got["a"]["body"] == json.loads(speech(server, "/v1/audio/transcriptions", {}, wav)[2])
    assert got["b"]["body"] == json.loads(speech(server, "/v1/audio/translations", {"to_language": "de"}, wav)[2])
    assert got["c"]["status_code"] == 400 and "Use 'file_url' instead" in got["c"]["body"]["error"]["message"]


# -- GLM-ASR ----------------------------------------------------------------------------------------

GLM_CLIP = "<|begin_of_audio|><|pad|><|end_of_audio|>"


def test_glm_asrs_clips_answer_as_transformers_does_window_by_window_and_transcribe_as_vllm_asks(tmp_path):
    """GLM-ASR (Troupe's Llama, transformers' rotary encoder and projector; the checkpoint's unused
    position table left unread, as vLLM leaves it): a clip cut into the processor's windows (2 s here; 3.3 s: a whole window and 1.3 s of the next) answers as
    transformers' generate does, in prefill chunks of 16; its transcription asks vLLM's prompt
    (the user turn "<|pad|>can you transcribe the speech into a written format?")."""
    import torch

    from actors.api import LLM
    from helpers import save_tiny_glmasr
    from safetensors.torch import load_file, save_file
    hf, processor = save_tiny_glmasr(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")       # the hub's files carry a position table the
    tensors["audio_tower.embed_positions.weight"] = torch.zeros(100, 32)    # rotary encoder does not read
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    a, b = tone(3.3, seed=3), tone(1.2, seed=4)
    prompt = f"t5 t9 {GLM_CLIP} t7 t8"

    def want(clip) -> list[int]:
        inputs = processor(text=prompt, audio=[clip], sampling_rate=16000, return_tensors="pt")
        with torch.no_grad():
            out = hf.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
        return out[0, inputs["input_ids"].shape[1]:].tolist()
    asked = "t1 <|pad|>can you transcribe the speech into a written format? t3"    # the template's render
    with LLM(model=str(tmp_path), max_model_len=256, max_num_batched_tokens=16) as llm:
        got = llm.generate([{"prompt": prompt, "multi_modal_data": {"audio": clip}} for clip in (a, b)], greedy())
        assert [list(r.outputs[0].token_ids) for r in got] == [want(a), want(b)]
        assert [len(r.prompt_token_ids) for r in got] == [6 + 25 + 16, 6 + 15]
        from actors.api import SamplingParams
        transcribed = llm.generate({"prompt": asked, "multi_modal_data": {"audio": a}},
                                   SamplingParams(max_tokens=None, temperature=0))[0].outputs[0].text.strip()
    s = Server("--model", str(tmp_path), "--threads", "1", "--max-model-len", "256")
    try:
        status, _, text = speech(s, "/v1/audio/transcriptions", {"response_format": "text"},
                                 audio_file(a, subtype="FLOAT"))         # the samples exactly
        assert status == 200 and text == transcribed
    finally:
        s.stop()


def test_audio_flamingo_3s_clips_answer_as_transformers_does_over_its_masked_windows(tmp_path):
    """Audio Flamingo 3 (Troupe's Qwen2, transformers' Whisper encoder and projector): a clip cut
    into the processor's windows (2 s here) answers as transformers' generate does, the encoder
    run over each window's own positions where transformers masks the padding; the rows agree."""
    import torch

    from actors.api import LLM
    from helpers import save_tiny_audioflamingo3
    from models.registry import load_model
    from models.resolve import resolve_model
    hf, processor = save_tiny_audioflamingo3(tmp_path)
    a, b = tone(3.3, seed=5), tone(0.7, seed=6)
    prompt = "t5 t9 <sound> t7 t8"

    def inputs(clip):
        return processor(text=prompt, audio=[clip], sampling_rate=16000, return_tensors="pt")

    def want(clip) -> list[int]:
        given = inputs(clip)
        with torch.no_grad():
            out = hf.generate(**given, max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
        return out[0, given["input_ids"].shape[1]:].tolist()
    model, _ = load_model(resolve_model(str(tmp_path)))
    for clip in (a, b):
        given = inputs(clip)
        with torch.no_grad():
            rows = hf.model.get_audio_features(given["input_features"], given["input_features_mask"]).pooler_output
            got = model.embed_multimodal("audio", {k: given[k].numpy() for k in ("input_features", "input_features_mask")})
        torch.testing.assert_close(got, rows, atol=1e-5, rtol=1e-5)
    with LLM(model=str(tmp_path), max_model_len=256, max_num_batched_tokens=16) as llm:
        got = llm.generate([{"prompt": prompt, "multi_modal_data": {"audio": clip}} for clip in (a, b)], greedy())
        assert [list(r.outputs[0].token_ids) for r in got] == [want(a), want(b)]
        assert [len(r.prompt_token_ids) for r in got] == [4 + 50 + 32, 4 + 17]


def test_tokenize_expands_a_chats_clip_and_beam_search_refuses_it(server, media):
    """/tokenize renders and expands a chat's clip as the chat endpoint admits it (1.3 s: 32 audio
    positions between the markers); beam search refuses audio as it refuses images."""
    wav = (media[0] / "a.wav").read_bytes()
    content = [{"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}},
               {"type": "text", "text": "t5"}]
    status, body = post(server, {"messages": [{"role": "user", "content": content}]}, path="/tokenize")
    assert status == 200, body
    assert body["tokens"] == [1, 297] + [299] * 32 + [298, 5, 3] and body["count"] == 37
    status, body = post(server, {"messages": [{"role": "user", "content": content}], "max_tokens": 2,
                                 "use_beam_search": True, "n": 2})
    assert status == 400 and "beam search is not supported with image, video or audio input" in body["error"]["message"]
