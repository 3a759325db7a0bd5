"""Compiling grammars against the model's vocabulary, off the scheduler thread, with a cache.

:class:`GrammarBackend` owns xgrammar's ``TokenizerInfo`` (built from the engine's Hugging
Face tokenizer, sized to the model's logits width) and a small thread pool. ``compile(spec)``
returns a future of the compiled grammar; a second request with the same (kind, text) gets
the same future, so one text is compiled once. A grammar that fails to compile is cached as
failed: its future holds the ``ValueError`` and the next request with that text fails at once.
The cache keeps the ``cache_size`` most recently used entries.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from radixray.engine.grammar.spec import GrammarSpec, clean_error, with_max_whitespace

logger = logging.getLogger("radixray.grammar")


class GrammarBackend:
    """Thread-safe: ``compile`` may be called from any thread; compilation runs on the pool."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids, threads: int = 2,
                 cache_size: int = 512, json_max_whitespace: int | None = None):
        """``vocab_size``: the logits width (the bitmask covers it; ids past the tokenizer's
        are never allowed). ``stop_token_ids``: the ids that end a completed grammar (EOS)."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(int(t) for t in stop_token_ids)
        self.cache_size = cache_size
        self.json_max_whitespace = json_max_whitespace
        self._threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._compiler = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[GrammarSpec, Future] = OrderedDict()
        # Test hook: called on the compile thread with the spec before it compiles (a test
        # blocks it on an event to hold a grammar in the queue deterministically).
        self.compile_hook: Callable[[GrammarSpec], None] | None = None
        # counters (read by the scheduler's metrics snapshot)
        self.compiles = 0
        self.compile_failures = 0
        self.compile_seconds = 0.0
        self.cache_hits = 0

    # ---- public ------------------------------------------------------------------------
    def compile(self, spec: GrammarSpec) -> Future:
        """The future compiled grammar of ``spec`` (result: xgrammar ``CompiledGrammar``;
        exception: ``ValueError`` naming the field when it does not compile)."""
        with self._lock:
            fut = self._cache.get(spec)
            if fut is not None:
                self._cache.move_to_end(spec)
                self.cache_hits += 1
                return fut
            fut = Future()
            self._cache[spec] = fut
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="radixray-grammar")
            self._pool.submit(self._compile_into, spec, fut)
        return fut

    def cached(self, spec: GrammarSpec) -> Future | None:
        """The cache entry of ``spec`` if there is one (not counted as a hit)."""
        with self._lock:
            return self._cache.get(spec)

    def matcher(self, compiled):
        """A fresh xgrammar ``GrammarMatcher`` over a compiled grammar (one per request)."""
        import xgrammar as xgr
        return xgr.GrammarMatcher(compiled)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- compile thread ------------------------------------------------------------------
    def _compile_into(self, spec: GrammarSpec, fut: Future) -> None:
        t0 = time.perf_counter()
        try:
            if self.compile_hook is not None:
                self.compile_hook(spec)
            compiled = self._compile(spec)
            self._check_not_empty(spec, compiled)
        except ValueError as exc:
            self._done(t0, failed=True)
            fut.set_exception(exc)
        except Exception as exc:  # noqa: BLE001 - xgrammar's errors are the client's input
            self._done(t0, failed=True)
            fut.set_exception(ValueError(f"{spec.field}: xgrammar cannot compile it: "
                                         f"{clean_error(exc)}"))
        else:
            self._done(t0, failed=False)
            fut.set_result(compiled)

    def _done(self, t0: float, failed: bool) -> None:
        seconds = time.perf_counter() - t0
        with self._lock:
            self.compiles += 1
            self.compile_seconds += seconds
            self.compile_failures += int(failed)

    def _check_not_empty(self, spec: GrammarSpec, compiled) -> None:
        """ValueError when the grammar allows no first token (a regex such as ``[^\\s\\S]``
        parses but matches nothing): the request could only fail at its first step."""
        import xgrammar as xgr
        matcher = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(bitmask)
        if not bool(bitmask.any()):
            raise ValueError(f"{spec.field}: the grammar matches no text (no first token is "
                             "allowed)")

    def _get_compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr
                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size,
                    stop_token_ids=self.stop_token_ids or None)
                # Our own cache above keeps failures too; xgrammar's would be a second copy.
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def _compile(self, spec: GrammarSpec):
        compiler = self._get_compiler()
        if spec.kind == "json_schema":
            return compiler.compile_json_schema(spec.text, any_whitespace=True,
                                                max_whitespace_cnt=self.json_max_whitespace)
        if spec.kind == "regex":
            return compiler.compile_regex(spec.text)
        if spec.kind == "ebnf":
            return compiler.compile_grammar(spec.text)
        if spec.kind == "structural_tag":
            return compiler.compile_structural_tag(
                with_max_whitespace(spec.text, self.json_max_whitespace))
        raise ValueError(f"unknown grammar kind {spec.kind!r}")
