"""LitGPT pretraining with fulmen: `python -m fulmen.pretrain [--config configs/<name>.yaml]` (see cli.py)."""

from fulmen.pretrain.cli import FSDPArgs, setup
from fulmen.pretrain.corpus import ShippedCorpus

__all__ = ["FSDPArgs", "ShippedCorpus", "setup"]
