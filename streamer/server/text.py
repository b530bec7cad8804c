"""Text around generation: ChatML rendering of OpenAI messages (as `chat` renders its turns), stop strings
that hold back what could still become one, and the split of a Qwen3 <think> block into reasoning_content."""

from __future__ import annotations

import re

from streamer.chat import EMPTY_THINK

ROLES = ("system", "user", "assistant")
_SWITCH = re.compile(r"/(no_)?think\b")


def thinking(messages: list[dict], enable: bool | None) -> bool:
    """Thinking on unless the request turns it off: chat_template_kwargs.enable_thinking, else Qwen3's soft
    switch, the last `/think` or `/no_think` in a system or user message (the most recent one wins)."""
    if enable is not None:
        return enable
    think = True
    for m in messages:
        if m["role"] != "assistant":
            for s in _SWITCH.finditer(m["content"]):
                think = s.group(1) is None
    return think


def render_chat(messages: list[dict], think: bool, replies: dict | None = None) -> str:
    """The ChatML prompt, ending with the assistant's header (and the empty think block when thinking is
    off, as `chat --no-think` does). An assistant message whose content is one of our own recent replies is
    rendered as we generated it (its think block kept, as `chat` keeps it in the cache), so a multi-turn
    conversation finds its whole history in the KV cache."""
    replies = replies or {}
    out = []
    for m in messages:
        body = replies.get(m["content"], m["content"]) if m["role"] == "assistant" else m["content"]
        out.append(f"<|im_start|>{m['role']}\n{body}<|im_end|>\n")
    out.append("<|im_start|>assistant\n" + ("" if think else EMPTY_THINK))
    return "".join(out)


class StopMatcher:
    """Streams text through, ending at the first stop string. Text that could be the start of a stop string
    is held back until it is known not to be one."""

    def __init__(self, stops=()):
        self.stops = tuple(s for s in stops if s)
        self.buf = ""
        self.stopped = False

    def push(self, text: str) -> str:
        """The text now safe to emit; sets `stopped` when a stop string is found (it and what follows are
        dropped)."""
        if self.stopped:
            return ""
        self.buf += text
        if not self.stops:
            out, self.buf = self.buf, ""
            return out
        hits = [i for i in (self.buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.buf, self.stopped = self.buf[: min(hits)], "", True
            return out
        hold = 0  # the longest tail of buf that is a proper prefix of some stop string
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.buf)), hold, -1):
                if self.buf.endswith(s[:k]):
                    hold = k
                    break
        out = self.buf[: len(self.buf) - hold]
        self.buf = self.buf[len(out) :]
        return out

    def flush(self) -> str:
        out, self.buf = ("" if self.stopped else self.buf), ""
        return out


class ThinkSplitter:
    """Routes a reply's text to (reasoning, content): a reply that opens with `<think>` (after whitespace)
    has everything up to `</think>` as reasoning, the rest (leading blank lines dropped) as content, as
    llama-server returns reasoning_content. Holds back text that could still be part of either tag."""

    OPEN, CLOSE = "<think>", "</think>"

    def __init__(self, enabled: bool = True):
        self.state = "start" if enabled else "content"
        self.buf = ""

    def push(self, text: str) -> tuple[str, str]:
        self.buf += text
        reasoning = content = ""
        while True:
            if self.state == "start":
                s = self.buf.lstrip()
                if s.startswith(self.OPEN):
                    self.buf, self.state = s[len(self.OPEN) :], "opened"
                    continue
                if self.OPEN.startswith(s):  # empty, or a prefix of the tag: wait for more
                    return reasoning, content
                self.state = "content"
            elif self.state == "opened":  # drop the newlines after <think>
                self.buf = self.buf.lstrip("\n")
                if not self.buf:
                    return reasoning, content
                self.state = "reasoning"
            elif self.state == "reasoning":
                i = self.buf.find(self.CLOSE)
                if i >= 0:
                    reasoning += self.buf[:i].rstrip("\n")
                    self.buf, self.state = self.buf[i + len(self.CLOSE) :], "after"
                    continue
                head = self.buf[: len(self.buf) - _partial_tail(self.buf, self.CLOSE)]
                keep = len(self.buf) - len(head.rstrip("\n"))  # a partial tag and the newlines before it
                reasoning += self.buf[: len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep :]
                return reasoning, content
            elif self.state == "after":  # drop the blank lines between </think> and the answer
                s = self.buf.lstrip("\n")
                if not s:
                    self.buf = ""
                    return reasoning, content
                self.buf, self.state = s, "content"
            else:
                content += self.buf
                self.buf = ""
                return reasoning, content

    def flush(self) -> tuple[str, str]:
        """Whatever is held at the end: an unclosed think block is reasoning, anything else content."""
        out, self.buf = self.buf, ""
        if self.state in ("opened", "reasoning"):
            return out.rstrip("\n"), ""
        return "", ("" if self.state == "after" else out)


def _partial_tail(buf: str, tag: str) -> int:
    """Length of the longest tail of buf that is a proper prefix of tag."""
    for k in range(min(len(tag) - 1, len(buf)), 0, -1):
        if buf.endswith(tag[:k]):
            return k
    return 0
