"""The scheduler's account of the workers' encoder cache (vLLM's EncoderCacheManager).

A prompt's image becomes embeddings in the model's encoder once, on the first step that
computes any of its positions; the workers keep them by the image's identifier (a digest of the
image and its processing) for the later steps over its positions, and for other requests that
hold the same image. Here the scheduler keeps what the workers hold, measured in embeddings:

- an entry is *referenced* by the requests whose computed positions have reached the image and
  not yet passed it; a referenced entry stays;
- an entry no request references is *freeable*: it stays for a later request with the same image,
  and is evicted, oldest first, when a new image needs its room; the evicted identifiers go to
  the workers with the next step (``take_freed``), which drop them before that step's encoding.

The cache holds ``cache_size`` embeddings (vLLM's encoder_cache_size). An image larger than the
whole cache still gets in, alone: once nothing else is referenced, everything is evicted for it
and the cache runs over its size until the image is freed (vLLM floors the cache at the model's
largest item; here the floor is the largest item that comes).
"""
from __future__ import annotations

from collections import OrderedDict

from actors.engine.messages import MultiModalFeature


class EncoderCache:
    def __init__(self, cache_size: int) -> None:
        if cache_size < 1:
            raise ValueError(f"encoder_cache_size must be at least 1, not {cache_size}")
        self.cache_size = cache_size
        self.sizes: dict[str, int] = {}                    # identifier -> its embeddings
        self.refs: dict[str, set[str]] = {}                # identifier -> requests referencing it
        self.freeable: OrderedDict[str, None] = OrderedDict()   # unreferenced, oldest first
        self.used = 0                                      # embeddings of every entry
        self.referenced = 0                                # embeddings of referenced entries
        self.freed: list[str] = []                         # evicted since the last take_freed
        self.queries = self.hits = 0       # images a scheduled request reached, and of those found cached

    def __contains__(self, identifier: str) -> bool:
        return identifier in self.sizes

    @property
    def num_free(self) -> int:
        return self.cache_size - self.used

    def usage(self) -> float:
        """The share of the cache its entries take (above 1.0 while an oversized image is held)."""
        return self.used / self.cache_size

    def reference(self, feature: MultiModalFeature, request_id: str) -> bool:
        """Whether the image is cached; if so, ``request_id`` now references it (a query and a hit)."""
        if feature.identifier not in self.refs:
            return False
        self.queries += 1
        self.hits += 1
        self._reference(feature.identifier, request_id)
        return True

    def _reference(self, ident: str, request_id: str) -> None:
        holders = self.refs[ident]
        if not holders:
            del self.freeable[ident]
            self.referenced += self.sizes[ident]
        holders.add(request_id)

    def can_allocate(self, num_embeds: int, pending: int) -> bool:
        """Whether an image of ``num_embeds`` embeddings fits beside the ``pending`` ones this step
        already placed, evicting unreferenced entries (oldest first) for it if need be."""
        need = num_embeds + pending
        if need > self.cache_size:       # larger than the cache: alone, once nothing else is referenced
            if pending or self.referenced:
                return False
            self._evict_until(self.used)
            return True
        if need <= self.num_free:
            return True
        if need > self.cache_size - self.referenced:
            return False
        self._evict_until(need - self.num_free)
        return True

    def _evict_until(self, num_embeds: int) -> None:
        freed = 0
        while freed < num_embeds and self.freeable:
            ident, _ = self.freeable.popitem(last=False)
            size = self.sizes.pop(ident)
            del self.refs[ident]
            self.used -= size
            freed += size
            self.freed.append(ident)

    def allocate(self, feature: MultiModalFeature, request_id: str) -> None:
        """Room for the image the workers encode this step, referenced by ``request_id``
        (``can_allocate`` said it fits)."""
        ident = feature.identifier
        if ident in self.sizes:          # the prompt holds it twice: one encoding
            self._reference(ident, request_id)
            return
        size = feature.num_embeds
        self.queries += 1                # a query that missed
        self.sizes[ident] = size
        self.refs[ident] = {request_id}
        self.used += size
        self.referenced += size

    def release(self, feature: MultiModalFeature, request_id: str) -> None:
        """``request_id`` no longer needs the image (its positions are computed, or it ended); an
        entry nobody references stays, freeable."""
        ident = feature.identifier
        holders = self.refs.get(ident)
        if not holders or request_id not in holders:
            return
        holders.discard(request_id)
        if not holders:
            self.freeable[ident] = None
            self.referenced -= self.sizes[ident]

    def discard(self, feature: MultiModalFeature) -> bool:
        """Forget an entry nobody references (allocated for a step that no longer encodes it);
        whether it was forgotten."""
        ident = feature.identifier
        if self.refs.get(ident) != set():
            return False
        del self.freeable[ident], self.refs[ident]
        self.used -= self.sizes.pop(ident)
        self.freed.append(ident)
        return True

    def take_freed(self) -> list[str]:
        """The identifiers evicted since the last call: the workers drop their embeddings."""
        freed, self.freed = self.freed, []
        return freed

    def reset(self) -> None:
        """Forget every entry (the workers drop theirs too: vLLM's reset_encoder_cache)."""
        self.sizes.clear()
        self.refs.clear()
        self.freeable.clear()
        self.freed.clear()
        self.used = self.referenced = 0
