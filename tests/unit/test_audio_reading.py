"""Reading audio clips as vLLM reads them (actors/tokenizer/audio.py): files decoded by libsndfile,
channels averaged, within vLLM's limits; samples brought to the model's rate by band-limited sinc
interpolation; the offline API's forms of ``multi_modal_data["audio"]``; media URLs read whole."""
from __future__ import annotations

import asyncio
import base64

import numpy as np
import pytest

from actors.engine.config import MultiModalConfig
from actors.tokenizer.audio import Audio, AudioError, InputAudio, audios_of, decode_audio, input_audio_bytes, resample
from actors.tokenizer.chat import normalize_messages
from actors.tokenizer.multimodal import AUDIO, MediaError, _fetch, extract_images, images_of, modality_of
from helpers import audio_file, http_folder, tone


@pytest.mark.parametrize("rates", [(8000, 16000), (44100, 16000), (48000, 16000), (22050, 16000), (16000, 24000)])
def test_resampling_keeps_a_tone_and_gives_ceil_of_the_rate_ratio_samples(rates):
    orig, new = rates
    n = orig // 2 + 7
    samples = np.sin(2 * np.pi * 440 * np.arange(n) / orig).astype(np.float32)
    out = resample(samples, orig, new)
    assert len(out) == -(-n * new // orig) and out.dtype == np.float32
    want = np.sin(2 * np.pi * 440 * np.arange(len(out)) / new)
    assert np.abs(out - want)[100:-100].max() < 2e-3      # the edges see the zero padding


def test_resampling_removes_what_the_lower_rate_cannot_hold():
    """A 7 kHz tone has no place at 8 kHz (its Nyquist frequency is 4 kHz): it is filtered out,
    not folded back as a 1 kHz alias."""
    samples = np.sin(2 * np.pi * 7000 * np.arange(16000) / 16000).astype(np.float32)
    out = resample(samples, 16000, 8000)
    assert np.abs(out[200:-200]).max() < 0.01
    assert resample(samples, 16000, 16000) is samples


def test_files_decode_with_their_channels_averaged_in_each_format():
    left, right = tone(0.5, 22050, seed=1), tone(0.5, 22050, period=5.0, seed=2)
    for fmt in ("WAV", "FLAC", "OGG", "MP3"):
        clip = decode_audio(audio_file(np.stack([left, right], axis=1), 22050, fmt), 600, 1 << 28)
        assert clip.sampling_rate == 22050 and clip.samples.dtype == np.float32 and clip.samples.ndim == 1
        if fmt in ("WAV", "FLAC"):          # lossless: the mean of the channels, to 16 bits
            assert np.abs(clip.samples - (left + right) / 2).max() < 1e-3
        else:                               # lossy: about as long (the codec's priming and padding)
            assert abs(len(clip.samples) - len(left)) < 3000


def test_decoding_refuses_files_that_are_not_audio_or_exceed_the_limits():
    wav = audio_file(tone(2.0))
    with pytest.raises(AudioError, match="Invalid or unsupported audio file"):
        decode_audio(b"not audio at all", 600, 1 << 28)
    with pytest.raises(AudioError, match=r"Audio exceeds maximum allowed duration of 1s \(file contains 2.0s at 16000Hz\)"):
        decode_audio(wav, 1, 1 << 28)
    with pytest.raises(AudioError, match=r"exceeding the 0 MiB limit. Set VLLM_MAX_AUDIO_DECODE_BYTES"):
        decode_audio(wav, 600, 1000)
    with pytest.raises(AudioError, match="input_audio's data is not valid base64"):
        input_audio_bytes(InputAudio("@@@", "wav"), 1 << 20)
    with pytest.raises(AudioError, match=r"larger than 0 MiB \(VLLM_MAX_AUDIO_CLIP_FILESIZE_MB\)"):
        input_audio_bytes(InputAudio(base64.b64encode(wav).decode(), "wav"), 1000)


def test_the_offline_forms_of_audio_are_vllms():
    import torch
    a, b = tone(0.1), tone(0.2)
    assert [len(c.samples) for c in audios_of(a)] == [1600]                      # samples alone: one clip
    assert audios_of((a, 8000))[0].sampling_rate == 8000.0                         # (samples, rate)
    assert [c.sampling_rate for c in audios_of([(a, 8000), (b, 16000)])] == [8000.0, 16000.0]
    assert [len(c.samples) for c in audios_of([a, b])] == [1600, 3200]            # several clips
    assert len(audios_of(torch.from_numpy(a))[0].samples) == 1600
    stereo = audios_of((np.stack([a, -a]), 16000))[0]                             # (channels, samples)
    assert np.abs(stereo.samples).max() == 0
    with pytest.raises(AudioError, match="sampling rate must be a positive number"):
        audios_of((a, 0))
    with pytest.raises(AudioError, match="must be a non-empty array"):
        audios_of(np.zeros((2, 2, 2), np.float32))
    with pytest.raises(MediaError, match=r"multi_modal_data \['sound'\] is not supported"):
        images_of({"sound": a})
    clips = images_of({"audio": [(a, 8000)]})
    assert isinstance(clips[0], Audio) and modality_of(clips[0]) == AUDIO


def test_chat_audio_parts_become_the_templates_audio_parts_and_a_text_model_refuses_them():
    part = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    url = {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64,AAAA"}}
    messages, sources = extract_images([{"role": "user", "content": [part, {"type": "text", "text": "hi"}, url]}])
    assert messages[0]["content"] == [{"type": "audio"}, {"type": "text", "text": "hi"}, {"type": "audio"}]
    assert [modality_of(s) for s in sources] == [AUDIO, AUDIO] and sources[0] == InputAudio("AAAA", "wav")
    with pytest.raises(MediaError, match="an audio_url part needs a non-empty url"):
        extract_images([{"role": "user", "content": [{"type": "audio_url", "audio_url": {"url": ""}}]}])
    with pytest.raises(ValueError, match=r"'input_audio' is not supported.*\(this model takes no audio\)"):
        normalize_messages([{"role": "user", "content": [part]}])
    placed = normalize_messages([{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "hi"}]}],
                                image_placeholder={AUDIO: "<|audio_bos|><|AUDIO|><|audio_eos|>"})
    assert placed[0]["content"] == "<|audio_bos|><|AUDIO|><|audio_eos|>\nhi"


def test_a_media_url_is_read_to_the_end_of_its_body_within_the_limit(tmp_path):
    """A body larger than what one read of the connection holds comes whole (a large file over
    HTTP decodes), and one over the limit is refused."""
    body = np.random.default_rng(0).integers(0, 255, 6 << 20, dtype=np.uint8).tobytes()
    (tmp_path / "big.bin").write_bytes(body)
    with http_folder(tmp_path) as base:
        url = f"{base}/big.bin"
        assert asyncio.run(asyncio.wait_for(_fetch(url, MultiModalConfig(), AUDIO, 8 << 20), 60)) == body
        with pytest.raises(MediaError, match="is larger than 4 MiB"):
            asyncio.run(asyncio.wait_for(_fetch(url, MultiModalConfig(), AUDIO, 4 << 20), 60))


def test_the_chat_repls_slash_audio_attaches_an_audio_file_as_a_data_url(tmp_path, capsys):
    from tools.chat import command, shown_content
    (tmp_path / "clip.wav").write_bytes(b"RIFF")
    parts: list[dict] = []
    assert command(f"/audio {tmp_path / 'clip.wav'}", [], None, parts)
    url = parts[0]["audio_url"]["url"]           # the type the system's MIME table names (audio/wav, audio/x-wav)
    assert parts[0]["type"] == "audio_url" and url.startswith("data:audio/") and url.endswith("wav;base64,UklGRg==")
    assert "audio 1 attached" in capsys.readouterr().err
    assert shown_content([*parts, {"type": "text", "text": "what is said"}]) == "[audio] what is said"
