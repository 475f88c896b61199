"""Admission control: the requests (and their prompt tokens) the frontend has handed to the engine
that the engine has not scheduled yet. Past the config's bounds (``max_waiting_requests``,
``max_waiting_tokens``; 0: none) a new request is refused at once, HTTP 503 with Retry-After,
instead of queuing without limit. Shared by the frontend's actors in one event loop: the
EngineClient checks for room, the Tokenizer admits, the Detokenizer releases."""
from __future__ import annotations

from actors.runtime import Refusal

RETRY_AFTER_S = 1.0


class Overloaded(Refusal):
    """Too many requests wait already; ``retry_after`` seconds is a fair time to try again."""

    def __init__(self, message: str, retry_after: float = RETRY_AFTER_S) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class WaitingRequests:
    def __init__(self, max_requests: int = 0, max_tokens: int = 0) -> None:
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self._tokens: dict[str, int] = {}        # request id -> prompt tokens, until scheduled
        self.num_tokens = 0

    def __len__(self) -> int:
        return len(self._tokens)

    def check_room(self) -> None:
        """Raise Overloaded when no request can wait now (checked before tokenizing)."""
        if self.max_requests and len(self._tokens) >= self.max_requests:
            raise Overloaded(f"the server is overloaded: {len(self._tokens)} requests are waiting "
                             f"(--max-waiting-requests {self.max_requests}); retry shortly")

    def admit(self, request_id: str, num_prompt_tokens: int) -> None:
        """Count a tokenized request as waiting, or raise Overloaded. A request alone is always
        admitted, however long its prompt."""
        self.check_room()
        if self.max_tokens and self._tokens and self.num_tokens + num_prompt_tokens > self.max_tokens:
            raise Overloaded(f"the server is overloaded: {self.num_tokens} prompt tokens are waiting "
                             f"(--max-waiting-tokens {self.max_tokens}); retry shortly")
        self._tokens[request_id] = num_prompt_tokens
        self.num_tokens += num_prompt_tokens

    def release(self, request_id: str) -> None:
        """The request was scheduled, finished or dropped: it waits no more."""
        self.num_tokens -= self._tokens.pop(request_id, 0)

    def release_all(self) -> None:
        self._tokens.clear()
        self.num_tokens = 0
