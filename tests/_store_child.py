"""One process of the store's cross-process test (tests/test_store*.py run it):

    python tests/_store_child.py ROLE URL SPEC_JSON PROMPT_NPY NEW_NPY [OUT_NPY]

writer: computes the prompt's K/V (tests/_toy_model.py) in a KVCache and saves them to
the Redis server at URL through a StoreWriter. writer-prefix: computes them in a KVPool
whose prefix cache has the store and a StoreWriter attached (the chunks are saved as
advance completes them). reader / reader-pool: loads the longest stored prefix into a
KVCache / a new KVPool sequence, computes the rest of the prompt, decodes NEW's tokens,
saves every attention output to OUT_NPY and prints the positions it loaded.
reader-prefix: the same through match_prefix of a KVPool with the store attached to its
prefix cache, then matches the prompt again (from memory now) and prints JSON: both
matches' positions and the pool's stats.
"""
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kvcore  # noqa: E402
from kvcore.store import KVStore, RedisBackend, StoreWriter  # noqa: E402
from _toy_model import decode, prefill  # noqa: E402

CHUNK, PAGE = 16, 8


def main(role, url, spec_json, prompt_npy, new_npy, out_npy=None):
    spec = kvcore.KVSpec(**json.loads(spec_json))
    prompt, new = np.load(prompt_npy), np.load(new_npy)
    store = KVStore(RedisBackend(url), model="toy@1", spec=spec, chunk_tokens=CHUNK,
                    page_size=PAGE)
    if role == "writer-prefix":
        with StoreWriter(store) as writer:
            pool = kvcore.KVPool(spec, num_pages=64, page_size=PAGE, prefix_cache=True,
                                 store=store, store_writer=writer)
            seq, n = pool.match_prefix(prompt)
            assert n == 0, n
            prefill(pool, prompt, seq)
        assert writer.stats.chunks_written == len(prompt) // CHUNK, writer.stats
        return
    if role == "reader-prefix":
        pool = kvcore.KVPool(spec, num_pages=64, page_size=PAGE, prefix_cache=True, store=store)
        seq, n = pool.match_prefix(prompt)
        prefill(pool, prompt[n:], seq)
        np.save(out_npy, decode(pool, new, seq))
        pool.free(seq)
        again = pool.match_prefix(prompt)[1]
        st = pool.stats
        print(json.dumps(dict(positions=n, again=again, hits=st.hits, misses=st.misses,
                              store_hits=st.store_hits, store_faults=st.store_faults)))
        return
    if role == "writer":
        cache = kvcore.KVCache(spec)
        prefill(cache, prompt)
        with StoreWriter(store) as writer:
            writer.submit(cache.snapshot(), prompt)
        assert writer.stats.chunks_written > 0, writer.stats
        return
    if role == "reader":
        target, seq = kvcore.KVCache(spec), None
        result = store.load_into(target, prompt)
        held = target.length
    else:
        target = kvcore.KVPool(spec, num_pages=64, page_size=PAGE)
        result = store.load_into(target, prompt)
        seq = result.seq if result.seq is not None else target.new_sequence()
        held = target.length(seq)
    prefill(target, prompt[held:], seq)
    np.save(out_npy, decode(target, new, seq))
    print(result.positions)


if __name__ == "__main__":
    main(*sys.argv[1:])
