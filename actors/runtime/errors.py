"""Errors the actor runtime raises at callers: each names the actor and the message involved."""
from __future__ import annotations


class ActorError(Exception):
    """Base of every runtime error."""


class MessageRejected(ActorError, TypeError):
    """A message outside the target actor's declared protocol (or undecodable) was refused."""


class MailboxFull(ActorError):
    """The target's user lane is at capacity: the message is refused at once."""


class Refusal(Exception):
    """Raised by a handler that will not serve a message as asked because of the message (a
    client's bad input, a request over a limit): the asker gets it as an error reply, and it is
    logged in one line at INFO; it is not the actor's failure (no traceback, no supervision)."""


class AskTimeout(ActorError, TimeoutError):
    """No reply arrived before the ask's deadline."""


class ActorDied(ActorError):
    """The target actor, or the process it lives in, stopped before replying."""


class RemoteError(ActorError):
    """A handler raised while serving an ask; carries the remote type and traceback."""

    def __init__(self, actor: str, message_type: str, error_type: str, message: str,
                 traceback: str = "") -> None:
        super().__init__(f"{actor} failed handling {message_type}: {error_type}: {message}")
        self.actor = actor
        self.message_type = message_type
        self.error_type = error_type
        self.message = message
        self.remote_traceback = traceback


class Refused(Refusal):
    """A request refused (bad input) by an actor further on, passed back through the actors
    between (``passed_on``) as a refusal of theirs."""


class TimedOut(Refusal):
    """A request that an actor further on did not answer in time, passed back the same way."""


class CallFailed(Refusal):
    """Code the caller had run inside an actor (a function, a method of its extension) raised:
    the caller's failure, passed back the same way, not the actor's (it serves on)."""


def passed_on(exc: RemoteError) -> Exception:
    """What an actor that passed a request on raises for the error its asker got: a refusal
    (Refused) or a timeout (TimedOut) as its own refusal of the same kind and message (no
    supervision), any other error as it is."""
    if exc.error_type == "Refused":
        return Refused(exc.message)
    if exc.error_type in ("TimedOut", "AskTimeout"):
        return TimedOut(exc.message)
    if exc.error_type == "CallFailed":
        return CallFailed(exc.message)
    return exc


class ChildStartError(RuntimeError):
    """A child process (node) did not become ready: it exited, timed out, or said why it failed."""
