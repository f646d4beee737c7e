"""Text in and out: tokenizers (`tokenizer.py`), prompts and chat templates to token ids
(`prompt_encoder.py`), incremental detokenization (`detokenizer.py`) and stop strings
(`stop_strings.py`).  No torch, no engine state: safe on any thread.
"""
