"""The actor runtime: typed actors, local and remote refs, supervision, processes, tracing."""
from actors.runtime.actor import Actor, ActorContext
from actors.runtime.errors import (ActorDied, ActorError, AskTimeout, MailboxFull,
                                   MessageRejected, Refusal, RemoteError)
from actors.runtime.messages import Msg, Ping, Pong, Stop
from actors.runtime.node import Failure, Node
from actors.runtime.ref import ActorRef, LocalRef, RemoteRef

__all__ = ["Actor", "ActorContext", "ActorDied", "ActorError", "ActorRef", "AskTimeout",
           "Failure", "LocalRef", "MailboxFull", "MessageRejected", "Msg", "Node", "Ping", "Refusal",
           "Pong", "RemoteError", "RemoteRef", "Stop"]
