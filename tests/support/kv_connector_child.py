"""One worker process of the KV connector's restart test: ``python -m
tests.support.kv_connector_child MODEL_DIR DISK_DIR PROMPT_JSON`` builds an engine (tiny
model, eager, tokens_per_block 4) with the disk tier in ``DISK_DIR``, runs the prompt greedily,
shuts the engine down (which writes the queued blocks) and prints one JSON line: the output
tokens and the connector's counters."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pdserve.protocol import SamplingParams
from tests.support.engine import complete, make_engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def main(argv: list[str]) -> int:
    model_dir, disk_dir, prompt = Path(argv[0]), Path(argv[1]), json.loads(argv[2])
    engine = make_engine(model_dir, compile=False, disk_cache_dir=disk_dir)
    try:
        got = complete(engine, "restart", prompt, GREEDY)
    finally:
        engine.shutdown()
    stats = engine.kv_connector_stats()
    assert stats is not None and stats.disk is not None
    report = {
        "tokens": got.token_ids,
        "disk_hit_tokens": stats.hit_tokens("disk"),
        "saved_blocks": stats.saved_blocks,
        "corrupt": stats.disk.corrupt,
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
