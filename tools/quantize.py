"""``python -m tools.quantize --model M --scheme fp8|int8|awq|gptq [--per-channel] -o OUTDIR``:
a quantized checkpoint of any supported model, in the layout vLLM and Troupe load from
config.json's quantization_config.

- fp8, int8: W8A8 in compressed-tensors format: every linear layer but the LM head gets 8-bit
  weights (symmetric, scale amax / 448 for fp8 or amax / 127 for int8, per tensor or with
  ``--per-channel`` per output feature, or for int8 with ``--group-size G`` per group of G input
  features) and dynamic per-token 8-bit activations.
- awq, gptq: W4A16, 4-bit weights per group of ``--group-size`` (default 128) input features,
  float16 scales, in AutoAWQ's GEMM layout (asymmetric, packed zeros) or GPTQ's (symmetric,
  checkpoint_format gptq). The codes are rounded to nearest, without the calibration data AWQ
  and GPTQ use to choose them: the format is theirs, the accuracy is plain round-to-nearest's.

The rest stays float32. The source is a Hugging Face checkpoint (its config.json and tokenizer
files copied) or a GGUF file (the default model included), dequantized by our loader and written
in Hugging Face layout with a config.json from its header and the tokenizer Troupe builds from it.

Prints one JSON line: where it wrote, how many layers were quantized, the bytes written.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
from typing import Any, Iterator

import torch

from models.rope import STRETCHING_TYPES

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json", "vocab.json", "merges.txt", "tokenizer.model")
SCHEMES = ("fp8", "int8", "awq", "gptq")
INT4_SCHEMES = ("awq", "gptq")


def quantization_config(scheme: str, per_channel: bool, group_size: int = 0) -> dict[str, Any]:
    """compressed-tensors' quantization_config of one scheme over every Linear but the LM head."""
    kind = "float" if scheme == "fp8" else "int"
    strategy = "group" if group_size else "channel" if per_channel else "tensor"
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized" if scheme == "fp8" else "int-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": kind, "symmetric": True, "dynamic": False,
                        "strategy": strategy, "group_size": group_size or None},
            "input_activations": {"num_bits": 8, "type": kind, "symmetric": True, "dynamic": True,
                                  "strategy": "token", "group_size": None},
        }},
        "ignore": ["lm_head"],
    }


def int4_quantization_config(scheme: str, group_size: int) -> dict[str, Any]:
    """AutoAWQ's (GEMM, zero point) or GPTQ's (symmetric, no act-order) quantization_config."""
    if scheme == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}
    return {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": False, "sym": True,
            "checkpoint_format": "gptq"}


def int4_tensors(stem: str, w: torch.Tensor, scheme: str, group_size: int) -> dict[str, torch.Tensor]:
    """One linear layer's packed 4-bit tensors: qweight, qzeros and scales (AWQ: qweight (K, N / 8)
    and qzeros (G, N / 8) in AWQ's nibble order; GPTQ: qweight (K / 8, N), qzeros (G, N / 8)
    holding zero - 1, as GPTQ's first checkpoint format does)."""
    from models.quantization.formats import awq_order, pack_int32, quantize_int4
    n, k = w.shape
    if k % group_size or n % 8:
        raise ValueError(f"{stem}: {k} input features in groups of {group_size}, {n} output features in "
                         "words of 8: the shapes do not divide (choose --group-size to divide the input features)")
    codes, zeros, scales = quantize_int4(w, torch.arange(k) // group_size, symmetric=scheme == "gptq")
    if scheme == "awq":
        return {f"{stem}.qweight": pack_int32(awq_order(codes), 4, 1), f"{stem}.qzeros": pack_int32(awq_order(zeros), 4, 1),
                f"{stem}.scales": scales}
    return {f"{stem}.qweight": pack_int32(codes, 4, 0), f"{stem}.qzeros": pack_int32(zeros - 1, 4, 1),
            f"{stem}.scales": scales}


def hf_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """(checkpoint name, float tensor, whether it is a linear layer's weight) of a loaded model,
    named by its class's hf_tensor_map (fused layers split back into their shards)."""
    from models.layers import Linear, MergedLinear
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    tied = model.config.tie_word_embeddings
    layers = model.config.num_layers
    for ckpt_name, (param, shard) in model.hf_tensor_map.items():
        for i in (range(layers) if "{i}" in ckpt_name else [None]):
            name, target = (ckpt_name, param) if i is None else (ckpt_name.replace("{i}", str(i)),
                                                                  param.replace("{i}", str(i)))
            if target not in params or (tied and target == "lm_head.weight"):
                continue
            tensor = params[target].detach()
            owner = modules[target.rsplit(".", 1)[0]]
            if shard is not None:
                start, size = owner.shard_offsets[shard], owner.shard_sizes[shard]
                tensor = tensor[start:start + size]
            is_linear = isinstance(owner, (Linear, MergedLinear)) and target.endswith(".weight")
            yield name, tensor.float().contiguous(), is_linear and not target.startswith("lm_head")


def hf_config_of(config, raw_path: str | None) -> dict[str, Any]:
    """The source's config.json, or one written from a GGUF header's ArchConfig (Llama-family
    fields; an architecture that needs more keys is refused)."""
    if raw_path is not None:
        with open(os.path.join(raw_path, "config.json")) as f:
            return json.load(f)
    from models.base import CausalLM
    from models.registry import get_model_class
    if get_model_class(config.architecture).hf_fields.__func__ is not CausalLM.hf_fields.__func__:
        raise ValueError(f"writing a config.json for {config.architecture} from a GGUF header is not supported; "
                         "quantize its Hugging Face checkpoint instead")
    eos = list(config.eos_token_ids)
    return {
        "architectures": [config.architecture], "model_type": "llama", "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_size,
        "max_position_embeddings": (config.rope_scaling.original_max_position_embeddings
                                    if config.rope_scaling.rope_type in STRETCHING_TYPES else config.max_model_len),
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling.to_hf(),
        "rms_norm_eps": config.rms_norm_eps, "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": config.qkv_bias, "hidden_act": config.hidden_act, "torch_dtype": "float32",
        "bos_token_id": config.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else eos,
    }


def write_gguf_tokenizer(gguf_path: str, out: str) -> None:
    """tokenizer.json and tokenizer_config.json of the tokenizer Troupe builds from a GGUF header."""
    from actors.tokenizer.gguf_tokenizer import build_tokenizer
    from models.gguf_header import read_gguf_metadata
    meta = read_gguf_metadata(gguf_path)
    build_tokenizer(meta).save(os.path.join(out, "tokenizer.json"))
    tokens = meta["tokenizer.ggml.tokens"]

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return None if i is None else tokens[i]
    config = {"bos_token": token("bos"), "eos_token": token("eos"), "pad_token": token("padding"),
              "unk_token": token("unknown"), "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
              "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
              "chat_template": meta.get("tokenizer.chat_template")}
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({k: v for k, v in config.items() if v is not None}, f, indent=1)


def quantize_checkpoint(model: str | None, scheme: str, per_channel: bool, out: str,
                        group_size: int = 0) -> dict[str, Any]:
    from safetensors.torch import save_file

    from models.quantization.formats import quantize_fp8, quantize_int8
    from models.registry import load_model
    from models.resolve import resolve_model
    if scheme not in SCHEMES:
        raise ValueError(f"scheme {scheme!r} is not supported; supported: {', '.join(SCHEMES)}")
    if scheme in INT4_SCHEMES:
        group_size = group_size or 128
        if per_channel:
            raise ValueError(f"--per-channel is for fp8 and int8; {scheme} scales each group of --group-size")
    if group_size and (scheme not in ("int8", *INT4_SCHEMES) or group_size % 32):
        raise ValueError(f"--group-size {group_size}: groups are for int8, awq and gptq, in multiples of 32")
    source = resolve_model(model)
    loaded, config = load_model(source)
    raw = source.path if source.kind == "hf_dir" else None
    hf_config = hf_config_of(config, raw)
    if raw is not None and hf_config.get("quantization_config"):
        raise ValueError(f"{source.path} is already quantized "
                         f"({hf_config['quantization_config'].get('quant_method')!r}); quantize a float checkpoint")
    os.makedirs(out, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    quantized = 0
    for name, tensor, is_linear in hf_tensors(loaded):
        if not is_linear:
            tensors[name] = tensor
            continue
        stem = name.removesuffix(".weight")
        if scheme in INT4_SCHEMES:
            tensors.update(int4_tensors(stem, tensor, scheme, group_size))
            quantized += 1
            continue
        if scheme == "fp8":
            w = quantize_fp8(tensor, per_channel)
            codes, scale = w.codes, w.scale if per_channel else w.scale[:1]
        else:
            codes, scale = quantize_int8(tensor, per_channel, group_size)
        tensors[f"{stem}.weight"] = codes.contiguous()
        tensors[f"{stem}.weight_scale"] = (scale if group_size else scale.reshape(-1, 1) if per_channel
                                           else scale.reshape(1)).float().contiguous()
        quantized += 1
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    hf_config["quantization_config"] = (int4_quantization_config(scheme, group_size) if scheme in INT4_SCHEMES
                                        else quantization_config(scheme, per_channel, group_size))
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=1)
    if raw is not None:
        for name in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(raw, name)):
                shutil.copy(os.path.join(raw, name), os.path.join(out, name))
    else:
        write_gguf_tokenizer(source.path, out)
    return {"wrote": os.path.abspath(out), "scheme": scheme, "per_channel": per_channel, "group_size": group_size,
            "quantized_layers": quantized, "bytes": os.path.getsize(os.path.join(out, "model.safetensors"))}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a Hugging Face checkpoint directory, a .gguf file or a model "
                                                 "name (default: the default model)")
    p.add_argument("--scheme", required=True, choices=SCHEMES,
                   help="fp8 (e4m3) or int8 weights and activations; awq or gptq 4-bit weights")
    p.add_argument("--per-channel", action="store_true", help="one weight scale per output feature (default: "
                                                              "one per tensor)")
    p.add_argument("--group-size", type=int, default=0,
                   help="one weight scale per group of this many input features (a multiple of 32): int8 "
                        "(compressed-tensors' 'group' strategy, which Troupe runs on the CPU only), awq and "
                        "gptq (default 128)")
    p.add_argument("-o", "--output", required=True, help="the directory to write")


def main(argv: list[str] | None = None, prog: str = "python -m tools.quantize") -> None:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    print(json.dumps(quantize_checkpoint(args.model, args.scheme, args.per_channel, args.output, args.group_size)),
          flush=True)


if __name__ == "__main__":
    main()
