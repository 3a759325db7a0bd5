"""PrefixTree: the router's approximate radix tree over request text."""

from __future__ import annotations

import random

from radixray.cluster.prefix_tree import PrefixTree


def _reference_match(inserted: list[tuple[str, str]], text: str) -> dict[str, int]:
    """Brute force: per worker, the longest common prefix of ``text`` with any insert."""
    best: dict[str, int] = {}
    for s, w in inserted:
        n = 0
        while n < min(len(s), len(text)) and s[n] == text[n]:
            n += 1
        if n:
            best[w] = max(best.get(w, 0), n)
    return best


def test_insert_and_match_single_worker():
    t = PrefixTree()
    t.insert("hello world", "a", 1.0)
    assert t.match("hello world") == {"a": 11}
    assert t.match("hello there") == {"a": 6}  # partial match inside the edge
    assert t.match("hello world, and more") == {"a": 11}
    assert t.match("xyz") == {}
    assert t.match("") == {}
    assert t.num_nodes() == 1 and t.total_chars() == 11 == len(t)
    assert t.worker_size("a") == 11


def test_split_keeps_tenants_and_sizes():
    t = PrefixTree()
    t.insert("abcdef", "a", 1.0)
    t.insert("abcxyz", "b", 2.0)
    # "abc" is shared: a split created an upper node that lists both workers.
    assert t.num_nodes() == 3
    assert t.total_chars() == 9  # "abc" + "def" + "xyz"
    assert t.worker_sizes() == {"a": 6, "b": 6}
    assert t.match("abcdef") == {"a": 6, "b": 3}
    assert t.match("abcxyz") == {"a": 3, "b": 6}
    assert t.match("abq") == {"a": 2, "b": 2}
    # Splitting an edge a single worker owns leaves its size unchanged.
    t.insert("abcdQQ", "b", 3.0)  # splits a's "def" into "d" + "ef"
    assert t.worker_size("a") == 6
    assert t.worker_size("b") == 6 + 3  # "abc" + "xyz" + "d" + "QQ"
    assert t.num_nodes() == 5
    assert t.match("abcdQQ") == {"a": 4, "b": 6}


def test_shared_and_diverging_prefixes_match_brute_force():
    rng = random.Random(7)
    t = PrefixTree()
    inserted: list[tuple[str, str]] = []
    for i in range(300):
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 12)))
        worker = rng.choice(["w0", "w1", "w2"])
        t.insert(text, worker, float(i))
        inserted.append((text, worker))
    for _ in range(300):
        q = "".join(rng.choice("abcd") for _ in range(rng.randint(0, 14)))
        assert t.match(q) == _reference_match(inserted, q)
    # Per-worker size equals the edges of nodes that list it: count distinct prefixes.
    for w in ("w0", "w1", "w2"):
        prefixes = {s[:k] for s, ww in inserted if ww == w for k in range(1, len(s) + 1)}
        assert t.worker_size(w) == len(prefixes)
    all_prefixes = {s[:k] for s, _ in inserted for k in range(1, len(s) + 1)}
    assert t.total_chars() == len(all_prefixes)


def test_reinsert_same_text_does_not_grow():
    t = PrefixTree()
    t.insert("same text", "a", 1.0)
    t.insert("same text", "a", 2.0)
    t.insert("same", "a", 3.0)
    assert t.worker_size("a") == 9 and t.total_chars() == 9
    t.insert("", "a", 4.0)  # no-op
    assert t.worker_sizes() == {"a": 9}


def test_match_bumps_access_time_only_on_matched_path():
    t = PrefixTree()
    t.insert("prefix-one", "a", 1.0)
    t.insert("prefix-two", "a", 2.0)
    t.insert("other", "a", 3.0)
    t.match("prefix-one", now=10.0)  # "one" (inserted at 1.0) becomes the newest leaf
    assert t.worker_size("a") == 18  # "prefix-" + "one" + "two" + "other"
    # Without the bump "one" would be the LRU leaf; now "two" (2.0) is.
    assert t.evict(15) == 3
    assert t.match("prefix-two") == {"a": 7}
    assert t.match("prefix-one") == {"a": 10}
    assert t.match("other") == {"a": 5}
    # Without now, match changes nothing.
    t2 = PrefixTree()
    t2.insert("x1", "a", 1.0)
    t2.insert("y1", "a", 2.0)
    t2.match("x1")
    t2.evict(2)
    assert t2.match("x1") == {} and t2.match("y1") == {"a": 2}


def test_remove_worker_prunes_nodes():
    t = PrefixTree()
    t.insert("shared-a", "a", 1.0)
    t.insert("shared-b", "b", 1.0)
    t.insert("only-b", "b", 1.0)
    t.remove_worker("b")
    assert t.worker_sizes() == {"a": 8}
    assert t.match("shared-b") == {"a": 7}
    assert t.match("only-b") == {}
    assert t.total_chars() == 8  # "shared-" + "a"; b's nodes are gone
    assert t.num_nodes() == 2
    t.remove_worker("b")  # idempotent
    t.remove_worker("a")
    assert t.num_nodes() == 0 and t.total_chars() == 0 and t.worker_sizes() == {}


def test_evict_bounds_each_worker_and_spares_others():
    t = PrefixTree()
    for i in range(10):
        t.insert(f"doc{i}-" + "x" * 10, "big", float(i))
    t.insert("doc0-" + "x" * 10, "small", 100.0)
    t.insert("tiny", "small", 100.0)
    before_small = t.worker_size("small")
    removed = t.evict(60)
    assert t.worker_size("big") <= 60
    # big held "doc" once plus ten 12-char tails; it lost whole tails, oldest first.
    assert removed == 3 + 10 * 12 - t.worker_size("big") == 6 * 12
    assert t.worker_size("small") == before_small  # under the limit: untouched
    # The oldest documents went first; the newest survive.
    assert t.match("doc9-" + "x" * 10)["big"] == 15
    assert t.match("doc1-" + "x" * 10).get("big", 0) < 15
    # big's removal from doc0 kept the node because small still lists it.
    assert t.match("doc0-" + "x" * 10)["small"] == 15
    assert t.match("tiny") == {"small": 4}


def test_evict_removes_leaves_before_their_parents():
    t = PrefixTree()
    t.insert("aaaa", "w", 5.0)
    t.insert("aaaabbbb", "w", 1.0)  # sets "aaaa" to 1.0 too (insert stamps the path)
    t.insert("cccc", "w", 3.0)
    # Leaves are "bbbb" (1.0) and "cccc" (3.0); "aaaa" (1.0) is an interior node.
    removed = t.evict(8)
    assert removed == 4
    assert t.match("aaaabbbb") == {"w": 4}
    assert t.match("cccc") == {"w": 4}
    # Once "bbbb" is gone "aaaa" is a leaf (1.0) and goes before "cccc" (3.0).
    assert t.evict(4) == 4
    assert t.match("aaaa") == {} and t.match("cccc") == {"w": 4}
    assert t.evict(0) == 4
    assert t.num_nodes() == 0 and t.worker_sizes() == {}


def test_unicode_and_lone_surrogates():
    t = PrefixTree()
    ids = [1, 2, 55296, 57343, 0xD800, 300000 % 0x110000]
    text = "".join(map(chr, ids))  # lone surrogates from token ids
    t.insert(text, "a", 1.0)
    t.insert("héllo 世界 🙂", "b", 1.0)
    assert t.match(text) == {"a": len(ids)}
    assert t.match(text[:3] + "\udbff") == {"a": 3}
    assert t.match("héllo 世界 🙃") == {"b": 9}
    assert t.worker_size("b") == len("héllo 世界 🙂")


def test_long_texts_need_no_recursion():
    t = PrefixTree()
    base = "".join(chr(32 + (i * 7919) % 20000) for i in range(100_000))
    t.insert(base, "a", 1.0)
    t.insert(base[:50_000] + "!" + base[50_001:], "b", 2.0)
    assert t.match(base) == {"a": 100_000, "b": 50_000}
    # Many nested splits: a deep path of 1-char nodes, then walks over all of them.
    for k in range(1, 500):
        t.insert(base[:k] + "\x00", "c", 3.0)
    assert t.match(base)["c"] == 499
    assert t.match(base[:200] + "\x00") == {"a": 200, "b": 200, "c": 201}
    t.remove_worker("c")
    assert t.match(base) == {"a": 100_000, "b": 50_000}
    assert t.evict(10) > 0
    assert t.worker_size("a") <= 10 and t.worker_size("b") <= 10
