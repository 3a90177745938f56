"""kvcached: the per-host KV-cache daemon (radix prefix index, DRAM and disk tiers)."""
