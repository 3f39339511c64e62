//! A small, allocation-free msgpack reader and a writer, enough for vLLM's KV events.
