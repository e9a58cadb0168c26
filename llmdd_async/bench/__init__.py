"""``llmdd-async bench``: asyncio benchmarks of a real peer, with the machine's limits."""
