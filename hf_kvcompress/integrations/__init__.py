"""Integrations with serving stacks: `kv_chunk` codes whole KV chunks (every layer of a run of tokens) and
`lmcache` registers that coder as an LMCache serde (optional extra ``lmcache``)."""
