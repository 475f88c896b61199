"""The Responses API's store keeps the newest responses within a count and a byte budget."""
from __future__ import annotations

from actors.frontend.responses import ResponseStore, Stored


def stored(text: str) -> Stored:
    return Stored({"id": "x", "output": text}, [{"role": "user", "content": text}], [])


def test_the_store_keeps_the_newest_within_its_count_and_bytes():
    store = ResponseStore(capacity=3, max_bytes=20_000)      # each text below is stored twice (about 2 bytes a char)
    for i in range(5):
        store.put(f"r{i}", stored("a" * 10))
    assert len(store) == 3 and store.get("r0") is None and store.get("r4") is not None
    store.put("big", stored("b" * 3_000))
    store.put("bigger", stored("c" * 3_000))
    assert store.get("big") is not None and store.get("bigger") is not None and store.nbytes <= 20_000
    store.put("huge", stored("d" * 4_500))            # the oldest go until it fits beside the rest
    assert store.get("huge") is not None and store.get("bigger") is not None
    assert store.get("big") is None and store.get("r4") is None and store.nbytes <= 20_000
    store.put("too-big", stored("e" * 12_000))        # larger than the whole budget: not kept
    assert store.get("too-big") is None and store.get("huge") is not None


def test_storing_an_id_again_replaces_it_and_its_bytes():
    store = ResponseStore(capacity=10, max_bytes=10_000)
    store.put("r", stored("a" * 1_000))
    before = store.nbytes
    store.put("r", stored("a" * 10))
    assert len(store) == 1 and store.nbytes < before and store.get("r").body["output"] == "a" * 10
