"""The decoding modes, defined once: what `evaluate.modes` accepts, what decoding runs, what reports list.

    explicit  the sft model writes the whole trace (locals and action lines) before the answer
    latent    the codi model writes each LINE frame's locals as a block of latent vectors
    direct    the sft_direct model answers with no trace
"""

from __future__ import annotations

from typing import Literal, get_args

Mode = Literal["explicit", "latent", "direct"]
MODES: tuple[str, ...] = get_args(Mode)
TRACED_MODES: tuple[str, ...] = ("explicit", "latent")  # the modes that write a trace
