"""Metrics: one logger protocol (JSONL always, W&B on the logging rank), throughput, memory."""
