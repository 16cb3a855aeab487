"""Rollout engine: prefill/decode with early exit, KV policies, recorded schedules."""

