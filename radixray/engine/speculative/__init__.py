"""Speculative decoding: n-gram drafts verified by the target model in one forward.

``options`` (no torch) validates the start-up options and caps running requests;
``ngram`` proposes draft chains from a request's own tokens; ``verify`` accepts a
prefix of a draft (greedy, or exact rejection sampling); ``worker`` is the scheduler's
hook that runs one verify step over the running batch (see docs/speculative_decoding.md).
"""
