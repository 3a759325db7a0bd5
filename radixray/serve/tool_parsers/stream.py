"""The streaming machine every JSON tool-call format shares.

:class:`StreamingCallParser` keeps the text received and not yet decided, and steps a small
state machine over it. Each step decides only from the characters it has (and whether the
generation ended), and waits for more when more could change the decision, so the split does
not depend on how the text was chunked: ``parse`` is the same machine run over the whole
text, which is why a joined stream equals ``parse`` by construction.

What a format adds (hermes, llama3, mistral): how text opens a call region (a marker), the
structure around the call objects (separators, closing markers), and what follows a call.
The shared states read one call object ``{"name": ..., "arguments" | "parameters": {...}}``:

- ``call``: the object's header up to its arguments; the call counts from the moment the
  header is complete with a name among the tools (the name is released then);
- ``args``: the arguments object, released as it grows up to the scanner's safe point
  (json_scan.py); when the generation ends or the JSON breaks before the object closes, the
  call ends with the released prefix plus its closers, so its arguments are still a JSON
  object and the released fragments still add up to them; the unreleased tail is dropped;
- ``trailer``: the rest of the call object after the arguments (its ``}``, or keys a model
  added), dropped;
- ``buffered``: an object whose header is not in that order (``arguments`` first) is read
  whole and becomes a call only if it parses with a known name: nothing of it is released
  before that.

A region that fails before a call commits (a name not among the tools, no name, broken JSON
in the header, the generation ending inside it) is text: its marker and everything read from
it go to the content, and scanning resumes where it failed. Whitespace right before a region
is dropped; whitespace after one is dropped too unless content came before the region (then
it is what separates that content from the text after the region).
"""

from __future__ import annotations

import json
from abc import abstractmethod

from radixray.serve.tool_parsers.base import (
    ParseResult,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallParser,
)
from radixray.serve.tool_parsers.json_scan import JsonScanner

MORE = "more"   # the text so far cannot decide: wait
FAIL = "fail"
_WS = " \t\n\r"

# pieces of a header pattern (see match_seq)
WS = ("ws",)
STR = ("str",)
IDENT = ("ident",)


def lit(*options: str) -> tuple:
    """A literal (or one of several) in a header pattern."""
    return ("lit", options)


CALL_HEADER = (lit("{"), WS, lit('"name"'), WS, lit(":"), WS, STR, WS, lit(","), WS,
               lit('"arguments"', '"parameters"'), WS, lit(":"), WS)


def match_seq(buf: str, pos: int, parts: tuple, at_end: bool):
    """Match ``parts`` in ``buf`` from ``pos``: ``(end, captures)`` on a match, :data:`MORE`
    when ``buf`` ends while it could still match, :data:`FAIL` when it cannot. Captures are
    the decoded JSON strings and identifiers, in order. Whitespace (``WS``) is optional."""
    captures = []
    n = len(buf)
    for part in parts:
        kind = part[0]
        if kind == "ws":
            while pos < n and buf[pos] in _WS:
                pos += 1
            if pos == n and not at_end:
                return MORE
        elif kind == "lit":
            rest = buf[pos:]
            hit = next((o for o in part[1] if rest.startswith(o)), None)
            if hit is not None:
                pos += len(hit)
            elif not at_end and any(o.startswith(rest) for o in part[1]):
                return MORE
            else:
                return FAIL
        elif kind == "str":
            got = _json_string(buf, pos, at_end)
            if not isinstance(got, tuple):
                return got
            pos, value = got
            captures.append(value)
        elif kind == "ident":
            start = pos
            while pos < n and (buf[pos].isalnum() or buf[pos] in "_-."):
                pos += 1
            if pos == n and not at_end:
                return MORE
            if pos == start:
                return FAIL
            captures.append(buf[start:pos])
    return pos, captures


def _json_string(buf: str, pos: int, at_end: bool):
    """A JSON string starting at ``pos``: ``(end, value)``, MORE or FAIL."""
    if pos >= len(buf):
        return FAIL if at_end else MORE
    if buf[pos] != '"':
        return FAIL
    i, escaped = pos + 1, False
    while i < len(buf):
        ch = buf[i]
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == '"':
            try:
                return i + 1, json.loads(buf[pos:i + 1])
            except ValueError:
                return FAIL
        elif ord(ch) < 0x20:
            return FAIL
        i += 1
    return FAIL if at_end else MORE


def partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a marker."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


class StreamingCallParser(ToolCallParser):
    """The shared machine (see the module docstring); a format implements :meth:`_step_format`
    for its own states, :meth:`_after_call`, and the grammar classmethods."""

    def __init__(self, tools: list[dict]):
        super().__init__(tools)
        self._buf = ""           # received, not yet decided
        self._state = "text"
        self._started = False    # anything of the output decided yet (llama3's leading '{')
        self._region = ""        # structural text of the current region not yet given a call
        self._index = 0          # the next call's index
        self._text: list[str] = []
        self._calls: list[ToolCallDelta] = []
        self._scanner: JsonScanner | None = None   # the arguments (args) or object (buffered)
        self._outer: JsonScanner | None = None     # the whole call object, when there is one
        self._raw = ""           # what the scanner took
        self._released = 0       # of the arguments, chars released
        self._drop_ws = False    # whitespace after a region is not content
        self._any_text = False   # content released so far

    # ---- the contract ----------------------------------------------------------------------
    def parse(self, text: str) -> ParseResult:
        fresh = type(self)(self.tools)
        deltas = [fresh.feed(text), fresh.flush()]
        return assemble(deltas)

    def feed(self, delta: str) -> StreamDelta:
        self._buf += delta
        return self._run(at_end=False)

    def flush(self) -> StreamDelta:
        return self._run(at_end=True)

    # ---- the machine ---------------------------------------------------------------------
    def _run(self, at_end: bool) -> StreamDelta:
        while self._step(at_end):
            pass
        text, calls = "".join(self._text), _merge(self._calls)
        self._text, self._calls = [], []
        return StreamDelta(text=text, calls=calls)

    def _step(self, at_end: bool) -> bool:
        """One decision; False when nothing more can be decided now."""
        state = self._state
        if state == "call":
            return self._step_header(at_end)
        if state == "args":
            return self._step_args(at_end)
        if state == "trailer":
            return self._step_trailer(at_end)
        if state == "buffered":
            return self._step_buffered(at_end)
        return self._step_format(state, at_end)

    @abstractmethod
    def _step_format(self, state: str, at_end: bool) -> bool:
        """The format's own states ("text" and those it adds)."""

    @abstractmethod
    def _after_call(self) -> None:
        """Set the state that follows a finished call object."""

    # ---- helpers for formats --------------------------------------------------------------
    def _emit_text(self, text: str) -> None:
        if text:
            self._text.append(text)
            self._started = self._any_text = True

    def _take(self, n: int) -> str:
        """Consume ``n`` chars of the buffer as structure of the current region."""
        got, self._buf = self._buf[:n], self._buf[n:]
        self._region += got
        self._started = True
        return got

    def _fail_region(self) -> bool:
        """The region is not a call: its text is content, scanning resumes in text."""
        self._emit_text(self._region)
        self._region = ""
        self._started = True
        self._state = "text"
        return True

    def _end_region(self) -> None:
        """The region ended after its calls: its structure is dropped, and so is the
        whitespace after it unless content came before (then it separates the two)."""
        self._region = ""
        self._state = "text"
        self._drop_ws = not self._any_text

    def _scan_text(self, markers: tuple[str, ...], at_end: bool) -> str | None:
        """Release text up to the first marker and consume that marker (returned); None
        when no marker is in the buffer (text that may start one is held back). Whitespace
        right before a marker is dropped; trailing whitespace waits to see what follows."""
        if self._drop_ws:
            self._buf = self._buf.lstrip(_WS)
            if not self._buf:
                return None
            self._drop_ws = False
        buf = self._buf
        hits = [(buf.find(m), m) for m in markers]
        hits = [(i, m) for i, m in hits if i >= 0]
        if hits:
            i, marker = min(hits)
            before = buf[:i].rstrip(_WS)
            self._emit_text(before)
            self._buf = buf[i + len(marker):]
            self._region = buf[len(before):i + len(marker)]  # content again if it fails
            self._started = True
            return marker
        if at_end:
            self._emit_text(buf)
            self._buf = ""
            return None
        keep = len(buf) - partial_suffix(buf, markers)
        keep = len(buf[:keep].rstrip(_WS))
        self._emit_text(buf[:keep])
        self._buf = buf[keep:]
        return None

    def _step_text(self, markers: tuple[str, ...], at_end: bool) -> bool:
        """The "text" state: content until a marker, which opens the region ("open")."""
        if self._scan_text(markers, at_end) is None:
            return False
        self._state = "open"
        return True

    def _after_ws(self, at_end: bool, fail: bool) -> bool | None:
        """Skip whitespace. None when a char follows (the state looks at ``_buf[0]``); else
        what the step returns: wait for more, or, the text having ended, fail the region
        (``fail``) or end it."""
        if self._skip_ws():
            return None
        if not at_end:
            return False
        if fail:
            return self._fail_region()
        self._end_region()
        return True

    def _skip_ws(self) -> bool:
        """Drop leading whitespace of the buffer as region structure; True if any is left."""
        k = len(self._buf) - len(self._buf.lstrip(_WS))
        if k:
            self._take(k)
        return bool(self._buf)

    def _start_call(self) -> None:
        """The buffer starts with '{': read a call object."""
        self._state = "call"

    def _start_args(self, name: str) -> None:
        """A call with a known ``name`` whose arguments object starts the buffer (mistral's
        name form: no enclosing object)."""
        self._commit(name)
        self._outer = None
        self._begin_args()

    # ---- shared states -------------------------------------------------------------------
    def _commit(self, name: str) -> None:
        self._calls.append(ToolCallDelta(index=self._index, name=name))
        self._region = ""
        self._started = True

    def _begin_args(self) -> None:
        self._scanner, self._raw, self._released = JsonScanner(), "", 0
        self._state = "args"

    def _step_header(self, at_end: bool) -> bool:
        # a first key "name" whose value is not among the tools: decided once it is read
        named = match_seq(self._buf, 0, CALL_HEADER[:7], at_end)
        if isinstance(named, tuple) and named[1][0] not in self.tool_names:
            return self._fail_region()
        got = match_seq(self._buf, 0, CALL_HEADER, at_end)
        if got == MORE:
            return False
        if got == FAIL or self._buf[got[0]:got[0] + 1] != "{":  # not name-then-arguments
            self._scanner, self._raw = JsonScanner(), ""
            self._state = "buffered"
            return True
        end, (name,) = got
        self._commit(name)
        self._outer = JsonScanner()
        self._outer.feed(self._buf[:end])
        self._buf = self._buf[end:]
        self._begin_args()
        return True

    def _step_args(self, at_end: bool) -> bool:
        scanner = self._scanner
        if self._buf:
            taken = scanner.feed(self._buf)
            chunk, self._buf = self._buf[:taken], self._buf[taken:]
            self._raw += chunk
            if self._outer is not None:
                self._outer.feed(chunk)
        if scanner.done:
            self._release(len(self._raw), "")
            if self._outer is not None:
                self._state = "trailer"
            else:
                self._finish_call()
            return True
        if scanner.error or at_end:
            if at_end:
                scanner.finish()
            self._release(scanner.safe, scanner.completion())
            self._outer = None
            self._finish_call(broken=True)
            return True
        self._release(scanner.safe, None)
        return False

    def _release(self, upto: int, closers: str | None) -> None:
        """Release the arguments up to ``upto`` (and ``closers``, which end the call)."""
        piece = self._raw[self._released:upto] + (closers or "")
        self._released = max(self._released, upto)
        if piece:
            self._calls.append(ToolCallDelta(index=self._index, arguments=piece))

    def _step_trailer(self, at_end: bool) -> bool:
        outer = self._outer
        if self._buf:
            taken = outer.feed(self._buf)
            self._buf = self._buf[taken:]
        if outer.done or outer.error or at_end:
            self._outer = None
            self._finish_call(broken=not outer.done)
            return True
        return False

    def _finish_call(self, broken: bool = False) -> None:
        self._index += 1
        self._scanner = None
        if broken:
            self._end_region()
        else:
            self._after_call()

    def _step_buffered(self, at_end: bool) -> bool:
        scanner = self._scanner
        if self._buf:
            taken = scanner.feed(self._buf)
            self._raw += self._buf[:taken]
            self._buf = self._buf[taken:]
        if not scanner.done:
            if scanner.error or at_end:
                return self._unbuffer()
            return False
        call = _call_of(json.loads(self._raw), self.tool_names)
        if call is None:
            return self._unbuffer()
        self._commit(call.name)
        self._calls.append(ToolCallDelta(index=self._index, arguments=call.arguments))
        self._finish_call()
        return True

    def _unbuffer(self) -> bool:
        """A buffered object is not a call: put it back to be read as text."""
        self._buf = self._raw + self._buf
        self._scanner, self._raw = None, ""
        return self._fail_region()


def _call_of(obj, tool_names: set[str]) -> ToolCall | None:
    """A whole call object as a call, None when it is not one."""
    if not isinstance(obj, dict) or obj.get("name") not in tool_names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _merge(calls: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """Adjacent deltas of one call joined (the name stays on the first)."""
    out: list[ToolCallDelta] = []
    for d in calls:
        if out and out[-1].index == d.index and d.name is None:
            last = out[-1]
            out[-1] = ToolCallDelta(last.index, last.name, last.arguments + d.arguments)
        else:
            out.append(d)
    return out


def assemble(deltas: list[StreamDelta]) -> ParseResult:
    """What a client assembles from stream deltas, the way the OpenAI client does."""
    text, names, args = [], {}, {}
    for d in deltas:
        text.append(d.text)
        for c in d.calls:
            if c.name is not None:
                names[c.index] = c.name
                args.setdefault(c.index, "")
            args[c.index] = args.get(c.index, "") + c.arguments
    calls = [ToolCall(names[i], args[i]) for i in sorted(names)]
    return ParseResult("".join(text), calls)
