"""Lightning Fabric strategies built on fulmen (ThunderDDPStrategy, ThunderFSDPStrategy): see the strategies issue."""
