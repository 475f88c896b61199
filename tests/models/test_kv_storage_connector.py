"""ExampleConnector (SharedStorageConnector): a prompt's KV saved layer by layer to a directory
during the forward that computes it, and loaded by another instance that meets the same prompt
(or one starting with the same blocks). Each instance is a real Worker, Scheduler and KV manager
over the default model (SmolLM2 135M) in this process; the second instance is new, so whatever it
does not compute it can only have read from the directory."""
from __future__ import annotations

import json
import os
import time

import pytest

from actors.kv_transfer.config import KVTransferConfig
from tests.e2e.server import free_ports
from tools.bench.kv_storage import LocalEngine

pytestmark = pytest.mark.slow

PROMPT = [1] + [100 + (7919 * i) % 30000 for i in range(150)]       # 151 tokens: 9 full blocks of 16
NUM_NEW = 6


class Instance(LocalEngine):
    """An engine in this process whose connector's layer saves are recorded."""

    def __init__(self, path: str, role: str = "kv_both", block_size: int = 16, prefix_caching: bool = True,
                 **extra) -> None:
        super().__init__(kv_transfer_config={"kv_connector": "ExampleConnector", "kv_role": role,
                                             "kv_connector_extra_config": {"shared_storage_path": path, **extra}},
                         kv_cache_bytes=32 << 20, block_size=block_size, enable_prefix_caching=prefix_caching)
        self.saved_layers: list[int] = []          # the layers whose saves ran, in order
        save = self.connector.save_kv_layer

        def recording(layer, kv_layer, meta):
            self.saved_layers.append(layer)
            return save(layer, kv_layer, meta)
        self.connector.save_kv_layer = recording

    def run(self, rid: str, prompt: list[int], max_tokens: int = NUM_NEW) -> tuple[list[int], list[float]]:
        """The request's greedy tokens and their log-probabilities, once its saves are written."""
        tokens, logprobs, _ = super().run(rid, prompt, max_tokens)
        self.connector.flush()
        return tokens, logprobs

    def stats(self):
        return self.scheduler.stats()


def run_once(path: str, rid: str, prompt: list[int], **kw) -> tuple[list[int], list[float], object]:
    """A new instance on ``path`` runs one request: its tokens, log-probs and the scheduler's stats."""
    inst = Instance(path, **kw)
    try:
        tokens, logprobs = inst.run(rid, prompt)
        return tokens, logprobs, inst.stats()
    finally:
        inst.close()


def entries(path: str) -> list[str]:
    (layout,) = os.listdir(os.path.join(path, "troupe-kv"))
    root = os.path.join(path, "troupe-kv", layout, "entries")
    return [os.path.join(root, e) for e in sorted(os.listdir(root)) if not e.startswith(".")]


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """A first instance computed PROMPT (and saved it), then was closed."""
    path = str(tmp_path_factory.mktemp("kv-storage"))
    first = Instance(path)
    try:
        tokens, logprobs = first.run("first", PROMPT)
        layers = list(first.saved_layers)
        stats = first.stats()
    finally:
        first.close()
    return path, tokens, logprobs, layers, stats


def test_the_prompt_is_saved_layer_by_layer_during_its_forward(stored):
    path, _, _, layers, stats = stored
    num_layers = 30                                      # SmolLM2 135M
    assert layers == list(range(num_layers))             # one save per layer, in the forward's order
    (entry,) = entries(path)                             # (the module's other tests add theirs after)
    meta = json.load(open(os.path.join(entry, "meta.json")))
    assert len(meta["hashes"]) == len(PROMPT) // 16      # the prompt's full blocks
    assert sorted(os.listdir(entry)) == sorted(["meta.json", *(f"layer-{i}.kv" for i in range(num_layers))])
    assert stats.kv_transfer["sent_blocks"] == len(PROMPT) // 16
    assert stats.kv_transfer["sent_bytes"] == meta["bytes"]


def test_a_new_instance_loads_the_prompt_instead_of_computing_it_and_answers_the_same(stored):
    path, tokens, logprobs, _, _ = stored
    again, again_lp, stats = run_once(path, "again", PROMPT)
    assert again == tokens
    assert again_lp == pytest.approx(logprobs, abs=1e-4)
    # every full block but the one holding the prompt's last token: (151 - 1) // 16 = 9 blocks
    assert stats.external_prefix_cache_hits == 9 * 16
    assert stats.kv_transfer["recv_blocks"] == 9
    assert stats.kv_transfer.get("recv_failures", 0) == 0


def test_a_prompt_sharing_the_first_blocks_loads_them_and_computes_the_rest(stored):
    path, _, _, _, _ = stored
    other = PROMPT[:100] + [7, 8, 9] * 20                # the first 6 blocks are PROMPT's
    computed = run_once(os.path.join(path, "elsewhere"), "computed", other)[0]
    loaded, _, stats = run_once(path, "shares", other)
    assert loaded == computed
    assert stats.external_prefix_cache_hits == 6 * 16


def test_a_damaged_entry_is_computed_here_with_the_same_answer(stored, tmp_path):
    path, tokens, _, _, _ = stored
    import shutil
    copy = str(tmp_path / "copy")
    shutil.copytree(path, copy, symlinks=True)
    for entry in entries(copy):
        with open(os.path.join(entry, "layer-7.kv"), "r+b") as f:
            f.truncate(100)                              # a layer's file cut short
    again, _, stats = run_once(copy, "damaged", PROMPT, role="kv_consumer")
    assert again == tokens
    assert stats.kv_transfer["recv_failures"] == 1
    assert stats.external_prefix_cache_hits == 0


def test_an_instance_of_another_block_size_never_reads_the_entries(stored):
    path, tokens, _, _, _ = stored
    again, _, stats = run_once(path, "bs32", PROMPT, role="kv_consumer", block_size=32)
    assert again == tokens
    assert stats.external_prefix_cache_hits == 0
    assert len(os.listdir(os.path.join(path, "troupe-kv"))) == 2      # a layout directory of its own


def test_past_max_storage_gb_the_least_recently_used_entries_go(tmp_path):
    one = PROMPT[:65]                                     # 4 full blocks: 2.95 MB on disk
    two = [1] + [200 + (104729 * i) % 30000 for i in range(64)]
    three = [1] + [300 + (7907 * i) % 30000 for i in range(64)]
    # room for two entries; no local prefix cache, so a prompt seen before is loaded or computed
    inst = Instance(str(tmp_path), prefix_caching=False, max_storage_gb=7e6 / 2**30)
    try:
        inst.run("one", one, 1)
        inst.run("two", two, 1)
        time.sleep(0.02)
        inst.run("one-again", one, 1)                     # loaded: "one" is now the most recent
        inst.run("three", three, 1)                       # over the limit: "two" goes
        hits = inst.stats().external_prefix_cache_hits
    finally:
        inst.close()
    assert hits == 64
    assert len(entries(str(tmp_path))) == 2
    reader = Instance(str(tmp_path), role="kv_consumer", prefix_caching=False)
    try:
        for rid, prompt in (("two", two), ("one", one), ("three", three)):
            before = reader.stats().external_prefix_cache_hits
            reader.run(rid, prompt, 1)
            loaded = reader.stats().external_prefix_cache_hits - before
            assert loaded == (0 if rid == "two" else 64), rid
    finally:
        reader.close()
    restarted = Instance(str(tmp_path), prefix_caching=False, max_storage_gb=7e6 / 2**30)
    try:                                                  # counts the entries it finds
        restarted.run("four", [1] + [400 + (7901 * i) % 30000 for i in range(64)], 1)
    finally:
        restarted.close()
    assert len(entries(str(tmp_path))) == 2


def test_a_multi_connector_moves_the_prompt_to_a_decode_instance_and_keeps_it_on_storage(stored, tmp_path):
    """TroupeConnector and ExampleConnector in one MultiConnector: the decode instance loads the
    prompt from the prefill instance (the first connector that holds it); a later instance with
    no transfer params loads it from the storage the prefill instance also saved it to."""
    _, tokens, _, _, _ = stored
    path, port = str(tmp_path), free_ports(4)

    def multi(role: str) -> dict:
        return {"kv_connector": "MultiConnector", "kv_role": role, "kv_connector_extra_config": {"connectors": [
            {"kv_connector": "TroupeConnector", "kv_port": port},
            {"kv_connector": "ExampleConnector", "kv_connector_extra_config": {"shared_storage_path": path}}]}}
    prefill = LocalEngine(kv_transfer_config=multi("kv_producer"), kv_cache_bytes=32 << 20)
    decode = later = None
    try:
        prefill.run("prefill", PROMPT, 1, kv_transfer_params={"do_remote_decode": True})
        params = prefill.kv_transfer_params
        assert params["do_remote_prefill"] and params["remote_port"] == port
        assert prefill.kv.num_blocks_held("prefill") > 0          # held for the decode instance
        decode = LocalEngine(kv_transfer_config=multi("kv_consumer"), kv_cache_bytes=32 << 20)
        assert decode.run("decode", PROMPT, NUM_NEW, kv_transfer_params=params)[0] == tokens
        stats = decode.scheduler.stats()
        assert stats.external_prefix_cache_hits == len(PROMPT) - 1     # from the prefill instance
        assert stats.kv_transfer["cma_reads"] == 1
        prefill.poll(lambda: prefill.kv.num_blocks_held("prefill") == 0)   # read, released, freed
        prefill.connector.connectors[1].flush()
        later = LocalEngine(kv_transfer_config=multi("kv_consumer"), kv_cache_bytes=32 << 20)
        assert later.run("later", PROMPT, NUM_NEW)[0] == tokens
        assert later.scheduler.stats().external_prefix_cache_hits == 9 * 16   # from the storage
    finally:
        for e in (prefill, decode, later):
            if e is not None:
                e.close()


def test_bad_storage_config_is_refused_naming_the_key():
    with pytest.raises(ValueError, match="max_storage_gb"):
        KVTransferConfig.from_dict({"kv_connector": "ExampleConnector",
                                    "kv_connector_extra_config": {"max_storage_gb": -1}})
    with pytest.raises(ValueError, match="shared_storage_pth"):
        KVTransferConfig.from_dict({"kv_connector": "SharedStorageConnector",
                                    "kv_connector_extra_config": {"shared_storage_pth": "/tmp"}})
    with pytest.raises(ValueError, match=r"connectors\[1\]: unknown kv_connector_extra_config key\(s\) for "
                                         "ExampleConnector: path"):
        KVTransferConfig.from_dict({"kv_connector": "MultiConnector", "kv_connector_extra_config": {"connectors": [
            {"kv_connector": "TroupeConnector"},
            {"kv_connector": "ExampleConnector", "kv_connector_extra_config": {"path": "/tmp"}}]}})


def test_a_bfloat16_cache_is_saved_and_loaded_into_another_instance(tmp_path):
    """The entries hold the cache's bytes whatever its dtype: a bfloat16 cache (numpy has no
    bfloat16) saves and loads, and the loading instance answers as a plain one."""
    import torch

    from tests.helpers import save_tiny_llama
    model = save_tiny_llama(tmp_path / "tiny", 256, 128, 256, 4, 2, 32, 512)
    prompt = [1] + [3 + (37 * i) % 250 for i in range(59)]          # 3 full blocks before the last
    kv = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
          "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "kv")}}
    common = dict(dtype="bfloat16", block_size=16, max_model_len=512)
    engines = []
    try:
        plain = LocalEngine(model, **common)
        engines.append(plain)
        assert plain.worker.runner.kv_caches[0].dtype == torch.bfloat16
        reference = plain.run("plain", prompt, 8)[0]
        saver = LocalEngine(model, kv_transfer_config=kv, **common)
        engines.append(saver)
        assert saver.run("save", prompt, 8)[0] == reference
        assert saver.connector.flush()
        loader = LocalEngine(model, kv_transfer_config=kv, **common)
        engines.append(loader)
        assert loader.run("load", prompt, 8)[0] == reference
        assert loader.scheduler.stats().external_prefix_cache_hits == 3 * 16
    finally:
        for e in engines:
            e.close()
