"""A real vLLM engine loses a prompt's tail first under cache pressure, and both prefix
indexes (the daemon's and the gateway's) predict what it keeps: the premise of their
eviction order and of the daemon's bisection match (issue 21).

One engine with a 48-block KV cache (32 tokens per block): A (20 blocks) runs, then B1
and B2 (20 blocks each) push 12 of A's blocks out. The engine frees a request's blocks
last block first, so A's head still hits; an index that evicted heads first would
predict no hit at all."""

from __future__ import annotations

import json
import urllib.request

from fulcrum.core.prefill.affinity import PrefixIndex
from fulcrum.gateway.prefix_index import PrefixIndex as GatewayIndex
from tests.engines.vllm_fleet import BLOCK_SIZE, MODEL_NAME, metric_sum

PROMPT_BLOCKS = 20


def _complete(port: int, ids: list[int]) -> None:
    body = json.dumps({"model": MODEL_NAME, "prompt": ids, "max_tokens": 1,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200


def _hit_blocks(port: int, ids: list[int]) -> int:
    before = metric_sum(port, "vllm:prefix_cache_hits_total")
    _complete(port, ids)
    return int(metric_sum(port, "vllm:prefix_cache_hits_total") - before) // BLOCK_SIZE


def test_the_engine_keeps_a_prompts_head_and_the_indexes_predict_it(
    small_cache_engine: tuple[int, int],
) -> None:
    port, cache_blocks = small_cache_engine
    n = PROMPT_BLOCKS * BLOCK_SIZE
    prompts = {name: [base + i % 300 for i in range(n)]
               for name, base in (("A", 100), ("B1", 700), ("B2", 1100))}
    _complete(port, prompts["A"])
    assert _hit_blocks(port, prompts["A"]) == PROMPT_BLOCKS - 1  # the last block is computed
    _complete(port, prompts["B1"])
    _complete(port, prompts["B2"])
    engine_kept = _hit_blocks(port, prompts["A"])

    # The same requests through both indexes, one block hash per block of each prompt.
    blocks = {name: [hash((name, b)) for b in range(PROMPT_BLOCKS)] for name in prompts}
    core, gateway = PrefixIndex(BLOCK_SIZE), GatewayIndex()
    core.add_engine("e", cache_blocks)
    slot = gateway.add(cache_blocks)
    for name in ("A", "B1", "B2"):
        core.record("e", blocks[name])
        gateway.record(slot, blocks[name])
    predicted = core.match("e", blocks["A"])
    assert predicted == int(gateway.match(blocks["A"])[slot]) == cache_blocks - 2 * PROMPT_BLOCKS
    # The engine kept A's head (a head-first index predicts 0); it counts one block fewer
    # (the block its first run's output token took).
    assert engine_kept > 0 and abs(engine_kept - predicted) <= 1
