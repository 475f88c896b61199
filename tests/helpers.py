"""Small helpers shared by the tests."""
import asyncio
import contextlib
import functools
import io
import json
import os
import sys
import types


def run_async(coro, timeout: float = 60.0):
    """Run a coroutine on a fresh uvloop event loop with a deadline."""
    import uvloop
    return uvloop.run(asyncio.wait_for(coro, timeout))


def run_steps(model, caches, tables, steps, block_size):
    """Logits (rows, vocab) of engine-like steps on a model: steps[i] holds each request's new
    token ids (a prompt, then one token per decode step), requests appended to their KV caches
    through the block tables ``tables``; one row per scheduled token."""
    import torch

    from kernels.attention import build_attention_metadata
    done = [0] * len(tables)
    logits = []
    for new in steps:
        ids = torch.cat(new)
        pos = torch.cat([torch.arange(d, d + len(n)) for d, n in zip(done, new)])
        done = [d + len(n) for d, n in zip(done, new)]
        meta = build_attention_metadata([len(n) for n in new], done, tables, block_size)
        with torch.inference_mode():
            logits.append(model.compute_logits(model(ids, pos, caches, meta)))
    return torch.cat(logits)


def save_tiny_llama(path, vocab: int, hidden: int, intermediate: int, heads: int, kv_heads: int,
                    head_dim: int, max_positions: int) -> str:
    """A random 2-layer Llama checkpoint (transformers' format) at ``path``, with spread-out
    weights so that greedy tokens are stable across devices and dtypes, yet a wrong row or
    position changes them. -> str(path)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                                      max_position_embeddings=max_positions, rms_norm_eps=1e-6,
                                      num_hidden_layers=2, tie_word_embeddings=False))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.15)
    hf.save_pretrained(path)
    return str(path)


def assert_same_steps(expected, got, atol: float) -> None:
    """Two runs of tools.gpu_check.driver.padding_scenario: the same requests, the same sampled
    tokens, the same top log-prob ids, and log-prob values within ``atol``."""
    import numpy as np
    for (ids_e, tok_e, lp_e), (ids_g, tok_g, lp_g) in zip(expected, got, strict=True):
        assert ids_g == ids_e and tok_g == tok_e
        assert lp_g.keys() == lp_e.keys()
        for rid, (ids, vals) in lp_e.items():
            assert lp_g[rid][0] == ids
            np.testing.assert_allclose(lp_g[rid][1], vals, rtol=0, atol=atol)


def shuffled_paged_metadata(reqs, block_size: int, gen, num_padding: int = 0, spare_blocks: int = 3):
    """Attention metadata for requests given as (cached context length, query length) whose
    pages are shuffled (non-contiguous block tables), page 0 left to padding; ``num_padding``
    padding tokens at the end. -> (metadata, number of pages the cache needs)."""
    import torch

    from kernels.attention import build_attention_metadata
    block_counts = [-(-(ctx + q) // block_size) for ctx, q in reqs]
    num_blocks = sum(block_counts) + spare_blocks
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    block_tables, used = [], 0
    for n in block_counts:
        block_tables.append(perm[used:used + n])
        used += n
    meta = build_attention_metadata([q for _, q in reqs], [ctx + q for ctx, q in reqs], block_tables, block_size,
                                    num_tokens=sum(q for _, q in reqs) + num_padding)
    return meta, num_blocks


def shared_prefix_metadata(reqs, prefix_blocks: int, block_size: int, gen, num_padding: int = 0):
    """Metadata for requests given as (tokens cached after the shared prefix, query length)
    whose first ``prefix_blocks`` pages are the same pages (a shared system prompt), then pages
    of their own, shuffled; page 0 left to padding; common_prefix_len set to the prefix.
    -> (metadata, number of pages the cache needs)."""
    import dataclasses

    import torch

    from kernels.attention import build_attention_metadata
    P = prefix_blocks * block_size
    own = [-(-(P + c + q) // block_size) - prefix_blocks for c, q in reqs]
    num_blocks = 1 + prefix_blocks + sum(own) + 2
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    shared, rest = ids[:prefix_blocks], ids[prefix_blocks:]
    tables = []
    for n in own:
        tables.append(shared + rest[:n])
        rest = rest[n:]
    meta = build_attention_metadata([q for _, q in reqs], [P + c + q for c, q in reqs], tables, block_size,
                                    num_tokens=sum(q for _, q in reqs) + num_padding)
    return dataclasses.replace(meta, common_prefix_len=P), num_blocks


def hf_greedy(hf, prompts: list[list[int]], n: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, ``n`` tokens, one whole-sequence forward a
    token (no cache: its generate caches some layers its own way; an eos does not end it)."""
    import torch
    out = []
    with torch.inference_mode():
        for p in prompts:
            seq = list(p)
            for _ in range(n):
                seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
            out.append(seq[len(p):])
    return out


def save_tiny_tokenizer(path, vocab: int) -> str:
    """A word-level tokenizer.json of ``vocab`` tokens ("t0" .. "t{vocab-1}", split on spaces) in
    checkpoint directory ``path``, so that a tiny random checkpoint serves text end to end."""
    import os

    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(path, "tokenizer.json"))
    return str(path)


def write_distribution(root, entry_points: str, module: str, name: str) -> None:
    """A distribution as pip leaves it: its module and its dist-info folder with entry points."""
    (root / f"{name}_mod.py").write_text(module)
    info = root / f"{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(entry_points)


def save_tiny_lora(hf_path, out, r: int, targets: list[str], seed: int, rslora: bool = False,
                   zero_b: bool = False, scale: float = 0.1):
    """A PEFT adapter (lora_alpha = 2 r) for the Llama checkpoint at ``hf_path``, with random A and
    B (B zero with ``zero_b``), saved at ``out``; returns the peft model (transformers' model with
    the adapter applied)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM
    hf = LlamaForCausalLM.from_pretrained(hf_path, torch_dtype=torch.float32)
    hf.config._attn_implementation = "eager"
    peft_model = get_peft_model(hf, LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, use_rslora=rslora,
                                               lora_dropout=0.0, init_lora_weights=False))
    randomize_lora(peft_model, seed, scale, zero_b)
    peft_model.save_pretrained(out)
    return peft_model.eval()


def randomize_lora(peft_model, seed: int, scale: float, zero_b: bool = False) -> None:
    """A peft model's LoRA A and B drawn from N(0, scale^2), seeded: B non-zero, unlike peft's
    default, so the adapter changes what the model computes (B zero with ``zero_b``)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.zeros_like(p) if zero_b and "lora_B" in name else torch.randn(p.shape, generator=g) * scale)


class _PlainArrays(types.ModuleType):
    """numpy, but whose memmap is a plain array over the same mapping: GGUFReader slices its file
    once per field part (two per vocabulary entry), and a memmap's Python-level slicing hooks are
    a third of a large vocabulary's parse; the bytes and the parse are the same."""

    def __getattr__(self, name: str):
        import numpy
        return getattr(numpy, name)

    @staticmethod
    def memmap(path, mode="r"):
        import numpy
        return numpy.asarray(numpy.memmap(path, mode=mode))


@functools.lru_cache(maxsize=None)
def _gguf_reader(path: str):
    import gguf.gguf_reader
    numpy = gguf.gguf_reader.np
    gguf.gguf_reader.np = _PlainArrays("numpy")
    try:
        return _fast_arrays_reader()(path)
    finally:
        gguf.gguf_reader.np = numpy


@functools.lru_cache(maxsize=None)
def _fast_arrays_reader():
    """GGUFReader whose arrays of strings and of scalars (a vocabulary's tokens, scores, token
    types) are read in one pass: the reader's own code reads each element through its general
    path (a numpy view and a type lookup each, half a minute for Gemma-3's 262,144 tokens). The
    fields are the same: the same parts (one-element arrays for scalars, a length and a bytes
    array for strings) at the same indices."""
    import numpy as np
    from gguf.constants import GGUFValueType

    class FastArraysReader(_GGUF_READER):
        def _get_field_parts(self, orig_offs, raw_type):
            if GGUFValueType(raw_type) != GGUFValueType.ARRAY or self.byte_order != "I":
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype = self._get(orig_offs, np.uint32)
            alen = self._get(orig_offs + 4, np.uint64)
            itype, n, offs = GGUFValueType(int(raw_itype[0])), int(alen[0]), orig_offs + 12
            nptype = self.gguf_scalar_to_np.get(itype)
            if n == 0 or (itype != GGUFValueType.STRING and nptype is None):
                return super()._get_field_parts(orig_offs, raw_type)
            parts = [raw_itype, alen]
            if nptype is not None:
                values = self._get(offs, nptype, n)
                parts += list(values.reshape(n, 1))
                return 12 + int(values.nbytes), parts, list(range(2, 2 + n)), [GGUFValueType.ARRAY, itype]
            data, view = self.data, memoryview(self.data)
            for _ in range(n):
                size = int.from_bytes(view[offs:offs + 8], "little")
                parts.append(data[offs:offs + 8].view(np.uint64))
                parts.append(data[offs + 8:offs + 8 + size])
                offs += 8 + size
            return offs - orig_offs, parts, list(range(3, 3 + 2 * n, 2)), [GGUFValueType.ARRAY, itype]

    return FastArraysReader


@functools.lru_cache(maxsize=None)
def _tensor_name_map(arch, n_blocks: int):
    """gguf's table of tensor names for an architecture: transformers builds it anew for every
    submodule of the model it maps (seconds for a 30-layer model); it is only read."""
    return _TENSOR_NAME_MAP(arch, n_blocks)


_GGUF_READER = None
_TENSOR_NAME_MAP = None


@contextlib.contextmanager
def _one_gguf_reader_per_file():
    """transformers parses a GGUF file with gguf's GGUFReader for the config, again for the
    tokenizer and again for the weights; the parse (a Python object per vocabulary entry) is what
    takes it tens of seconds. While this holds, each file is parsed once per test process and the
    same read-only reader is handed to every load, and gguf's tensor-name table is built once per
    architecture (transformers imports both from gguf when it loads)."""
    global _GGUF_READER, _TENSOR_NAME_MAP
    import gguf
    _GGUF_READER = _GGUF_READER or gguf.GGUFReader
    _TENSOR_NAME_MAP = _TENSOR_NAME_MAP or gguf.get_tensor_name_map
    gguf.GGUFReader = lambda path, mode="r": _gguf_reader(os.fspath(path)) if mode == "r" else _GGUF_READER(path, mode)
    gguf.get_tensor_name_map = _tensor_name_map
    try:
        yield
    finally:
        gguf.GGUFReader = _GGUF_READER
        gguf.get_tensor_name_map = _TENSOR_NAME_MAP


@functools.lru_cache(maxsize=None)
def transformers_tokenizer_from_gguf(path: str):
    """transformers' tokenizer of a GGUF file, built once per test process (a large vocabulary
    takes transformers tens of seconds; the parity tests of several modules share it)."""
    from transformers import AutoTokenizer
    with _one_gguf_reader_per_file():
        return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


@functools.lru_cache(maxsize=None)
def transformers_model_from_gguf(path: str):
    """transformers' model of a GGUF file (float32, the weights dequantized, eval mode), loaded
    once per test process: the suite's slowest set-up, shared by the parity tests. Tests that
    change it (peft wraps its layers) take ``copy.deepcopy`` of it."""
    import torch
    from transformers import AutoModelForCausalLM
    with _one_gguf_reader_per_file():
        return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                    dtype=torch.float32).eval()


def transformers_greedy_choices(model, prompt: list[int], continuation: list[int]) -> list[int]:
    """transformers' greedy choice after the prompt and each prefix of ``continuation``, eos
    suppressed (as ``generate(min_new_tokens=...)`` does): one forward pass over the prompt and
    the continuation but its last token. Equal to ``continuation`` exactly when transformers'
    greedy ``generate`` makes it (each choice sees the same prefix), without a decode loop of
    transformers' per token; where they part, the first differing entry is transformers' token."""
    import torch
    eos = model.generation_config.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    ids = torch.tensor([list(prompt) + list(continuation[:-1])])
    with torch.inference_mode():
        logits = model(ids, logits_to_keep=len(continuation)).logits[0]        # (len(continuation), V)
        logits[:, eos] = float("-inf")
        return logits.argmax(-1).tolist()


def self_signed_cert(directory: str, name: str = "cert") -> tuple[str, str]:
    """A new certificate for 127.0.0.1 from a CA of its own, and its key: ``name``.pem (the
    certificate, then its CA's, so the file serves as a client's trust file too) and
    ``name``.key under ``directory`` (trustme makes them)."""
    import trustme
    ca = trustme.CA()
    issued = ca.issue_cert("127.0.0.1")
    cert, key = os.path.join(directory, f"{name}.pem"), os.path.join(directory, f"{name}.key")
    with open(cert, "wb") as f:
        f.write(b"".join(blob.bytes() for blob in issued.cert_chain_pems) + ca.cert_pem.bytes())
    issued.private_key_pem.write_to_path(key)
    return cert, key


def _rank_main(rank: int, fn, world: int, init: str, out: str, args: tuple) -> None:
    import traceback

    import torch
    try:
        torch.set_num_threads(1)
        torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        torch.save(fn(rank, world, *args), f"{out}.{rank}")
        torch.distributed.barrier()        # no rank tears gloo down while another's last collective is in flight
        torch.distributed.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        raise
    # The result is saved: leave without the interpreter's teardown, where a native thread still
    # joinable (gloo's, OpenMP's) now and then aborts the process ("terminate called without an
    # active exception") after all the work is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn, world: int, tmp_path, *args) -> list:
    """``fn(rank, world, *args)`` in ``world`` spawned processes joined in one gloo group (a thread
    each); returns what each rank's call returned, in rank order. ``fn`` is a module-level function."""
    import torch
    import torch.multiprocessing as mp
    out = os.path.join(str(tmp_path), "rank-result")
    mp.start_processes(_rank_main, args=(fn, world, f"file://{tmp_path}/rank-init", out, args), nprocs=world,
                       start_method="spawn", join=True)
    return [torch.load(f"{out}.{r}") for r in range(world)]


# a chat template over OpenAI content parts (vLLM's "openai" format): "t1" opens a user's turn,
# "t2" an assistant's, "t3" asks for the answer; an image part is LLaVA's "<image>"
LLAVA_CHAT_TEMPLATE = ("{% for message in messages %}{{ 't1 ' if message['role'] == 'user' else 't2 ' }}"
                       "{% for part in message['content'] %}{% if part['type'] == 'image' %}<image> "
                       "{% elif part['type'] == 'text' %}{{ part['text'] }} {% endif %}{% endfor %}{% endfor %}"
                       "{% if add_generation_prompt %}t3{% endif %}")


def _save_vlm(hf, path, vocab: int, specials: list[str], **tokenizer_kwargs):
    """A tiny multimodal model's weights drawn at random (norms about 1) and saved at ``path``,
    beside a word-level tokenizer whose last tokens are ``specials``; returns transformers' fast
    tokenizer of it (``tokenizer_kwargs``: its special-token attributes)."""
    import torch
    import transformers
    from tokenizers import Tokenizer
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.15)
    hf.save_pretrained(path)
    save_tiny_tokenizer(path, vocab - len(specials))
    tokenizer_file = os.path.join(str(path), "tokenizer.json")
    tok = Tokenizer.from_file(tokenizer_file)
    tok.add_special_tokens(specials)
    tok.save(tokenizer_file)
    return transformers.PreTrainedTokenizerFast(tokenizer_file=tokenizer_file, unk_token="t0", **tokenizer_kwargs)


def save_tiny_llava(path, vocab: int = 300, image_size: int = 56, seed: int = 9):
    """A tiny random LLaVA checkpoint (a CLIP vision tower of ``image_size`` pixels in patches of
    14, a projector, a two-layer Llama) with its processor: CLIP's image processor and a
    word-level tokenizer ("t0" .. "t{vocab-2}", then "<image>", the image token), and a chat
    template over content parts. An image takes (image_size / 14)^2 positions. Returns
    transformers' model and processor, as read back from ``path``."""
    import torch
    import transformers
    text = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                    bos_token_id=None, eos_token_id=None)
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                           num_attention_heads=2, image_size=image_size, patch_size=14)
    torch.manual_seed(seed)
    hf = transformers.LlavaForConditionalGeneration(transformers.LlavaConfig(
        text_config=text, vision_config=vision, image_token_index=vocab - 1))
    fast = _save_vlm(hf, path, vocab, ["<image>"])
    images = transformers.CLIPImageProcessor(size={"shortest_edge": image_size},
                                             crop_size={"height": image_size, "width": image_size})
    processor = transformers.LlavaProcessor(image_processor=images, tokenizer=fast, patch_size=14,
                                            vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                            image_token="<image>", chat_template=LLAVA_CHAT_TEMPLATE)
    processor.save_pretrained(path)
    return (transformers.LlavaForConditionalGeneration.from_pretrained(path).eval(),
            transformers.AutoProcessor.from_pretrained(path))


def _save_as_hub_processor(path, images, image_processor_type: str, processor_class: str, chat_template: str) -> None:
    """A processor saved as the hub has it, where transformers cannot build the processor here
    (it needs torchvision): the image processor's preprocessor_config.json naming the hub's
    image processor and processor classes, and the chat template in chat_template.json."""
    images.save_pretrained(path)
    config_file = os.path.join(str(path), "preprocessor_config.json")
    with open(config_file) as f:
        config = json.load(f)
    config.update(image_processor_type=image_processor_type, processor_class=processor_class)
    with open(config_file, "w") as f:
        json.dump(config, f)
    with open(os.path.join(str(path), "chat_template.json"), "w") as f:
        json.dump({"chat_template": chat_template}, f)


QWEN2_VL_CHAT_TEMPLATE = ("{% for message in messages %}{{ 't1 ' if message['role'] == 'user' else 't2 ' }}"
                          "{% for part in message['content'] %}{% if part['type'] == 'image' %}"
                          "<|vision_start|><|image_pad|><|vision_end|> {% elif part['type'] == 'video' %}"
                          "<|vision_start|><|video_pad|><|vision_end|> {% elif part['type'] == 'text' %}"
                          "{{ part['text'] }} {% endif %}{% endfor %}{% endfor %}"
                          "{% if add_generation_prompt %}t3{% endif %}")


def save_tiny_qwen2_vl(path, family: str = "qwen2_vl", vocab: int = 300, seed: int = 3):
    """A tiny random Qwen2-VL (``family`` "qwen2_5_vl": Qwen2.5-VL; "qwen3_vl": Qwen3-VL)
    checkpoint as the hub has them: a vision tower of 14-pixel patches merged 2x2 into an image position, a two-layer
    language model with M-RoPE sections (2, 3, 3) over its 16-dimension heads, its image
    processor's preprocessor_config.json (naming the processor class; images between 56x56 and
    112x112 pixels) and chat_template.json, and a word-level tokenizer whose last four tokens are
    <|vision_start|>, <|vision_end|>, <|video_pad|> and <|image_pad|>. Returns transformers'
    model as read back and a function of (text with one <|image_pad|> per image, images) ->
    transformers' generate inputs, the placeholder expanded as Qwen2-VL's processor does."""
    import numpy as np
    import torch
    import transformers
    text = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=None,
                eos_token_id=None,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0})
    vision = dict(depth=2, embed_dim=32, num_heads=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    if family == "qwen2_5_vl":
        vision.update(hidden_size=32, out_hidden_size=64, intermediate_size=48, window_size=56,
                      fullatt_block_indexes=[1])
        config_class, model_class = transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration
        processor_class = "Qwen2_5_VLProcessor"
    elif family == "qwen3_vl":      # interleaved M-RoPE; DeepStack features from both blocks into both layers
        vision = {k: v for k, v in vision.items() if k != "embed_dim"}
        vision.update(hidden_size=32, out_hidden_size=64, intermediate_size=48, num_position_embeddings=16,
                      deepstack_visual_indexes=[0, 1])
        text.update(head_dim=16, rope_parameters={**text["rope_parameters"], "mrope_interleaved": True})
        config_class, model_class = transformers.Qwen3VLConfig, transformers.Qwen3VLForConditionalGeneration
        processor_class = "Qwen3VLProcessor"
    else:
        vision.update(hidden_size=64, mlp_ratio=2)
        config_class, model_class = transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration
        processor_class = "Qwen2VLProcessor"
    torch.manual_seed(seed)
    hf = model_class(config_class(text_config=text, vision_config=vision, image_token_id=vocab - 1,
                                  video_token_id=vocab - 2, vision_start_token_id=vocab - 4,
                                  vision_end_token_id=vocab - 3))
    _save_vlm(hf, path, vocab, ["<|vision_start|>", "<|vision_end|>", "<|video_pad|>", "<|image_pad|>"])
    images = transformers.Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112)
    _save_as_hub_processor(path, images, "Qwen2VLImageProcessor", processor_class, QWEN2_VL_CHAT_TEMPLATE)
    words = {f"t{i}": i for i in range(vocab - 4)}
    words.update({"<|vision_start|>": vocab - 4, "<|vision_end|>": vocab - 3, "<|image_pad|>": vocab - 1})

    def inputs(prompt: str, pictures: list) -> dict:
        ids, pixels, grids, picture = [], [], [], iter(pictures)
        for word in prompt.split():
            if word != "<|image_pad|>":
                ids.append(words[word])
                continue
            out = images(images=[next(picture)], return_tensors="np")
            pixels.append(out["pixel_values"])
            grids.append(out["image_grid_thw"])
            ids.extend([vocab - 1] * (int(np.prod(out["image_grid_thw"][0])) // 4))
        ids_t = torch.tensor([ids])
        return {"input_ids": ids_t, "attention_mask": torch.ones_like(ids_t),
                "mm_token_type_ids": (ids_t == vocab - 1).int(),
                "pixel_values": torch.from_numpy(np.concatenate(pixels)),
                "image_grid_thw": torch.from_numpy(np.concatenate(grids))}
    return model_class.from_pretrained(path).eval(), inputs


def save_tiny_mistral3(path, vocab: int = 300, seed: int = 7):
    """A tiny random Mistral 3 checkpoint as the hub has it: a Pixtral vision tower of 14-pixel
    patches, a projector merging them 2x2, a two-layer Mistral; its image processor's
    preprocessor_config.json (images resized to at most 112 pixels a side) and its processor's
    processor_config.json (patch size, merge, tokens), the chat template of save_tiny_llava with
    "[IMG]" for an image, and a word-level tokenizer whose last three tokens are [IMG_BREAK],
    [IMG_END] and [IMG]. Returns transformers' model as read back and a function of (text with
    one [IMG] per image, images) -> transformers' generate inputs, the placeholder expanded as
    Pixtral's processor does (a row of [IMG] per row of merged patches, [IMG_BREAK] between
    rows, [IMG_END] last)."""
    import numpy as np
    import torch
    import transformers
    text = dict(model_type="mistral", vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                rms_norm_eps=1e-6, sliding_window=None, bos_token_id=None, eos_token_id=None)
    vision = dict(model_type="pixtral", hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=2, head_dim=16, image_size=112, patch_size=14)
    torch.manual_seed(seed)
    hf = transformers.Mistral3ForConditionalGeneration(transformers.Mistral3Config(
        text_config=text, vision_config=vision, image_token_index=vocab - 1, spatial_merge_size=2,
        tie_word_embeddings=False))
    _save_vlm(hf, path, vocab, ["[IMG_BREAK]", "[IMG_END]", "[IMG]"])
    images = transformers.PixtralImageProcessorPil(size={"longest_edge": 112}, patch_size=14)
    _save_as_hub_processor(path, images, "PixtralImageProcessor", "PixtralProcessor",
                           LLAVA_CHAT_TEMPLATE.replace("<image>", "[IMG]"))
    with open(os.path.join(str(path), "processor_config.json"), "w") as f:
        json.dump({"processor_class": "PixtralProcessor", "patch_size": 14, "spatial_merge_size": 2,
                   "image_token": "[IMG]", "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]"}, f)
    words = {f"t{i}": i for i in range(vocab - 3)}

    def inputs(prompt: str, pictures: list) -> dict:
        ids, pixels, sizes, picture = [], [], [], iter(pictures)
        for word in prompt.split():
            if word != "[IMG]":
                ids.append(words[word])
                continue
            out = images(images=[next(picture)], return_tensors="np")
            pixels.append(torch.from_numpy(out["pixel_values"]))
            sizes.append(out["image_sizes"])
            rows, cols = (int(v) // 28 for v in out["image_sizes"][0])
            ids.extend(([vocab - 1] * cols + [vocab - 3]) * rows)
            ids[-1] = vocab - 2
        height = max(p.shape[2] for p in pixels)
        width = max(p.shape[3] for p in pixels)
        padded = torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[3], 0, height - p.shape[2])) for p in pixels])
        return {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
                "pixel_values": padded, "image_sizes": torch.from_numpy(np.concatenate(sizes))}
    return transformers.Mistral3ForConditionalGeneration.from_pretrained(path).eval(), inputs


def tiny_text_config(vocab: int) -> dict:
    """The two-layer language model of the tiny multimodal checkpoints: 64 wide, 4 heads over 2 KV heads."""
    return dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=None,
                eos_token_id=None)


QWEN2_AUDIO_CHAT_TEMPLATE = ("{% for message in messages %}{{ 't1 ' if message['role'] == 'user' else 't2 ' }}"
                             "{% for part in message['content'] %}{% if part['type'] == 'audio' %}"
                             "<|audio_bos|><|AUDIO|><|audio_eos|> {% elif part['type'] == 'text' %}"
                             "{{ part['text'] }} {% endif %}{% endfor %}{% endfor %}"
                             "{% if add_generation_prompt %}t3{% endif %}")


def save_tiny_qwen2_audio(path, vocab: int = 300, seed: int = 11):
    """A tiny random Qwen2-Audio checkpoint as transformers saves it: a two-layer audio tower over
    80 log-mel bins in a window of 2 s (200 frames; a clip of s seconds takes
    ((100 s - 1) // 2 + 1 - 2) // 2 + 1 positions, 50 for the whole window), a projector, a
    two-layer Qwen2, and its processor (Whisper's feature extractor at 16 kHz, a word-level
    tokenizer whose last three tokens are <|audio_bos|>, <|audio_eos|> and <|AUDIO|>, a chat
    template over content parts). Returns transformers' model and processor, as read back."""
    import torch
    import transformers
    text = tiny_text_config(vocab)
    audio = dict(num_mel_bins=80, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=48, d_model=32,
                 max_source_positions=100)
    torch.manual_seed(seed)
    hf = transformers.Qwen2AudioForConditionalGeneration(transformers.Qwen2AudioConfig(
        text_config=text, audio_config=audio, audio_token_index=vocab - 1))
    fast = _save_vlm(hf, path, vocab, ["<|audio_bos|>", "<|audio_eos|>", "<|AUDIO|>"])
    features = transformers.WhisperFeatureExtractor(feature_size=80, chunk_length=2, sampling_rate=16000)
    transformers.Qwen2AudioProcessor(feature_extractor=features, tokenizer=fast,
                                     chat_template=QWEN2_AUDIO_CHAT_TEMPLATE).save_pretrained(path)
    return (transformers.Qwen2AudioForConditionalGeneration.from_pretrained(path).eval(),
            transformers.AutoProcessor.from_pretrained(path))


GLMASR_CHAT_TEMPLATE = ("{% for message in messages %}{{ 't1 ' if message['role'] == 'user' else 't2 ' }}"
                        "{{ message['content'] }} {% endfor %}{% if add_generation_prompt %}t3{% endif %}")


def save_tiny_glmasr(path, vocab: int = 300, seed: int = 13):
    """A tiny random GLM-ASR checkpoint as transformers saves it: a two-layer rotary audio
    encoder over 80 log-mel bins in windows of 2 s (a clip is cut into windows, at most 3 of
    them; a window's own f frames take ((f - 1) // 2 + 1 - 4) // 4 + 1 positions, 25 for a whole
    one), a projector of four frames into one position, a two-layer Llama tied to its embeddings,
    and its processor (Whisper's feature extractor at 16 kHz, a word-level tokenizer whose last
    three tokens are <|begin_of_audio|>, <|end_of_audio|> and <|pad|>, the audio token; a chat
    template over string content). Returns transformers' model and processor, as read back."""
    import torch
    import transformers
    text = tiny_text_config(vocab)
    audio = dict(hidden_size=32, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_mel_bins=80,
                 max_position_embeddings=100)
    torch.manual_seed(seed)
    hf = transformers.GlmAsrForConditionalGeneration(transformers.GlmAsrConfig(
        text_config=text, audio_config=audio, audio_token_id=vocab - 1))
    fast = _save_vlm(hf, path, vocab, ["<|begin_of_audio|>", "<|end_of_audio|>", "<|pad|>"], pad_token="t0")
    features = transformers.WhisperFeatureExtractor(feature_size=80, chunk_length=2, sampling_rate=16000)
    transformers.GlmAsrProcessor(feature_extractor=features, tokenizer=fast, max_audio_len=6,
                                 chat_template=GLMASR_CHAT_TEMPLATE).save_pretrained(path)
    return (transformers.GlmAsrForConditionalGeneration.from_pretrained(path).eval(),
            transformers.AutoProcessor.from_pretrained(path))


def save_tiny_audioflamingo3(path, vocab: int = 300, seed: int = 17):
    """A tiny random Audio Flamingo 3 checkpoint as transformers saves it: a two-layer Whisper
    encoder over 80 log-mel bins in windows of 2 s (a clip is cut into windows, at most 3; a window's
    own f frames take ((f - 1) // 2 + 1 - 2) // 2 + 1 positions, 50 for a whole one), a projector, a
    two-layer Qwen2, and its processor (Whisper's feature extractor at 16 kHz, a word-level tokenizer
    whose last token is <sound>, the audio token). Returns transformers' model and processor, as
    read back."""
    import torch
    import transformers
    text = tiny_text_config(vocab)
    audio = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, num_mel_bins=80,
                 max_source_positions=100)
    torch.manual_seed(seed)
    hf = transformers.AudioFlamingo3ForConditionalGeneration(transformers.AudioFlamingo3Config(
        text_config=text, audio_config=audio, audio_token_id=vocab - 1))
    fast = _save_vlm(hf, path, vocab, ["<sound>"], pad_token="t0")
    features = transformers.WhisperFeatureExtractor(feature_size=80, chunk_length=2, sampling_rate=16000)
    transformers.AudioFlamingo3Processor(feature_extractor=features, tokenizer=fast, max_audio_len=6).save_pretrained(path)
    return (transformers.AudioFlamingo3ForConditionalGeneration.from_pretrained(path).eval(),
            transformers.AutoProcessor.from_pretrained(path))


def audio_file(samples, rate: int = 16000, fmt: str = "WAV", subtype: str | None = None) -> bytes:
    """Samples (mono, or (samples, channels)) written as an audio file of ``fmt`` by libsndfile
    (``subtype``: its sample format, "FLOAT" to keep them exactly; None: the format's default)."""
    import soundfile
    buf = io.BytesIO()
    soundfile.write(buf, samples, rate, format=fmt, subtype=subtype)
    return buf.getvalue()


def tone(seconds: float, rate: int = 16000, period: float = 7.0, seed: int = 0):
    """A float32 clip: a sine of ``period`` samples with a little noise."""
    import numpy as np
    n = int(rate * seconds)
    noise = np.random.default_rng(seed).standard_normal(n)
    return (0.3 * np.sin(np.arange(n) / period) + 0.05 * noise).astype(np.float32)


@contextlib.contextmanager
def http_folder(root):
    """A folder served over HTTP on 127.0.0.1 (a free port) while the block runs: its base URL."""
    import http.server
    import threading
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=10)


def random_image(seed: int, width: int = 50, height: int = 40):
    """An RGB PIL image of uniform noise."""
    import numpy as np
    from PIL import Image
    return Image.fromarray((np.random.RandomState(seed).rand(height, width, 3) * 255).astype(np.uint8))


def save_tiny_gemma3_vision(path, vocab: int = 300, seed: int = 5):
    """A tiny random Gemma 3 checkpoint with a SigLIP vision tower (56 pixels in patches of 14, 16
    soft tokens an image) and its processor (Gemma 3's, a word-level tokenizer whose last three
    tokens are <start_of_image>, <end_of_image> and <image_soft_token>). Its sliding layers' window
    (8) is shorter than an image, whose positions attend to each other both ways. Returns
    transformers' model and processor, as read back from ``path``."""
    import torch
    import transformers
    text = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6, num_hidden_layers=4, sliding_window=8,
                query_pre_attn_scalar=24,
                layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"])
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, image_size=56,
                  patch_size=14)
    torch.manual_seed(seed)
    hf = transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=16, image_token_index=vocab - 1,
        boi_token_index=vocab - 3, eoi_token_index=vocab - 2))
    fast = _save_vlm(hf, path, vocab, ["<start_of_image>", "<end_of_image>", "<image_soft_token>"], extra_special_tokens={
        "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"})
    images = transformers.Gemma3ImageProcessorPil(size={"height": 56, "width": 56})
    transformers.Gemma3Processor(image_processor=images, tokenizer=fast, image_seq_length=16).save_pretrained(path)
    return (transformers.Gemma3ForConditionalGeneration.from_pretrained(path).eval(),
            transformers.AutoProcessor.from_pretrained(path))


def mp4(levels: list[int], fps: float = 10.0, size: tuple[int, int] = (64, 48)) -> bytes:
    """An MP4 (MPEG-4 part 2) of flat grey frames, one a level, written by OpenCV."""
    import os
    import tempfile

    import cv2
    import numpy as np
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "v.mp4")
        writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"mp4v"), fps, size)
        for level in levels:
            writer.write(np.full((size[1], size[0], 3), level, np.uint8))
        writer.release()
        with open(path, "rb") as f:
            return f.read()
