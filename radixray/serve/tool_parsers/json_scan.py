"""An incremental JSON scanner: where a JSON value being generated ends, and how much of it
is already safe to release.

:class:`JsonScanner` takes text one piece at a time and tracks, without building any value,
whether the text so far is a valid prefix of one JSON value (strict JSON as ``json.loads``
takes it: no control characters inside strings, no trailing commas, no NaN). It reports

- ``done``: the object closed; ``consumed`` is its length (text after it is not taken);
- ``error``: the text stopped being a JSON prefix; ``consumed`` is where (the char there
  was not taken);
- ``safe``: the longest consumed prefix that :meth:`completion` turns into a valid value by
  appending closers only (``"``, ``]``, ``}``): just after ``{`` or ``[``, after a complete
  member or element, or inside a value string (not a key, not mid-escape). A number or
  literal still growing, a dangling key, colon or comma is not safe.

Tool-call parsers release a call's arguments up to ``safe`` while they stream, so a call cut
short (the generation ended, or the JSON broke) still has arguments that are valid JSON and
equal to what was released plus :meth:`completion`.
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_LITERALS = ("true", "false", "null")
_WS = " \t\n\r"
_HEX = frozenset("0123456789abcdefABCDEF")
_ESCAPES = frozenset('"\\/bfnrtu')

# what the scanner expects next
_VALUE = "value"            # a value (the top-level object, after ':', after ',' in an array)
_FIRST = "first"            # after '[': a value or ']'
_KEY_OR_END = "key_or_end"  # after '{': a key or '}'
_KEY = "key"                # after ',' in an object
_COLON = "colon"
_AFTER = "after"            # after a value: ',' or the closer
_STRING = "string"
_NUMBER_STATE = "number"
_LITERAL = "literal"


class JsonScanner:
    """One JSON object, scanned as it arrives (see the module docstring). Only an object is
    taken at the top level: tool calls and their arguments are objects."""

    def __init__(self):
        self.consumed = 0        # characters taken so far
        self.safe = 0            # see the module docstring
        self.done = False
        self.error = False
        self._stack: list[str] = []   # open containers, '{' or '['
        self._state = _VALUE
        self._is_key = False          # the open string is a key
        self._escape = 0              # 0: none; 1: after '\'; 2..5: inside '\\uXXXX'
        self._token = ""              # the number or literal being read
        self._completion = ""         # the closers of the text up to ``safe``

    def feed(self, text: str) -> int:
        """Consume ``text`` until the value is done or broken; the number of chars taken."""
        taken = 0
        for ch in text:
            if self.done or self.error:
                break
            if not self._step(ch):
                self.error = True
                break
            taken += 1
            self.consumed += 1
        return taken

    def finish(self) -> None:
        """The text ended: a number still being read counts as complete when it is one."""
        if self._state == _NUMBER_STATE and _NUMBER.fullmatch(self._token):
            self._state = _AFTER
            self.safe = self.consumed
            self._completion = self._closers()

    def completion(self) -> str:
        """What turns the text up to ``safe`` into a valid value: closers only."""
        return "" if self.done else self._completion

    # ---- one character ------------------------------------------------------------------
    def _closers(self) -> str:
        return "".join("}" if c == "{" else "]" for c in reversed(self._stack))

    def _mark_safe(self) -> None:
        """The text up to and including the current char is safe."""
        self.safe = self.consumed + 1
        self._completion = ('"' if self._state == _STRING else "") + self._closers()

    def _close_value(self) -> None:
        """A value just ended at the current char (inclusive)."""
        if not self._stack:
            self.done = True
            self._state = _AFTER
            self.safe = self.consumed + 1
            self._completion = ""
            return
        self._state = _AFTER
        self._mark_safe()

    def _step(self, ch: str) -> bool:
        state = self._state
        if state == _STRING:
            return self._string_char(ch)
        if state in (_NUMBER_STATE, _LITERAL):
            if state == _NUMBER_STATE and ch in _NUMBER_CHARS:
                self._token += ch
                return True
            if state == _LITERAL:
                self._token += ch
                if not any(lit.startswith(self._token) for lit in _LITERALS):
                    return False
                if self._token in _LITERALS:
                    self._close_value()
                return True
            # the number ended before this char (numbers only occur inside a container)
            if not _NUMBER.fullmatch(self._token):
                return False
            self._state = _AFTER
            self.safe = self.consumed
            self._completion = self._closers()
            return self._step(ch)
        if ch in _WS:
            return True
        if state in (_VALUE, _FIRST):
            if state == _FIRST and ch == "]":
                return self._close_container("[")
            return self._start_value(ch)
        if state in (_KEY_OR_END, _KEY):
            if ch == '"':
                self._state, self._is_key = _STRING, True
                return True
            return state == _KEY_OR_END and ch == "}" and self._close_container("{")
        if state == _COLON:
            if ch == ":":
                self._state = _VALUE
                return True
            return False
        if state == _AFTER:
            if not self._stack:
                return False
            top = self._stack[-1]
            if ch == ",":
                self._state = _KEY if top == "{" else _VALUE
                return True
            return ch == ("}" if top == "{" else "]") and self._close_container(top)
        return False

    def _start_value(self, ch: str) -> bool:
        if not self._stack and ch != "{":
            return False
        if ch in "{[":
            self._stack.append(ch)
            self._state = _KEY_OR_END if ch == "{" else _FIRST
            self._mark_safe()
            return True
        if ch == '"':
            self._state, self._is_key = _STRING, False
            self._mark_safe()
            return True
        if ch == "-" or ch.isdigit() and ch.isascii():
            self._state, self._token = _NUMBER_STATE, ch
            return True
        if ch in "tfn":
            self._state, self._token = _LITERAL, ch
            return True
        return False

    def _close_container(self, kind: str) -> bool:
        if not self._stack or self._stack[-1] != kind:
            return False
        self._stack.pop()
        self._close_value()
        return True

    def _string_char(self, ch: str) -> bool:
        if self._escape == 1:
            if ch not in _ESCAPES:
                return False
            self._escape = 2 if ch == "u" else 0
        elif self._escape >= 2:
            if ch not in _HEX:
                return False
            self._escape = 0 if self._escape == 5 else self._escape + 1
        elif ch == "\\":
            self._escape = 1
        elif ch == '"':
            if self._is_key:
                self._state = _COLON
                return True
            self._close_value()
            return True
        elif ord(ch) < 0x20:
            return False
        if not self._is_key and self._escape == 0:
            self._mark_safe()
        return True

