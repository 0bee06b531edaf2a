"""FSDP's BLOCK buckets with nested `nn.ModuleList`s (experts inside a block): every process, whatever its hash
seed, puts each parameter in its outermost block, so all ranks start the same collectives."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import json
from torch import nn
from fulmen.distributed.setup import _bucket_keys
from fulmen.distributed.specs import FSDPBucketingStrategy

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(4)
        self.experts = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])

model = nn.Sequential(nn.Embedding(8, 4), nn.ModuleList([Block() for _ in range(3)]), nn.Linear(4, 8))
print(json.dumps(_bucket_keys(model, FSDPBucketingStrategy.BLOCK)))
"""


def test_nested_blocks_bucket_by_the_outermost_block_under_any_hash_seed():
    results = []
    for seed in ("1", "2", "3", "4"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(ROOT)}
        done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        results.append(json.loads(done.stdout))
    assert all(result == results[0] for result in results)
    keys = results[0]
    assert keys["1.2.experts.1.weight"] == "1.2" and keys["1.0.norm.bias"] == "1.0"
    assert keys["0.weight"] == "0" and keys["2.bias"] == "2"  # outside the blocks: their own module
    assert len(set(keys.values())) == 5
