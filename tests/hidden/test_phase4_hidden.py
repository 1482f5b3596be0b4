"""Hidden tests for Phase 4: instructor-only (left out of the student edition).

They check the rules of ``assignment/phase4.md`` as ``tests/test_phase4.py`` does, on trees,
prompts, block sizes, block ids, stamps and locks drawn from the grade's seed, so a table of the
visible tests' answers cannot pass them. Every test gets its ``rng`` from ``@seeded``
(``test_seed.py``: the seed is ``VKV_GRADE_SEED``, or a fresh one when it is unset, and every
failure names it). As in the visible tests, trees are built by hand through the given
``_new_node`` with a hash of the tests' own, so that a part is graded on its own code (only part
4.1's tests call ``block_hash``); expected values come from a dictionary of cached prefixes, a
count of locks per node, and a plain scan for the oldest leaf.
"""

import pytest
import radix_trees
import xxhash
from radix_trees import Cache, check_structure, grow, insert, match
from test_seed import seeded

from vkv.engine.block_manager import AllocStatus, BlockManager
from vkv.engine.prefix_caching import PrefixCachingBlockManager
from vkv.engine.radix_cache import MatchResult, RadixCache, TreeNode, block_hash, hash_blocks
from vkv.engine.sequence import Sequence, SequenceStatus


def path_key(cache: RadixCache, node: TreeNode) -> list[int]:
    """The tokens from the root to the end of ``node``'s edge."""
    parts = []
    while node is not cache.root:
        parts.append(node.key)
        node = node.parent
    return [t for key in reversed(parts) for t in key]


def paths(cache: RadixCache) -> dict[tuple[int, ...], int]:
    """Every cached prefix of whole blocks and the block that ends it, read off the tree."""
    found: dict[tuple[int, ...], int] = {}

    def walk(node: TreeNode, prefix: tuple[int, ...]) -> None:
        for i, block in enumerate(node.blocks):
            found[prefix + tuple(node.key[: (i + 1) * cache.block_size])] = block
        for child in node.children.values():
            walk(child, prefix + tuple(node.key))

    walk(cache.root, ())
    return found


def snapshot(cache: RadixCache) -> tuple:
    """Everything a refused call must leave as it was: every node, the sizes and the clock."""

    def describe(node: TreeNode) -> tuple:
        children = tuple(sorted((h, describe(c)) for h, c in node.children.items()))
        return (tuple(node.key), tuple(node.blocks), tuple(node.hashes), node.lock_ref,
                node.last_access, children)  # fmt: skip

    return describe(cache.root), cache.evictable_size, cache.protected_size, cache._clock


def random_tree(rng, cache: RadixCache, count: int, vocab: int = 6) -> list[TreeNode]:
    """``count`` nodes of 1 to 4 blocks each, grown by hand under random nodes."""
    made: list[TreeNode] = []
    ids = iter(rng.sample(range(10_000), 4 * count))
    size = cache.block_size
    while len(made) < count:
        parent = rng.choice([cache.root, *made])
        blocks = rng.randint(1, 4)
        tokens = [rng.randrange(vocab) for _ in range(blocks * size)]
        first = cache.hash_function(parent.last_hash, tokens[:size])
        if first in parent.children:
            continue  # that edge exists already: a radix tree has one child per first block
        made.append(grow(cache, parent, tokens, [next(ids) for _ in range(blocks)]))
    return made


def draw_prompt(rng, cache: RadixCache, made: list[TreeNode], vocab: int = 6) -> list[int]:
    """A prompt that follows a cached path for a while (often into the middle of an edge), then
    goes its own way or stops, sometimes mid-block."""
    size = cache.block_size
    if made and rng.random() < 0.85:
        node = rng.choice(made)
        key = path_key(cache, node)
        prefix = key[: rng.randint(0, len(key))]
    else:
        prefix = []
    return prefix + [rng.randrange(vocab) for _ in range(rng.randint(0, 3 * size))] or [0]


def expected_match(model: dict, prompt: list[int], size: int) -> list[int]:
    blocks = []
    for i in range(1, (len(prompt) - 1) // size + 1):
        block = model.get(tuple(prompt[: i * size]))
        if block is None:
            break
        blocks.append(block)
    return blocks


# ---- Part 4.1: the chained block hash ---------------------------------------------------------


@seeded
def test_part1_block_hash_is_xxh64_of_the_parent_then_the_tokens(rng):
    for _ in range(50):
        tokens = [rng.randrange(2**32) for _ in range(rng.randint(0, 40))]
        parent = rng.choice([None, 0, rng.randrange(2**64), rng.randrange(2**32)])
        data = b"" if parent is None else parent.to_bytes(8, "little")
        data += b"".join(t.to_bytes(4, "little") for t in tokens)
        want = xxhash.xxh64(data).intdigest()
        got = block_hash(parent, tokens)
        assert got == want, (
            f"block_hash({parent}, {len(tokens)} tokens) is xxh64 (seed 0) of the parent as 8 "
            f"little-endian bytes (none for None), then each token as 4 little-endian bytes: "
            f"expected {want}, got {got}"
        )
        assert block_hash(parent, tuple(tokens)) == want, "any sequence of ints hashes alike"


@seeded
def test_part1_a_prompt_chains_its_blocks(rng):
    size = rng.randint(1, 32)
    prompt = [rng.randrange(200_000) for _ in range(size * rng.randint(2, 8))]
    last = None
    for i in range(len(prompt) // size):
        block = prompt[i * size : (i + 1) * size]
        data = (b"" if last is None else last.to_bytes(8, "little")) + b"".join(
            t.to_bytes(4, "little") for t in block
        )
        want = xxhash.xxh64(data).intdigest()
        got = block_hash(last, block)
        assert got == want, (
            f"block {i} of the prompt hashes the hash of block {i - 1} then its tokens: "
            f"expected {want}, got {got}"
        )
        last = want


@seeded
def test_part1_parent_zero_is_a_parent_not_the_first_block(rng):
    tokens = [rng.randrange(2**32) for _ in range(rng.randint(1, 16))]
    body = b"".join(t.to_bytes(4, "little") for t in tokens)
    assert block_hash(0, tokens) == xxhash.xxh64(bytes(8) + body).intdigest(), (
        "parent 0 is a real hash (8 zero bytes first): only None means the first block"
    )
    assert block_hash(None, tokens) == xxhash.xxh64(body).intdigest()


# ---- Part 4.2: splitting a node ---------------------------------------------------------------


@seeded
def test_part2_split_gives_the_head_to_a_new_node_and_the_tail_keeps_the_rest(rng):
    for _ in range(10):
        cache = Cache(rng.randint(1, 4), radix_trees.reference_hash)
        made = random_tree(rng, cache, rng.randint(0, 6))
        parent = rng.choice([cache.root, *made])
        size = cache.block_size
        count = rng.randint(2, 8)
        tokens = [rng.randrange(1000, 2000) for _ in range(count * size)]
        node = grow(cache, parent, tokens, rng.sample(range(20_000, 30_000), count))
        kids = []
        for block in rng.sample(range(40_000, 50_000), rng.randint(0, 3)):
            first = rng.sample(range(2000, 3000), size)
            if cache.hash_function(node.last_hash, first) not in node.children:
                kids.append(grow(cache, node, first, [block]))
        key, blocks, hashes = list(node.key), list(node.blocks), list(node.hashes)
        children = dict(node.children)
        cut = rng.randint(1, count - 1)
        sizes = (cache.evictable_size, cache.protected_size)
        head = cache._split(node, cut)
        assert head is not node and (head.key, head.blocks, head.hashes) == (
            key[: cut * size],
            blocks[:cut],
            hashes[:cut],
        ), (
            f"_split(node of {count} blocks, {cut}) gives the first {cut} blocks (their tokens, "
            f"ids and hashes) to a new node; got key {head.key}, blocks {head.blocks}"
        )
        assert (node.key, node.blocks, node.hashes) == (
            key[cut * size :],
            blocks[cut:],
            hashes[cut:],
        ), f"the split node keeps blocks {blocks[cut:]}, got {node.blocks}"
        assert parent.children.get(hashes[0]) is head and head.parent is parent, (
            "the new node takes the old one's place in the parent's children, under its hash"
        )
        assert head.children == {hashes[cut]: node} and node.parent is head, (
            "the old node is the new node's only child, under the hash of its first block"
        )
        assert node.children == children and all(k.parent is node for k in kids), (
            "the children stay with the tail"
        )
        assert (cache.evictable_size, cache.protected_size) == sizes
        check_structure(cache)


@seeded
def test_part2_the_head_copies_lock_ref_and_last_access(rng):
    for _ in range(10):
        size = rng.randint(1, 4)
        cache = Cache(size, radix_trees.reference_hash)
        count = rng.randint(2, 8)
        node = grow(cache, cache.root, [rng.randrange(9) for _ in range(count * size)],
                    rng.sample(range(1000), count))  # fmt: skip
        locks, stamp = rng.randint(0, 5), rng.randint(0, 10**6)
        node.lock_ref, node.last_access = locks, stamp
        if locks:
            cache.evictable_size, cache.protected_size = 0, count
        head = cache._split(node, rng.randint(1, count - 1))
        assert (head.lock_ref, head.last_access) == (locks, stamp), (
            f"every lock that covered the node covers its head, and it was used as the node was: "
            f"expected lock_ref {locks}, last_access {stamp}; got {head.lock_ref}, "
            f"{head.last_access}"
        )
        assert (node.lock_ref, node.last_access) == (locks, stamp), "the tail keeps its own"
        assert (cache.evictable_size, cache.protected_size) == (
            (0, count) if locks else (count, 0)
        ), "a split moves no block between evictable and protected"


@seeded
def test_part2_repeated_splits_keep_the_edge_and_its_chain(rng):
    size = rng.randint(1, 4)
    cache = Cache(size, radix_trees.reference_hash)
    count = rng.randint(3, 12)
    tokens = [rng.randrange(50) for _ in range(count * size)]
    blocks = rng.sample(range(10**5), count)
    grow(cache, cache.root, tokens, blocks)
    for _ in range(rng.randint(1, count - 1)):
        splittable = [n for n in cache._nodes() if len(n.blocks) > 1]
        if not splittable:
            break
        node = rng.choice(splittable)
        cache._split(node, rng.randint(1, len(node.blocks) - 1))
        check_structure(cache)
    assert paths(cache) == {
        tuple(tokens[: (i + 1) * size]): block for i, block in enumerate(blocks)
    }, "splits cut the edge into nodes; the path still spells the same blocks, in order"


# ---- Part 4.3: match_prefix ----------------------------------------------------------------


@seeded
def test_part2_match_finds_the_longest_cached_prefix_of_whole_blocks(rng):
    for _ in range(6):
        cache = Cache(rng.randint(1, 4), radix_trees.reference_hash)
        made = random_tree(rng, cache, rng.randint(1, 12))
        for _ in range(10):
            model = paths(cache)
            prompt = draw_prompt(rng, cache, made)
            want = expected_match(model, prompt, cache.block_size)
            result = match(cache, prompt)
            assert isinstance(result, MatchResult) and result.blocks == want, (
                f"block size {cache.block_size}, prompt {prompt}: the longest cached prefix of "
                f"whole blocks, never the last token (at most ({len(prompt)} - 1) // "
                f"{cache.block_size} blocks): expected {want}, got {result.blocks}"
            )
            assert path_key(cache, result.node) == prompt[: len(want) * cache.block_size], (
                "the match ends at a node whose path spells the matched prefix (the root for a "
                "miss): a match that ends inside an edge splits it there"
            )
            assert paths(cache) == model, "a match changes no cached prefix"
            check_structure(cache)


@seeded
def test_part2_a_match_inside_an_edge_splits_it_after_the_last_matched_block(rng):
    for _ in range(10):
        size = rng.randint(1, 4)
        cache = Cache(size, radix_trees.reference_hash)
        made = random_tree(rng, cache, rng.randint(0, 5))
        parent = rng.choice([cache.root, *made])
        count = rng.randint(2, 6)
        edge = [rng.randrange(100, 200) for _ in range(count * size)]
        node = grow(cache, parent, edge, rng.sample(range(20_000, 30_000), count))
        blocks = list(node.blocks)
        keep = rng.randint(1, count - 1)
        prompt = path_key(cache, parent) + edge[: keep * size]
        prompt += [rng.randrange(200, 300)] * rng.randint(1, 2 * size)  # diverge, or end
        total = cache.total_size
        result = match(cache, prompt)
        assert result.blocks[-keep:] == blocks[:keep] and result.node.blocks == blocks[:keep], (
            f"the prompt agrees with {keep} of the edge's {count} blocks: the edge is split after "
            f"them and the match ends at the head {blocks[:keep]}, got node {result.node.blocks}"
        )
        assert result.node.parent is parent and node.parent is result.node, (
            "the head takes the edge's place; the rest hangs below it"
        )
        assert node.blocks == blocks[keep:] and cache.total_size == total, (
            f"the tail keeps {blocks[keep:]}, got {node.blocks}; no block is added or lost"
        )
        check_structure(cache)


@seeded
def test_part2_a_match_stamps_its_path_and_nothing_else(rng):
    for k in range(8):
        size = rng.randint(1, 4)
        cache = Cache(size, radix_trees.reference_hash)
        made = random_tree(rng, cache, rng.randint(1, 10))
        top = grow(cache, cache.root, [200 + t for t in range(size)], [80_000])
        deep = grow(cache, top, [300 + t for t in range(2 * size)], [80_001, 80_002])
        made += [top, deep]
        for node in made:
            node.last_access = rng.randint(0, 500)
        cache._clock = rng.randint(500, 10**6)
        before = {id(n): n.last_access for n in made}
        if k == 0:  # down a path of two nodes, into the middle of the second or to its end
            prompt = [*path_key(cache, deep)[: rng.choice([2, 3]) * size], rng.randrange(6)]
        else:
            prompt = draw_prompt(rng, cache, made)
        result = match(cache, prompt)
        now = cache._clock
        on_path, node = set(), result.node
        while node is not cache.root:
            on_path.add(id(node))
            node = node.parent
        for node in cache._nodes():
            if id(node) in on_path:
                assert node.last_access == now, (
                    f"the node the match ends at and its ancestors are used now (tick {now}), "
                    f"got {node.last_access} on the path"
                )
            else:
                original = before.get(id(node))
                if original is None:  # a head made by a split: it is on the path
                    continue
                assert node.last_access == original, (
                    f"a node off the matched path (a split-off tail included) keeps its stamp "
                    f"{original}, got {node.last_access}"
                )


@seeded
def test_part2_a_match_ticks_the_clock_once(rng):
    cache = Cache(rng.randint(1, 4), radix_trees.reference_hash)
    made = random_tree(rng, cache, rng.randint(1, 10))
    for _ in range(10):
        clock = cache._clock
        match(cache, draw_prompt(rng, cache, made))
        assert cache._clock == clock + 1, (
            f"a match is one use of its path: one _touch, one tick (clock {clock} -> "
            f"{clock + 1}), got {cache._clock}"
        )


@seeded
def test_part2_a_collision_is_a_miss_and_an_empty_prompt_is_refused(rng):
    size = rng.randint(1, 4)
    cache = Cache(size, radix_trees.colliding_hash)
    cached = [rng.randrange(100) for _ in range(size * rng.randint(1, 4))]
    grow(cache, cache.root, cached, rng.sample(range(1000), len(cached) // size))
    other = list(cached)
    other[rng.randrange(size)] += 1  # the first block differs, the hash is the same
    result = match(cache, [*other, rng.randrange(100)])
    assert result.blocks == [] and result.node is cache.root, (
        f"block {other[:size]} hashes like the cached {cached[:size]} but its tokens differ: a "
        f"miss (no blocks, the root), got {result.blocks}"
    )
    assert match(cache, [*cached, 1]).blocks == list(cache.root.children[7].blocks), (
        "with the tokens equal, a colliding hash still matches"
    )
    before = snapshot(cache)
    with pytest.raises(ValueError, match=r"^cannot match an empty prompt$"):
        match(cache, [])
    assert snapshot(cache) == before, "a refused match changes nothing"


# ---- Part 4.4: insert -------------------------------------------------------------------------


@seeded
def test_part3_inserts_record_what_a_prefix_dictionary_records(rng):
    for _ in range(3):
        size = rng.randint(1, 4)
        vocab = rng.randint(2, 4)
        cache, model = Cache(size, radix_trees.reference_hash), {}
        ids = iter(rng.sample(range(10**6), 400))
        for step in range(40):
            tokens = [rng.randrange(vocab) for _ in range(size * rng.randint(1, 5))]
            blocks = [next(ids) for _ in range(len(tokens) // size)]
            prefixes = [tuple(tokens[: size * (k + 1)]) for k in range(len(blocks))]
            cached = 0
            while cached < len(prefixes) and prefixes[cached] in model:
                cached += 1
            for prefix, block in zip(prefixes, blocks, strict=True):
                model.setdefault(prefix, block)
            got = insert(cache, tokens, blocks)
            assert got == cached, (
                f"step {step}, block size {size}: insert({tokens}) returns the leading blocks "
                f"cached already: expected {cached}, got {got}"
            )
            assert paths(cache) == model, (
                f"step {step}: the tree keeps its own blocks for the cached prefix and records "
                "the rest as a new leaf"
            )
            assert (cache.evictable_size, cache.protected_size) == (len(model), 0), (
                "new leaves are evictable"
            )
            check_structure(cache)


@seeded
def test_part3_insert_takes_whole_blocks_only_and_checks_first(rng):
    size = rng.randint(1, 6)
    cache = Cache(size, radix_trees.reference_hash)
    made = random_tree(rng, cache, rng.randint(1, 6))
    long = grow(cache, cache.root, [100 + t for t in range(2 * size)], [77_000, 77_001])
    before = snapshot(cache)
    for k in range(6):
        blocks = rng.sample(range(50_000, 60_000), rng.randint(0, 4))
        cached = path_key(cache, rng.choice(made))
        count = rng.choice([n for n in range(len(cached) + size + 2) if n != size * len(blocks)])
        tokens = (cached + [rng.randrange(9) for _ in range(count)])[:count]
        if k == 0:  # its first block is cached inside a longer edge: a walk would split it
            tokens = [*long.key[:size], rng.randrange(9)]
            blocks = [rng.randrange(50_000, 60_000)]
        want = f"insert takes whole blocks: {len(tokens)} tokens for {len(blocks)} blocks of {size}"
        with pytest.raises(ValueError) as raised:
            insert(cache, tokens, blocks)
        assert str(raised.value) == want, f"expected {want!r}, got {raised.value!r}"
        assert snapshot(cache) == before, (
            "a refused insert changes nothing (checked before the walk could split an edge)"
        )


@seeded
def test_part3_insert_stamps_its_path_once(rng):
    size = rng.randint(1, 4)
    cache, vocab = Cache(size, radix_trees.reference_hash), 3
    ids = iter(rng.sample(range(10**6), 400))
    for _ in range(25):
        for node in cache._nodes():
            node.last_access = rng.randint(0, 100)
        before = {id(n): n.last_access for n in cache._nodes()}
        cache._clock = clock = rng.randint(100, 10**6)
        tokens = [rng.randrange(vocab) for _ in range(size * rng.randint(1, 4))]
        insert(cache, tokens, [next(ids) for _ in range(len(tokens) // size)])
        assert cache._clock == clock + 1, "an insert is one use of its path: one tick"
        end = max(
            (n for n in cache._nodes() if tokens[: len(path_key(cache, n))] == path_key(cache, n)),
            key=lambda n: len(path_key(cache, n)),
        )
        on_path, node = set(), end
        while node is not cache.root:
            on_path.add(id(node))
            node = node.parent
        for node in cache._nodes():
            if id(node) in on_path:
                assert node.last_access == clock + 1, (
                    f"the inserted path (to the new leaf, or where the cached prefix ends) is "
                    f"used now (tick {clock + 1}), got {node.last_access}"
                )
            elif id(node) in before:
                assert node.last_access == before[id(node)], (
                    "a node off the inserted path (a split-off tail included) keeps its stamp"
                )


@seeded
def test_part3_a_collision_records_nothing_and_a_new_leaf_is_evictable(rng):
    size = rng.randint(1, 4)
    cache = Cache(size, radix_trees.colliding_hash)
    first = [rng.randrange(50) for _ in range(size * rng.randint(1, 3))]
    assert insert(cache, first, rng.sample(range(100), len(first) // size)) == 0
    model = paths(cache)
    other = list(first)
    other[rng.randrange(size)] += 1
    clock = cache._clock
    assert insert(cache, other, rng.sample(range(200, 300), len(other) // size)) == 0, (
        "nothing of the colliding prompt was cached"
    )
    assert paths(cache) == model and cache.total_size == len(model), (
        "another child sits under the new leaf's hash (a collision): nothing more is recorded"
    )
    assert cache._clock == clock + 1, "the path is used now all the same: one tick"
    cache = Cache(size, radix_trees.reference_hash)
    made = random_tree(rng, cache, rng.randint(1, 6))
    locked = rng.choice(made)
    node = locked
    while node is not cache.root:  # locked by hand: this part's tests do not run part 4.5
        node.lock_ref += 1
        node = node.parent
    protected = sum(len(n.blocks) for n in cache._nodes() if n.lock_ref)
    cache.evictable_size, cache.protected_size = cache.total_size - protected, protected
    extra = rng.randint(1, 3)
    tokens = path_key(cache, locked) + [rng.randrange(1000, 2000) for _ in range(extra * size)]
    evictable = cache.evictable_size
    insert(cache, tokens, [*rng.sample(range(10**5, 10**6), len(tokens) // size)])
    assert (cache.evictable_size, cache.protected_size) == (evictable + extra, protected), (
        f"the {extra} new blocks hang under a locked node as a new leaf, which is not locked: "
        f"evictable, got evictable {cache.evictable_size}, protected {cache.protected_size}"
    )


# ---- Part 4.5: locks --------------------------------------------------------------------------


def lock_refs(cache: RadixCache, locks: dict[int, int]) -> dict[int, int]:
    """lock_ref of each node: the locks on it or below it (``locks``: by node id)."""

    def count(node: TreeNode) -> int:
        return locks.get(node.node_id, 0) + sum(count(c) for c in node.children.values())

    return {n.node_id: count(n) for n in cache._nodes()}


@seeded
def test_part4_lock_ref_counts_the_locks_on_a_node_or_below(rng):
    for _ in range(4):
        cache = Cache(rng.randint(1, 4), radix_trees.reference_hash)
        made = random_tree(rng, cache, rng.randint(1, 12))
        locks: dict[int, int] = {}
        for step in range(40):
            held = [n for n in made if locks.get(n.node_id)]
            if held and rng.random() < 0.4:
                node = rng.choice(held)
                cache.unlock(node)
                locks[node.node_id] -= 1
                op = f"unlock({node.key})"
            else:
                node = rng.choice(made)
                cache.lock(node)
                locks[node.node_id] = locks.get(node.node_id, 0) + 1
                op = f"lock({node.key})"
            want = lock_refs(cache, locks)
            got = {n.node_id: n.lock_ref for n in made}
            assert got == want, (
                f"step {step}, after {op}: a lock counts on the node and every ancestor but the "
                f"root, an unlock undoes one: lock_ref by node id expected {want}, got {got}"
            )
            protected = sum(len(n.blocks) for n in made if want[n.node_id])
            sizes = (cache.evictable_size, cache.protected_size)
            assert sizes == (cache.total_size - protected, protected), (
                f"step {step}: the locked nodes' {protected} blocks are protected, the rest "
                f"evictable: expected {(cache.total_size - protected, protected)}, got {sizes}"
            )
            assert cache.root.lock_ref == 0, "the root is never locked"


@seeded
def test_part4_unlocking_a_node_that_is_not_locked_is_refused_and_changes_nothing(rng):
    cache = Cache(rng.randint(1, 4), radix_trees.reference_hash)
    made = random_tree(rng, cache, rng.randint(2, 10))
    for node in rng.sample(made, rng.randint(0, len(made) - 1)):
        cache.lock(node)
    free = [n for n in made if n.lock_ref == 0]
    if not free:
        free = [grow(cache, cache.root, [999] * cache.block_size, [99_999])]
    before = snapshot(cache)
    with pytest.raises(ValueError, match=r"^unlock of a node that is not locked$"):
        cache.unlock(rng.choice(free))
    assert snapshot(cache) == before, "a refused unlock changes nothing, not even the ancestors"


@seeded
def test_part4_locking_or_unlocking_the_root_does_nothing(rng):
    cache = Cache(rng.randint(1, 4), radix_trees.reference_hash)
    made = random_tree(rng, cache, rng.randint(1, 8))
    for node in rng.sample(made, rng.randint(0, len(made))):
        cache.lock(node)
    before = snapshot(cache)
    for _ in range(rng.randint(1, 3)):
        cache.lock(cache.root)
    cache.unlock(cache.root)
    assert snapshot(cache) == before, "lock(root) and unlock(root) change nothing"


# ---- Part 4.6: evict --------------------------------------------------------------------------


def stamped_tree(rng):
    """A random tree with random stamps (ties likely) and some paths locked by hand."""
    cache = Cache(rng.randint(1, 4), radix_trees.reference_hash)
    made = random_tree(rng, cache, rng.randint(1, 14))
    for node in reversed(made):  # children were made after their parents
        node.last_access = rng.randint(0, 6)
    for node in reversed(made):  # a parent is never older than its children (the invariant)
        if node.parent is not cache.root:
            node.parent.last_access = max(node.parent.last_access, node.last_access)
    for node in rng.sample(made, rng.randint(0, min(2, len(made)))):
        while node is not cache.root:
            node.lock_ref += 1
            node = node.parent
    protected = sum(len(n.blocks) for n in made if n.lock_ref)
    cache.evictable_size, cache.protected_size = cache.total_size - protected, protected
    return cache, made


def expected_evict(cache: RadixCache, num_blocks: int) -> tuple[list[int], set[int]]:
    """The rule by a plain scan: while fewer than ``num_blocks`` are out, remove the unlocked
    leaf of smallest (last_access, node_id); a parent left childless becomes a leaf."""
    children = {n.node_id: len(n.children) for n in cache._nodes()}
    alive = {n.node_id: n for n in cache._nodes()}
    out: list[int] = []
    while len(out) < num_blocks:
        leaves = [n for i, n in alive.items() if children[i] == 0 and n.lock_ref == 0]
        if not leaves:
            break
        leaf = min(leaves, key=lambda n: (n.last_access, n.node_id))
        out += leaf.blocks
        del alive[leaf.node_id]
        if leaf.parent is not cache.root:
            children[leaf.parent.node_id] -= 1
    return out, set(alive)


@seeded
def test_part4_evict_removes_unlocked_leaves_least_recently_used_first(rng):
    for _ in range(8):
        cache, _ = stamped_tree(rng)
        for _ in range(3):
            n = rng.randint(0, cache.total_size + 2)
            want, alive = expected_evict(cache, n)
            stamps = sorted((x.last_access, x.node_id, x.blocks) for x in cache._nodes())
            got = cache.evict(n)
            assert got == want, (
                f"evict({n}) removes unlocked leaves, smallest (last_access, node_id) first, "
                f"each whole (its blocks in edge order), a parent left a leaf joining them, until "
                f"at least {n} blocks are out: nodes (last_access, node_id, blocks) {stamps}; "
                f"expected {want}, got {got}"
            )
            assert {x.node_id for x in cache._nodes()} == alive, "the evicted nodes leave the tree"
            check_structure(cache)


@seeded
def test_part4_a_parent_left_a_leaf_joins_with_its_own_age(rng):
    for _ in range(4):
        size = rng.randint(1, 4)
        cache = Cache(size, radix_trees.reference_hash)
        young, middle, old = sorted(rng.sample(range(1, 1000), 3), reverse=True)
        ids = iter(rng.sample(range(10_000), 12))
        parent = grow(cache, cache.root, [1] * size, [next(ids) for _ in range(1)])
        count = rng.randint(1, 3)
        leaf = grow(cache, parent, [2] * size * count, [next(ids) for _ in range(count)])
        count = rng.randint(1, 3)
        other = grow(cache, cache.root, [3] * size * count, [next(ids) for _ in range(count)])
        parent.last_access, leaf.last_access, other.last_access = young, old, middle
        got = cache.evict(len(leaf.blocks) + 1)
        want = leaf.blocks + other.blocks
        assert got == want, (
            f"leaf {leaf.blocks} (last_access {old}) goes first; then the candidates are "
            f"{other.blocks} ({middle}) and its parent {parent.blocks}, now a leaf, which joins "
            f"with its own last_access {young}: so {other.blocks} goes next; expected {want}, "
            f"got {got}"
        )


@seeded
def test_part4_a_negative_count_is_refused_and_zero_evicts_nothing(rng):
    cache, _ = stamped_tree(rng)
    before = snapshot(cache)
    value = -rng.randint(1, 10**6)
    with pytest.raises(ValueError) as raised:
        cache.evict(value)
    want = f"num_blocks must be >= 0, got {value}"
    assert str(raised.value) == want, f"expected {want!r}, got {raised.value!r}"
    assert cache.evict(0) == [] and snapshot(cache) == before, "evict(0) removes nothing"


@seeded
def test_part4_only_locked_paths_survive_evicting_everything(rng):
    for _ in range(6):
        cache, made = stamped_tree(rng)
        locked = {n.node_id for n in made if n.lock_ref}
        protected = cache.protected_size
        everything = cache.total_size + rng.randint(0, 5)
        want, _ = expected_evict(cache, everything)
        out = cache.evict(everything)
        assert out == want, (
            "evicting everything goes leaf by leaf, oldest (last_access, node_id) first, a "
            f"parent left a leaf joining with its own stamp: expected {want}, got {out}"
        )
        assert {n.node_id for n in cache._nodes()} == locked, (
            "evicting more than the tree holds removes every unlocked node, leaves first, and "
            "never a locked one"
        )
        assert sorted(out) == sorted(b for n in made if n.node_id not in locked for b in n.blocks)
        assert (cache.evictable_size, cache.protected_size) == (0, protected)
        assert cache.evict(rng.randint(1, 5)) == [], "nothing evictable is left"


# ---- Part 4.1: a sequence's block hashes ------------------------------------------------------


def oracle_chain(tokens, size: int, count: int) -> list[int]:
    """xxh64 of each block after its parent's 8 bytes, from the bytes (not block_hash)."""
    hashes, last = [], None
    for i in range(count):
        data = (b"" if last is None else last.to_bytes(8, "little")) + b"".join(
            t.to_bytes(4, "little") for t in tokens[i * size : (i + 1) * size]
        )
        last = xxhash.xxh64(data).intdigest()
        hashes.append(last)
    return hashes


@seeded
def test_part1_hash_blocks_grows_with_a_sequence_hashing_each_block_once(rng):
    size = rng.randint(1, 8)
    tokens = [rng.randrange(50_000) for _ in range(size * rng.randint(3, 12) + rng.randrange(size))]
    calls = []

    def counted(parent, block):
        calls.append(tuple(block))
        return block_hash(parent, block)

    hashes: list[int] = []
    shown = rng.randint(1, size)
    while shown <= len(tokens):
        full = shown // size
        assert hash_blocks(hashes, tokens[:shown], size, full, counted) is hashes
        assert hashes == oracle_chain(tokens, size, full), (
            f"after {shown} tokens (block size {size}) the list holds the chained hash of each "
            f"of the {full} full blocks"
        )
        shown += rng.randint(1, 2 * size)
    assert len(calls) == len(hashes), (
        f"{len(hashes)} blocks filled, {len(calls)} hashes computed: each block is hashed once"
    )


@seeded
def test_part1_hash_blocks_refuses_blocks_the_tokens_do_not_fill(rng):
    size = rng.randint(2, 8)
    tokens = [
        rng.randrange(100) for _ in range(size * rng.randint(1, 4) + rng.randint(1, size - 1))
    ]
    count = len(tokens) // size + 1
    hashes = oracle_chain(tokens, size, rng.randint(0, count - 1))
    before = list(hashes)
    with pytest.raises(ValueError, match=r"^only full blocks are hashed: "):
        hash_blocks(hashes, tokens, size, count)
    assert hashes == before, "a refused call changes nothing"


# ---- The BlockManager (parts 4.5-4.9): helpers ------------------------------------------------


def new_manager(size: int, gpu: int, cpu: int = 0) -> PrefixCachingBlockManager:
    m = PrefixCachingBlockManager(size, gpu, cpu, watermark=0.0)
    m.hash_function = radix_trees.reference_hash
    return m


def place(m: PrefixCachingBlockManager, seq_id: int, tokens) -> Sequence:
    seq = Sequence(seq_id, list(tokens), m.block_size)
    BlockManager.allocate(m, seq)
    m._locked[seq_id], m._num_cached[seq_id], m._unmerged[seq_id] = m.tree.root, 0, seq
    return seq


def tree_paths(m: PrefixCachingBlockManager) -> dict[tuple[int, ...], int]:
    """Every cached prefix (whole blocks) and the block that ends it."""
    found: dict[tuple[int, ...], int] = {}
    size = m.block_size

    def walk(node, prefix):
        for i, block in enumerate(node.blocks):
            found[prefix + tuple(node.key[: (i + 1) * size])] = block
        for child in node.children.values():
            walk(child, prefix + tuple(node.key))

    walk(m.tree.root, ())
    return found


def check_manager(m: PrefixCachingBlockManager, on_gpu: list[Sequence]) -> None:
    """The manager's invariants, from the blocks, the tables and the tree."""
    allocator, paths = m.gpu_allocator, tree_paths(m)
    holders = [0] * allocator.num_blocks
    for seq in on_gpu:
        for block_id in seq.block_table:
            holders[block_id] += 1
    assert [b.ref_count for b in allocator.blocks] == holders, "ref_count != holders"
    where = radix_trees.cached_blocks(m)
    for seq in on_gpu:
        size = m.block_size
        for i, block_id in enumerate(seq.block_table):
            if block_id in where:
                assert paths.get(tuple(seq.token_ids[: (i + 1) * size])) == block_id, (
                    f"sequence {seq.seq_id} holds cached block {block_id} at index {i}, which "
                    "the tree keeps for another prefix"
                )


# ---- Part 4.5 ---------------------------------------------------------------------------------


@seeded
def test_part5_random_chunked_prefills_share_every_computed_block(rng):
    size = rng.randint(1, 4)
    bases = [[rng.randrange(6) for _ in range(size * rng.randint(1, 4))] for _ in range(3)]
    m = new_manager(size, 400)
    seqs = []
    for seq_id in range(rng.randint(3, 7)):
        tokens = rng.choice(bases) + [rng.randrange(6) for _ in range(rng.randint(1, 3 * size))]
        seqs.append(place(m, seq_id, tokens))
    for _ in range(12):
        for seq in seqs:
            seq.num_computed_tokens = min(
                seq.num_tokens, seq.num_computed_tokens + rng.randint(0, 3)
            )
        m._merge_computed()
        check_manager(m, seqs)
        paths = tree_paths(m)
        for seq in seqs:
            full = seq.num_computed_tokens // size
            for i in range(full):
                prefix = tuple(seq.token_ids[: (i + 1) * size])
                assert prefix in paths, (
                    f"sequence {seq.seq_id} computed {seq.num_computed_tokens} tokens: its "
                    f"block {i} must be cached after the merge"
                )
                assert seq.block_table[i] == paths[prefix], (
                    f"sequence {seq.seq_id}, block {i}: it must hold the tree's block for that "
                    "prefix (a duplicate is switched to the tree's and freed)"
                )
        distinct = {b for seq in seqs for b in seq.block_table}
        assert m.num_free_gpu_blocks == 400 - len(distinct), "duplicates are freed"


@seeded
def test_part5_a_merge_hashes_only_the_blocks_filled_since_the_last(rng):
    size = rng.randint(1, 4)
    m = new_manager(size, 100)
    calls = []

    def counted(parent, block):
        calls.append(1)
        return radix_trees.reference_hash(parent, block)

    m.hash_function = counted
    seq = place(m, 0, [rng.randrange(9) for _ in range(size * rng.randint(3, 9) + 1)])
    while seq.num_computed_tokens < seq.num_tokens:
        seq.num_computed_tokens = min(seq.num_tokens, seq.num_computed_tokens + rng.randint(1, 5))
        m._merge(seq)
    assert len(calls) == seq.num_tokens // size, (
        f"{seq.num_tokens // size} full blocks, {len(calls)} hashes: each block hashed once"
    )


@seeded
def test_part5_each_sequence_locks_its_cached_path_until_it_is_released(rng):
    size = rng.randint(1, 4)
    bases = [[rng.randrange(5) for _ in range(size * rng.randint(1, 3))] for _ in range(3)]
    m = new_manager(size, 400)
    seqs = []
    for seq_id in range(rng.randint(2, 6)):
        tokens = rng.choice(bases) + [rng.randrange(5) for _ in range(rng.randint(1, 3 * size))]
        seqs.append(place(m, seq_id, tokens))

    def locked_blocks(live):  # the tree's blocks of every live sequence's computed full blocks
        return {b for seq in live for b in seq.block_table[: seq.num_computed_tokens // size]}

    for _ in range(6):
        for seq in seqs:
            seq.num_computed_tokens = min(
                seq.num_tokens, seq.num_computed_tokens + rng.randint(0, 2 * size)
            )
        m._merge_computed()
        want = len(locked_blocks(seqs))
        assert m.tree.protected_size == want, (
            f"each sequence locks the path of its merged blocks (one lock, at its end): "
            f"{want} blocks protected, got {m.tree.protected_size}"
        )
    rng.shuffle(seqs)
    while seqs:
        gone = seqs.pop()
        m._release(gone)
        want = len(locked_blocks(seqs))
        assert m.tree.protected_size == want, (
            f"released sequence {gone.seq_id}: only the others' paths stay locked, {want} "
            f"blocks; got {m.tree.protected_size}"
        )
        assert gone.seq_id not in m._locked and gone.seq_id not in m._num_cached, (
            f"release forgets sequence {gone.seq_id}'s records"
        )
    assert m.tree.evictable_size == m.tree.total_size == len(tree_paths(m)), (
        f"every sequence released: all {len(tree_paths(m))} cached blocks are unlocked, "
        f"evictable; the tree counts {m.tree.evictable_size} evictable of {m.tree.total_size}"
    )


# ---- Part 4.6 ---------------------------------------------------------------------------------


@seeded
def test_part6_make_room_evicts_what_the_free_list_lacks_oldest_prefix_first(rng):
    size = rng.randint(1, 4)
    count = rng.randint(2, 6)
    lengths = [rng.randint(1, 3) for _ in range(count)]
    pool = sum(lengths) + rng.randint(0, 4)
    m = new_manager(size, pool)
    prefixes = []
    for i, blocks in enumerate(lengths):  # distinct first tokens: each prefix is a root leaf
        tokens = [1000 + i] + [rng.randrange(5) for _ in range(blocks * size - 1)]
        prefixes.append(radix_trees.seed_prefix(m, tokens))
    order = list(range(count))
    rng.shuffle(order)
    leaves = {node.blocks[0]: node for node in m.tree.root.children.values()}
    for stamp, i in enumerate(order):
        leaves[prefixes[i][0]].last_access = stamp + 1
    asked = rng.randint(0, pool)
    free_list = pool - sum(lengths)
    missing, gone = max(0, asked - free_list), set()
    for i in order:  # the oracle: oldest whole leaves until enough are out
        if missing <= 0:
            break
        gone.add(i)
        missing -= lengths[i]
    m._make_room(asked)
    kept = {i for i in range(count) if set(prefixes[i]) <= set(tree_paths(m).values())}
    assert kept == set(range(count)) - gone, (
        f"{asked} free blocks asked for, {free_list} uncached free: the oldest prefixes go "
        f"whole until enough are out; expected to keep {sorted(set(range(count)) - gone)}, "
        f"kept {sorted(kept)}"
    )
    assert len(m.gpu_allocator.evictor) == m.tree.evictable_size
    evicted = [b for i in gone for b in prefixes[i]]
    assert all(m.gpu_allocator.blocks[b].content_hash is None for b in evicted)


@seeded
def test_part6_after_make_room_the_free_list_serves_and_the_evictor_is_the_tree(rng):
    size = rng.randint(1, 4)
    pool = rng.randint(8, 24)
    m = new_manager(size, pool)
    stems = [[rng.randrange(3) for _ in range(size * rng.randint(1, 2))] for _ in range(2)]
    for _ in range(rng.randint(2, 6)):
        tokens = rng.choice(stems) + [rng.randrange(3) for _ in range(size * rng.randint(1, 2))]
        if len(tokens) // size > pool - m.tree.total_size:
            break
        radix_trees.seed_prefix(m, tokens)
    before, uncached = dict(tree_paths(m)), pool - m.tree.total_size
    asked = rng.randint(0, pool + 3)
    m._make_room(asked)
    free_list = m.gpu_allocator.num_free_blocks - len(m.gpu_allocator.evictor)
    if asked <= uncached:
        assert tree_paths(m) == before, (
            f"{asked} asked for, {uncached} uncached free blocks: nothing is evicted"
        )
    else:
        assert free_list >= min(asked, pool), (
            f"{asked} asked for: at least {min(asked, pool)} uncached free blocks after "
            f"make_room (everything evictable when more than the pool), got {free_list}"
        )
    kept = dict(tree_paths(m))
    taken = [m.gpu_allocator.allocate().block_id for _ in range(min(asked, free_list))]
    assert tree_paths(m) == kept and not set(taken) & set(kept.values()), (
        f"the {len(taken)} blocks asked for come from the free list, never from the tree's "
        f"evictable blocks {sorted(kept.values())}: got {taken}"
    )
    assert len(m.gpu_allocator.evictor) == m.tree.evictable_size == len(kept), (
        f"the Evictor holds exactly the tree's {len(kept)} unlocked blocks: got "
        f"{len(m.gpu_allocator.evictor)} in the Evictor, {m.tree.evictable_size} evictable"
    )


# ---- Part 4.7 ---------------------------------------------------------------------------------


@seeded
def test_part7_a_hit_is_the_longest_cached_block_aligned_prefix(rng):
    size = rng.randint(1, 4)
    m = new_manager(size, 300)
    cached = []
    for _ in range(rng.randint(1, 4)):
        tokens = [rng.randrange(4) for _ in range(size * rng.randint(1, 5))]
        ids = radix_trees.seed_prefix(m, tokens)
        cached.append((tokens, ids))
    paths = dict(tree_paths(m))
    for seq_id in range(rng.randint(2, 6)):
        base, _ = rng.choice(cached)
        tokens = base[: rng.randint(1, len(base))] + [
            rng.randrange(4) for _ in range(rng.randint(0, 6))
        ]
        limit = (len(tokens) - 1) // size
        expected = []
        for i in range(limit):
            block = paths.get(tuple(tokens[: (i + 1) * size]))
            if block is None:
                break
            expected.append(block)
        seq = Sequence(seq_id, tokens, size)
        assert m.num_cached_tokens(seq) == len(expected) * size
        queries, hits = m.num_query_tokens, m.num_hit_tokens
        m.allocate(seq)
        assert seq.block_table[: len(expected)] == expected, (
            f"prompt {tokens}: the hit is the tree's blocks {expected}, never the last token's"
        )
        assert seq.num_computed_tokens == len(expected) * size
        assert (m.num_query_tokens - queries, m.num_hit_tokens - hits) == (
            len(tokens),
            len(expected) * size,
        )
        for i, block in enumerate(expected):  # the hit's blocks now hold another holder
            paths[tuple(tokens[: (i + 1) * size])] = block
        for i in range(len(expected), len(tokens) // size):
            paths.setdefault(tuple(tokens[: (i + 1) * size]), None)
        paths = {k: v for k, v in paths.items() if v is not None}


@seeded
def test_part7_can_allocate_charges_only_the_uncached_blocks_in_use(rng):
    size = rng.randint(1, 4)
    shared = [rng.randrange(9) for _ in range(size * rng.randint(1, 4))]
    m = new_manager(size, len(shared) // size + 4)
    radix_trees.seed_prefix(m, shared)
    holder = Sequence(0, [*shared, 1], size)
    m.allocate(holder)
    extra = rng.randint(1, 4 * size)
    other = Sequence(1, [*shared, *[2] * extra], size)
    need = other.num_blocks - len(shared) // size
    free = m.num_free_gpu_blocks
    if other.num_blocks > m.num_gpu_blocks:
        expected = AllocStatus.NEVER
    elif need <= free:
        expected = AllocStatus.OK
    else:
        expected = AllocStatus.LATER
    assert m.can_allocate(other) is expected, (
        f"{other.num_blocks} blocks, {len(shared) // size} cached and in use, {free} free: "
        f"expected {expected.name}"
    )


@seeded
def test_part7_allocations_lock_their_hits_and_misses_lock_nothing(rng):
    size = rng.randint(1, 4)
    m = new_manager(size, 300)
    cached = [
        [rng.randrange(4) for _ in range(size * rng.randint(1, 5))]
        for _ in range(rng.randint(1, 3))
    ]
    for tokens in cached:
        radix_trees.seed_prefix(m, tokens)
    hit_blocks: set[int] = set()
    for seq_id in range(rng.randint(2, 6)):
        if rng.random() < 0.7:
            base = rng.choice(cached)
            tokens = base[: rng.randint(1, len(base))] + [rng.randrange(4) for _ in range(3)]
        else:  # a miss: a first token no cached prefix starts with
            tokens = [9] + [rng.randrange(4) for _ in range(rng.randint(0, 3 * size))]
        seq = Sequence(seq_id, tokens, size)
        m.allocate(seq)
        hit = seq.num_computed_tokens // size
        hit_blocks |= set(seq.block_table[:hit])
        assert m.tree.protected_size == len(hit_blocks), (
            f"prompt {tokens} hit {hit} blocks: each admission locks the path of its hit (a "
            f"miss locks nothing); {len(hit_blocks)} blocks protected, got "
            f"{m.tree.protected_size}"
        )
        assert m.tree.evictable_size == m.tree.total_size - len(hit_blocks), (
            f"every cached block no admission hit stays evictable: "
            f"{m.tree.total_size - len(hit_blocks)}, got {m.tree.evictable_size}"
        )


# ---- Part 4.8 ---------------------------------------------------------------------------------


def optimum(trace, size: int) -> list[int]:
    seen, best = [], []
    for prompt_ids, output in trace:
        shared = 0
        for earlier in seen:
            common = 0
            while (
                common < min(len(earlier), len(prompt_ids))
                and earlier[common] == prompt_ids[common]
            ):
                common += 1
            shared = max(shared, common)
        best.append(min(shared // size * size, (len(prompt_ids) - 1) // size * size))
        seen.append((prompt_ids + output)[:-1])
    return best


@seeded
def test_part8_random_traces_hit_the_block_aligned_optimum(rng):
    size = rng.randint(1, 8)
    stems = [[rng.randrange(7) for _ in range(rng.randint(1, 30))] for _ in range(3)]
    trace = []
    for _ in range(rng.randint(5, 15)):
        if trace and rng.random() < 0.3:  # a chat turn: an earlier prompt and answer, then more
            prompt_ids, output = rng.choice(trace)
            prompt_ids = prompt_ids + output + [rng.randrange(7) for _ in range(rng.randint(1, 5))]
        else:
            prompt_ids = rng.choice(stems) + [rng.randrange(7) for _ in range(rng.randint(1, 9))]
        trace.append((prompt_ids, [rng.randrange(7) for _ in range(rng.randint(1, 9))]))
    m = new_manager(size, 2000)
    hits = radix_trees.serve_one_at_a_time(m, trace, after_each=lambda: check_manager(m, []))
    assert hits == optimum(trace, size), (
        f"block size {size}: hits {hits}, the block-aligned optimum {optimum(trace, size)}"
    )


# ---- Part 4.9 ---------------------------------------------------------------------------------


@seeded
def test_part9_random_runs_keep_every_slot_holding_its_own_prefix(rng):
    size = rng.randint(1, 3)
    m = new_manager(size, rng.randint(6, 14), 12)
    lengths = [rng.randint(2, 3), rng.randint(2, 8), rng.randint(2, 8)]
    bases = [[rng.randrange(4) for _ in range(length)] for length in lengths]
    slots: dict = {}
    gpu, cpu, next_id = [], [], 0

    def write(seq, start, end):
        for pos in range(start, end):
            slots["gpu", seq.block_table[pos // size], pos % size] = tuple(seq.token_ids[: pos + 1])
        seq.num_computed_tokens = end

    def move(src, dst, mapping):
        for a, b in mapping.items():
            for off in range(size):
                slots[dst, b, off] = slots.get((src, a, off))

    # the run opens with the part's own operations on a sequence that fits any pool drawn (the
    # first base: at most 5 of at least 6 blocks, decoded), so that no draw leaves them unused
    opening = ["admit", "decode", "swap_out", "swap_in"]
    for step in range(120):
        ops = ["admit", "decode", "decode", "fork", "free", "swap_out", "swap_in"]
        op = opening[step] if step < len(opening) else rng.choice(ops)
        if op == "admit":
            base = bases[0] if step == 0 else rng.choice(bases)
            seq = Sequence(next_id, [*base, rng.randrange(4)], size)
            next_id += 1
            if m.can_allocate(seq) is AllocStatus.OK:
                m.allocate(seq)
                write(seq, seq.num_computed_tokens, seq.num_tokens)
                seq.append_token(rng.randrange(4))
                gpu.append(seq)
        elif op == "decode" and gpu:
            seq = rng.choice(gpu)
            if m.can_append_slot(seq):
                copy = m.append_slot(seq)
                if copy is not None:
                    move("gpu", "gpu", {copy[0]: copy[1]})
                write(seq, seq.num_tokens - 1, seq.num_tokens)
                seq.append_token(rng.randrange(4))
        elif op == "fork" and gpu:
            parent = rng.choice(gpu)
            child = Sequence(next_id, parent.token_ids, size)
            next_id += 1
            m.fork(parent, child)
            child.num_computed_tokens = parent.num_computed_tokens
            gpu.append(child)
        elif op == "free" and gpu:
            seq = rng.choice(gpu)
            gpu.remove(seq)
            seq.status = SequenceStatus.FINISHED_STOPPED
            m.free(seq)
        elif op == "swap_out" and gpu:
            seq = rng.choice(gpu)
            if m.can_swap_out([seq]):
                move("gpu", "cpu", m.swap_out([seq]))
                gpu.remove(seq)
                cpu.append(seq)
        elif op == "swap_in" and cpu:
            seq = rng.choice(cpu)
            if m.can_swap_in([seq]) is AllocStatus.OK:
                move("cpu", "gpu", m.swap_in([seq]))
                cpu.remove(seq)
                gpu.append(seq)
        check_manager(m, gpu)
        for seq in gpu:
            for pos in range(seq.num_computed_tokens):
                got = slots.get(("gpu", seq.block_table[pos // size], pos % size))
                assert got == tuple(seq.token_ids[: pos + 1]), (
                    f"after {op}: sequence {seq.seq_id} position {pos} reads the K/V of "
                    f"{got}, not of its own prefix"
                )


@seeded
def test_part6_make_room_never_touches_a_locked_prefix_and_frees_without_content(rng):
    size = rng.randint(1, 4)
    count = rng.randint(2, 5)
    m = new_manager(size, count * 3 + rng.randint(0, 3))
    prefixes = [
        radix_trees.seed_prefix(m, [2000 + i] + [1] * (size * rng.randint(1, 3) - 1))
        for i in range(count)
    ]
    locked = rng.sample(range(count), rng.randint(1, count - 1))
    for i in locked:
        node = m.tree.root.children[
            next(h for h, n in m.tree.root.children.items() if n.blocks[0] == prefixes[i][0])
        ]
        for block_id in prefixes[i]:
            m.gpu_allocator.reuse(block_id)
        m.tree.lock(node)
    m._make_room(m.num_gpu_blocks)
    cached = set(tree_paths(m).values())
    for i in range(count):
        if i in locked:
            assert set(prefixes[i]) <= cached, f"locked prefix {i} was evicted"
        else:
            assert not set(prefixes[i]) & cached, f"unlocked prefix {i} should have gone"
            for block_id in prefixes[i]:
                block = m.gpu_allocator.blocks[block_id]
                assert block.content_hash is None and block_id not in m.gpu_allocator.evictor
    assert len(m.gpu_allocator.evictor) == m.tree.evictable_size == 0


@seeded
def test_part8_identical_prompts_freed_unmerged_leave_one_cached_copy(rng):
    size = rng.randint(1, 4)
    tokens = [rng.randrange(9) for _ in range(size * rng.randint(1, 5) + rng.randint(1, size))]
    m = new_manager(size, 200)
    seqs = [Sequence(i, tokens, size) for i in range(rng.randint(2, 5))]
    for seq in seqs:
        m.allocate(seq)  # the same step: none computed yet, no hit
    for seq in seqs:
        seq.num_computed_tokens, seq.is_prefill = seq.num_tokens, False
        seq.append_token(1)
    rng.shuffle(seqs)
    for index, seq in enumerate(seqs):
        seq.status = SequenceStatus.FINISHED_STOPPED
        m.free(seq)
        check_manager(m, seqs[index + 1 :])
    assert m.tree.total_size == len(tokens) // size, "one cached copy of each full block"
    assert len(m.gpu_allocator.evictor) == len(tokens) // size, "the duplicates are uncached"
    assert m.num_free_gpu_blocks == 200 and not m._counted


@seeded
def test_part8_forked_children_lock_the_parents_path(rng):
    size = rng.randint(1, 4)
    m = new_manager(size, 200)
    parent = Sequence(0, [rng.randrange(9) for _ in range(size * rng.randint(1, 4) + 1)], size)
    m.allocate(parent)
    parent.num_computed_tokens, parent.is_prefill = parent.num_tokens, False
    parent.append_token(2)
    children = []
    for i in range(rng.randint(1, 4)):
        child = Sequence(i + 1, parent.token_ids, size)
        m.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        children.append(child)
    group = [parent, *children]
    check_manager(m, group)
    node = m._locked[0]
    assert all(m._locked[c.seq_id] is node for c in children)
    assert node.lock_ref == len(group), f"lock_ref {node.lock_ref}, {len(group)} holders"
    rng.shuffle(group)
    for seq in group:
        seq.status = SequenceStatus.FINISHED_STOPPED
        m.free(seq)
    assert all(n.lock_ref == 0 for n in m.tree._nodes())


@seeded
def test_part9_swap_out_then_in_goes_back_onto_the_trees_blocks(rng):
    size = rng.randint(1, 4)
    tokens = [rng.randrange(9) for _ in range(size * rng.randint(1, 4) + rng.randint(1, size))]
    m = new_manager(size, 100, 100)
    seq = Sequence(0, tokens, size)
    m.allocate(seq)
    seq.num_computed_tokens, seq.is_prefill = seq.num_tokens, False
    seq.append_token(3)
    m.append_slot(seq)
    cached = seq.block_table[: len(tokens) // size]
    m.swap_out([seq])
    assert m.tree.protected_size == 0 and m.tree.evictable_size == len(cached)
    check_manager(m, [])
    m.swap_in([seq])
    m.append_slot(seq)
    assert seq.block_table[: len(cached)] == cached, "the next decode merges it back"
    check_manager(m, [seq])


@seeded
def test_part9_prompts_admitted_together_share_their_full_blocks_from_the_first_decode(rng):
    size = rng.randint(1, 4)
    bases = [[rng.randrange(3) for _ in range(size * rng.randint(1, 3))] for _ in range(2)]
    m = new_manager(size, 300)
    seqs = []
    for seq_id in range(rng.randint(2, 6)):
        tail = [rng.randrange(3) for _ in range(rng.randint(0, 2 * size))]
        seq = Sequence(seq_id, rng.choice(bases) + tail, size)
        m.allocate(seq)  # nothing is cached yet: every prompt computes all its blocks
        seqs.append(seq)
    for seq in seqs:  # the prefill step computed every prompt; each decodes its first token
        seq.num_computed_tokens = seq.num_tokens
        seq.append_token(rng.randrange(3))
    for seq in seqs:
        m.append_slot(seq)
    full = {tuple(seq.token_ids[: (i + 1) * size]) for seq in seqs
            for i in range((seq.num_tokens - 1) // size)}  # fmt: skip
    private = sum(len(seq.block_table) - (seq.num_tokens - 1) // size for seq in seqs)
    distinct = {b for seq in seqs for b in seq.block_table}
    assert len(distinct) == len(full) + private, (
        f"after their first decodes the prompts' full blocks are merged: one block per cached "
        f"prefix ({len(full)}) plus each sequence's own blocks ({private}), "
        f"{len(full) + private} in all; the tables hold {len(distinct)}"
    )
    check_manager(m, seqs)
