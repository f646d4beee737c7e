"""An OpenAI-compatible HTTP server over an `Engine` (FastAPI app; `graphexec-serve` runs it)."""
