"""codi-trace: CODI latent reasoning over CWM-style Python execution traces.

Run a stage: `python -m codi <stage>` (see `python -m codi --help`).
"""

__version__ = "0.1.0"
