"""Our GGUF loader on every tensor type the gguf package can dequantize: small synthetic tensors
written with gguf.GGUFWriter (quantized with gguf.quants.quantize where it can, random blocks
otherwise), read back through our header parser and dequantizer."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize

from models.gguf_loader import dequantize_tensor, read_gguf

ROWS, COLS = 3, 512   # 512 is a multiple of every block size (32, 64, 128, 256)
# max |dequantize(quantize(x)) - x| for x ~ N(0, 1), per type that gguf can quantize
TOLERANCE = {"F32": 0, "F16": 2e-3, "BF16": 2e-2, "Q8_0": 3e-2, "Q5_0": 0.2, "Q5_1": 0.2, "Q4_0": 0.4,
             "Q4_1": 0.4, "TQ1_0": 4.0, "TQ2_0": 4.0, "MXFP4": 1.5}


def _can(fn, qtype: GGMLQuantizationType, data: np.ndarray) -> bool:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fn(data, qtype)
        return True
    except NotImplementedError:
        return False


def _raw_zero(qtype: GGMLQuantizationType) -> np.ndarray:
    block, size = GGML_QUANT_SIZES[qtype]
    return np.zeros((1, COLS // block * size), dtype=np.uint8)


DEQUANTIZABLE = [t for t in GGMLQuantizationType if t not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16)
                 and COLS % GGML_QUANT_SIZES[t][0] == 0 and _can(dequantize, t, _raw_zero(t))]
QUANTIZABLE = {t for t in DEQUANTIZABLE if _can(quantize, t, np.zeros((1, COLS), np.float32))}


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    """A GGUF holding one (ROWS, COLS) tensor per dequantizable type, plus F32/F16 and a 1-D norm."""
    rng = np.random.default_rng(0)
    path = str(tmp_path_factory.mktemp("gguf") / "types.gguf")
    writer = GGUFWriter(path, "llama")
    originals = {}
    x = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    writer.add_tensor("t.F32", x)
    writer.add_tensor("t.F16", x.astype(np.float16))
    writer.add_tensor("norm.F32", x[0, :7].copy())
    originals.update({"t.F32": x, "t.F16": x, "norm.F32": x[0, :7]})
    for qtype in DEQUANTIZABLE:
        if qtype in QUANTIZABLE:
            raw = quantize(x, qtype)
            originals[f"t.{qtype.name}"] = x
        else:   # random blocks: exercises the byte layout, not the numerics (the scales may be inf/nan)
            block, size = GGML_QUANT_SIZES[qtype]
            raw = rng.integers(0, 256, (ROWS, COLS // block * size), dtype=np.uint8)
        writer.add_tensor(f"t.{qtype.name}", raw, raw_dtype=qtype)  # shape from the bytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, originals


def test_every_type_matches_the_gguf_reference(gguf_file):
    path, _ = gguf_file
    ours = read_gguf(path)
    reader = GGUFReader(path)
    data = np.memmap(path, mode="r")
    assert {"Q4_K", "Q5_K", "Q6_K", "Q8_0", "BF16", "Q4_0", "Q4_1", "Q5_0", "IQ4_XS"} <= {t.name for t in DEQUANTIZABLE}
    assert len(reader.tensors) == len(DEQUANTIZABLE) + 3
    for t in reader.tensors:
        info = ours.tensors[t.name]
        assert info.ggml_type == t.tensor_type and info.shape == tuple(reversed(t.shape.tolist()))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            expected = torch.from_numpy(dequantize(t.data, t.tensor_type).astype(np.float32)).reshape(info.shape)
            got = dequantize_tensor(data, info)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, expected, atol=0, rtol=0, equal_nan=True, msg=t.name)


def test_quantized_values_are_close_to_the_originals(gguf_file):
    path, originals = gguf_file
    ours = read_gguf(path)
    data = np.memmap(path, mode="r")
    checked = set()
    for name, x in originals.items():
        qname = name.split(".", 1)[1]
        got = dequantize_tensor(data, ours.tensors[name]).numpy()
        assert got.shape == x.shape
        assert np.abs(got - x).max() <= TOLERANCE[qname], qname
        checked.add(qname)
    assert {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q5_0"} <= checked


def test_type_without_dequantizer_names_itself(tmp_path):
    path = str(tmp_path / "q8k.gguf")
    writer = GGUFWriter(path, "llama")
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType.Q8_K]
    writer.add_tensor("t", np.zeros((1, 256 // block * size), np.uint8),
                      raw_dtype=GGMLQuantizationType.Q8_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    info = read_gguf(path).tensors["t"]
    with pytest.raises(ValueError, match="tensor t: the gguf package cannot dequantize Q8_K"):
        dequantize_tensor(np.memmap(path, mode="r"), info)
