"""The demo: disaggregated prefill/decode of a small numpy transformer over llmdd_async."""
