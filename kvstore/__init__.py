"""Everything KV: `accounting` (logical block ids, pure Python, used by the scheduler) and
`paged` (the physical paged cache with swap and int8, torch, used by workers)."""
