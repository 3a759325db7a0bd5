"""KV memory: the pool and its allocator, the radix cache, HiCache tiers, memory release, huge pages, the KV audit."""
