"""Weights of a Hugging Face checkpoint directory: the tensors of its *.safetensors files
(sharded through model.safetensors.index.json, else every *.safetensors file), named as in the
checkpoint; the model's ``hf_tensor_map`` places them."""
from __future__ import annotations

import glob
import json
import os
from typing import Iterator

import torch
from safetensors import safe_open

INDEX_NAME = "model.safetensors.index.json"
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)  # buffers some old checkpoints saved


def safetensors_files(checkpoint_dir: str) -> list[str]:
    """The weight files, in a stable order."""
    index = os.path.join(checkpoint_dir, INDEX_NAME)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = [os.path.join(checkpoint_dir, name) for name in sorted(set(weight_map.values()))]
        missing = [p for p in files if not os.path.isfile(p)]
        if missing:
            raise FileNotFoundError(f"{INDEX_NAME} names shards that are missing: {missing}")
        return files
    files = sorted(glob.glob(os.path.join(checkpoint_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{checkpoint_dir} has no *.safetensors files (PyTorch .bin checkpoints are "
                                "not supported; convert them with save_pretrained(safe_serialization=True))")
    return files


def iter_safetensors_weights(checkpoint_dir: str, skipped_prefixes: tuple[str, ...] = (),
                             only_prefixes: tuple[str, ...] = ()) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (checkpoint name, tensor in the file's dtype), file after file; tensors named
    with one of ``skipped_prefixes`` (a part the model does not run) are never read, nor, when
    ``only_prefixes`` are given, those named with none of them."""
    for path in safetensors_files(checkpoint_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if name.endswith(IGNORED_SUFFIXES) or name.startswith(skipped_prefixes):
                    continue
                if not only_prefixes or name.startswith(only_prefixes):
                    yield name, f.get_tensor(name)
