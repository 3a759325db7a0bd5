"""Structured output (xgrammar): constraints, compiled-grammar cache, grammar queue, masks.

``spec.py`` (what a request asks for, syntax check), ``backend.py`` (compile pool and cache),
``matcher.py`` (per-request state, logits masks), ``manager.py`` (the scheduler's queue).
"""
