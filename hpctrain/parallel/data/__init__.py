"""Data parallelism: one flat shard layout for bucketed DDP and ZeRO stages 1-3."""
