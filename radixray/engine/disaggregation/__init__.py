"""Prefill-decode disaggregation inside one engine: the prefill half (:mod:`.prefill`), the
decode half (:mod:`.decode`), the KV sender thread (:mod:`.sender`), the KV layout and
copy spans (:mod:`.layout`), the messages the halves exchange (:mod:`.messages`) and the
Mooncake transport (:mod:`.mooncake`).

One request, two engines (the router picks the pair; both get the same bootstrap room)::

    decode:  Bootstrapping (waits for free slots) -> WaitingForInput (slots reserved,
             KVDestination sent to the prefill worker) -> Success (KVArrival: the KV is in
             its slots; the request joins the running batch) | Failed
    prefill: Bootstrapping (waits for the KVDestination) -> WaitingForInput (queued for
             prefill) -> Transferring (each finished chunk's KV is written into the decode
             worker's slots) -> Success (first token sent in a KVArrival) | Failed

Moving messages between engines is the caller's job (an outbox callback; Ray actor calls
in a fleet, direct calls in-process); the KV bytes go over the transport, one-sided
writes from the prefill engine's pool into the decode engine's.
"""
