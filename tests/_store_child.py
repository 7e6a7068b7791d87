"""One process of the store's cross-process test (tests/test_store*.py run it):

    python tests/_store_child.py ROLE URL SPEC_JSON PROMPT_NPY NEW_NPY [OUT_NPY]

writer: computes the prompt's K/V (tests/_toy_model.py) in a KVCache and saves them to
the Redis server at URL through a StoreWriter. reader / reader-pool: loads the longest
stored prefix into a KVCache / a new KVPool sequence, computes the rest of the prompt,
decodes NEW's tokens, saves every attention output to OUT_NPY and prints the positions
it loaded.
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
    store = KVStore(RedisBackend(url), model="toy@1", spec=spec, chunk_tokens=CHUNK)
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
