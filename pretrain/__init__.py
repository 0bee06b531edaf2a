"""LitGPT pretraining with fulmen (`python -m fulmen.pretrain`)."""
