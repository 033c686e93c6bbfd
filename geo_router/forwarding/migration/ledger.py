"""What a migratable stream has carried so far: the ledger a continuation is built from.

Token ids are read off the node's events as they arrive (`token_ids`, and the prompt's
`prompt_token_ids` on the first event); text is counted as it leaves for the client. The
two differ by what a node holds back (the start of a possible stop string, half a UTF-8
character): at a seam the router asks the next node to detokenize the ids and sends on
what the client has not seen yet, so nothing is missed and nothing is repeated. Tool
calls are recorded as the client assembles them (id, name, arguments so far, per index):
a continuation's replay of the node's tool parser resumes from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .plan import Api
from .tool_calls import SentCall, record


@dataclass(slots=True)
class StreamLedger:
    """One stream's identity, token ids and delivered text, across all its pieces."""

    api: Api
    id: str | None = None
    created: int | None = None
    model: str | None = None
    system_fingerprint: str | None = None
    prompt_ids: list[int] | None = None
    generated: list[int] = field(default_factory=list)
    delivered: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    usage_sent: bool = False
    tool_calls: list[SentCall] = field(default_factory=list)
    # Something a continuation cannot rebuild was streamed (reasoning).
    unresumable: str | None = None

    @property
    def delivered_text(self) -> str:
        return "".join(self.delivered)

    @property
    def resumable(self) -> bool:
        return self.unresumable is None and self.prompt_ids is not None and self.id is not None

    def read(self, event: dict[str, Any]) -> None:
        """Take in one event of the stream as the client will see it (its ids still on)."""
        if self.id is None and isinstance(event.get("id"), str):
            self.id, self.model = event["id"], event.get("model")
            created = event.get("created")
            self.created = created if isinstance(created, int) else None
        if isinstance(fingerprint := event.get("system_fingerprint"), str):
            self.system_fingerprint = fingerprint
        if isinstance(prompt := event.get("prompt_token_ids"), list):  # chat: on the event
            self.prompt_ids = _ids(prompt)
        if event.get("usage") is not None and not event.get("choices"):
            self.usage_sent = True
        for choice in event.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                self.unresumable = "more than one choice"
                continue
            self._read_choice(choice)

    def read_plain(self, ids: list[int], texts: list[str]) -> None:
        """Take in a stretch of plain events read in bulk (plain_events): their ids and texts,
        all the ledger would have learned from reading each whole."""
        self.generated.extend(ids)
        self.delivered.extend(texts)

    def _read_choice(self, choice: dict[str, Any]) -> None:
        if isinstance(prompt := choice.get("prompt_token_ids"), list):  # completions: on the choice
            self.prompt_ids = _ids(prompt)
        if isinstance(ids := choice.get("token_ids"), list):
            self.generated.extend(_ids(ids))
        if self.api is Api.CHAT:
            delta = choice.get("delta")
            if isinstance(delta, dict):
                if delta.get("reasoning_content") or delta.get("reasoning"):
                    self.unresumable = "reasoning in the stream"
                record(self.tool_calls, delta.get("tool_calls"))
                text = delta.get("content")
            else:
                text = None
        else:
            text = choice.get("text")
        if isinstance(text, str) and text:
            self.delivered.append(text)
        if isinstance(reason := choice.get("finish_reason"), str):
            self.finish_reason = reason

    def usage(self) -> dict[str, int]:
        prompt = len(self.prompt_ids or ())
        return {"prompt_tokens": prompt, "completion_tokens": len(self.generated),
                "total_tokens": prompt + len(self.generated)}


def _ids(values: list[Any]) -> list[int]:
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


# Characters of the text already sent that anchor the seam when a decoder tidied the text
# before it differently (spaces around punctuation, say) from how the stream decoded it.
_ANCHOR_CHARS = 32


def unsent_tail(decoded: str, delivered: str) -> str | None:
    """What of `decoded` (the text all the generated ids make) the client was not sent: the
    text a node held back at the break. None when the two cannot be lined up."""
    if decoded.startswith(delivered):
        return decoded[len(delivered):]
    anchor = delivered[-_ANCHOR_CHARS:]
    ends: list[int] = []
    at = decoded.find(anchor)
    while at >= 0:
        ends.append(at + len(anchor))
        at = decoded.find(anchor, at + 1)
    if not ends:
        return None
    # Tidying moves the seam by a few characters at most: the occurrence nearest it.
    end = min(ends, key=lambda e: abs(e - len(delivered)))
    return decoded[end:]
