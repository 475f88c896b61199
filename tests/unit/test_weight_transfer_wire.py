"""Weight transfer's wire (actors/worker/weight_transfer.py): the packed buffers both sides
compute from the same metadata, vLLM's update info checked at the edge, and the
--weight-transfer-config flag."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.engine.args import EngineArgs
from actors.worker.weight_transfer import ALIGN, packed_chunks, parse_update_info, update_info_of

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.float64]
metas = st.lists(st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 40), min_size=0, max_size=3)),
                 max_size=30).map(lambda ms: [(f"p{i}", d, tuple(s)) for i, (d, s) in enumerate(ms)])


def _nbytes(dtype, shape) -> int:
    return torch.empty(shape, dtype=dtype).numel() * dtype.itemsize


@settings(max_examples=300, deadline=None)
@given(metas, st.integers(1, 20_000))
def test_packed_buffers_hold_every_tensor_once_in_order_aligned_and_within_the_limit(ms, limit):
    chunks = packed_chunks(ms, limit)
    placed = [i for _, items in chunks for i, _, _ in items]
    assert placed == [i for i, (_, d, s) in enumerate(ms) if _nbytes(d, s)]     # empty tensors travel by metadata
    for size, items in chunks:
        assert size > 0 and (size <= limit or len(items) == 1)                  # one bigger than the limit: alone
        end = 0
        for i, offset, n in items:
            _, dtype, shape = ms[i]
            assert n == _nbytes(dtype, shape)
            assert offset % ALIGN == 0 and offset >= end                       # a view of any dtype, no overlap
            end = offset + n
        assert end == size


def test_update_info_round_trips_and_bad_metadata_is_refused_naming_it():
    ms = [("model.norm.weight", torch.bfloat16, (64,)), ("lm_head.weight", torch.float32, (128, 64))]
    info = update_info_of(ms)
    assert info == {"names": ["model.norm.weight", "lm_head.weight"], "dtype_names": ["bfloat16", "float32"],
                    "shapes": [[64], [128, 64]]}
    assert parse_update_info(info) == ms
    for bad, message in [({**info, "dtype_names": ["bfloat16"]}, "same size as `names`"),
                         ({**info, "shapes": [[64]]}, "same size as `names`"),
                         ({**info, "dtype_names": ["bfloat16", "float33"]}, "float33.*not a torch dtype"),
                         ({**info, "dtype_names": ["bfloat16", "Tensor"]}, "not a torch dtype"),
                         ({**info, "shapes": [[64], [128, -1]]}, "non-negative"),
                         ({**info, "shapes": [[64], [128, True]]}, "non-negative"),
                         ({**info, "ipc_handles": {}}, "unsupported update_info field"),
                         ({"names": ["x"]}, "needs the lists"),
                         ([1], "must be a JSON object")]:
        with pytest.raises(ValueError, match=message):
            parse_update_info(bad)


def test_weight_transfer_config_takes_vllms_json_and_refuses_what_troupe_lacks():
    assert EngineArgs().create_engine_config().weight_transfer is None
    config = EngineArgs(weight_transfer_config='{"backend": "gloo", "timeout_s": 30}').create_engine_config()
    assert (config.weight_transfer.backend, config.weight_transfer.timeout_s) == ("gloo", 30)
    assert EngineArgs(weight_transfer_config={"backend": "nccl"}).create_engine_config().weight_transfer.backend == "nccl"
    for bad, message in [('{"backend": "ipc"}', "'ipc' is not one Troupe has; choose gloo or nccl"),
                         ('{"backend": "gloo", "packed": true}', "unsupported weight transfer config field"),
                         ('{"timeout_s": 0}', "timeout_s must be positive"),
                         ('{"timeout_s": 900}', "at most 540"),
                         ("gloo", "not valid JSON")]:
        with pytest.raises(ValueError, match=message):
            EngineArgs(weight_transfer_config=bad).create_engine_config()


def test_every_control_route_needs_the_api_key_when_one_is_set():
    from actors.frontend import control
    from actors.frontend.app import PROTECTED_PATHS
    paths = [path for _, path, _ in control.ROUTES + control.PROFILE_ROUTES]
    assert "/update_weights" in paths and "/weight_checker" in paths
    assert [p for p in paths if not p.startswith(PROTECTED_PATHS)] == []


def test_a_gguf_model_served_for_weight_transfer_holds_float32_copies_not_blocks():
    from actors.engine.config import exact_from_gguf_blocks
    assert exact_from_gguf_blocks("m.gguf", None, "float32", "cpu", 1)
    assert not exact_from_gguf_blocks("m.gguf", None, "float32", "cpu", 1, weight_transfer=True)
