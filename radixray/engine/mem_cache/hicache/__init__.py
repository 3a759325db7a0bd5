"""Hierarchical KV cache (HiCache): a host tier and an optional storage tier under the
radix cache (manager.py), the host tier's store (host_pool.py) and the storage backends
(storage.py). Built by :func:`radixray.engine.mem_cache.factory.create_kv_manager`."""
