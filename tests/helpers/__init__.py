"""Importable helpers of the tests: tiny models, data sets, CLI runners, and transcriptions of
official code used as test oracles (``sit_reference.py``: SiT's transport; ``repa_reference.py``:
REPA's loss and projector; ``reference_forward.py``: DiT's forward).

A transcription keeps the official code's own signatures and defaults, one expression at a time:
it is never edited to this project's numbers, or the test that should catch a difference compares
the project with itself.
"""
