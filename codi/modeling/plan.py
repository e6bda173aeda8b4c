"""Pure-Python planning of one codi example: validation, the student's rounds, the scheduled-sampling ramp.

    plan = plan_example(example, index, token_ids, latent_share=1.0, kd_positions="action_sep")
    plan.rounds[k].tokens, .targets, .anchors, .ss_slots
    p = ss_ramp(step, max_steps, ss_prob, ss_ramp_frac); u = draw_uniform(rng)  # random.Random | Generator
    share = latent_share(step, max_steps, curriculum_frac, mix_explicit_prob)  # the latent curriculum
    scale = value_ramp(step, max_steps, value_ramp_frac)  # the value terms' ramp (CodiModel.forward's value_scale)

The first n = latent_frames(len(spans), share) spans (i_1, j_1)..(i_n, j_n) are latent; later LINE frames
stay text. A latent span stands for T[i+1:r]: its locals (codi.latent_unit locals, r = j, the text resumes at
`<|action_sep|>`) or its locals and executed line (unit frame, r = the frame's `<|frame_sep|>`). Over prompt P
and trace T they give n + 1 rounds (LS/LE = latent_start/end), with latents after each LS:
round 0 = P + T[:i_1+1] + [LS]; round k = [LE] + T[r_k:i_{k+1}+1] + [LS]; round n = [LE] + T[r_n:]
(n = 0: one round, P + T). Targets, anchors: docs/design/codi-model.md, "CodiModel" (student rounds).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Mapping

import torch

from codi.tracing.tokens import TraceTokenIds


@dataclass(frozen=True)
class Round:
    """One student round of one example (slots index `tokens`)."""

    tokens: tuple[int, ...]
    targets: tuple[tuple[int, int], ...]  # (slot, target id): the slot's logit is trained on the id
    anchors: tuple[int, ...]              # KD slots: the `<|action_sep|>` (and its line); () in round 0
    ends_in_latent: bool                  # last slot is latent_start: latents follow
    ss_slots: tuple[int, int] = (0, 0)    # scheduled sampling replaces slots [a, b) by argmax at slot - 1


@dataclass(frozen=True)
class ExamplePlan:
    prompt: tuple[int, ...]
    trace: tuple[int, ...]
    spans: tuple[tuple[int, int], ...]    # the latent spans (the first n of the example's LINE frames)
    rounds: tuple[Round, ...]
    value_pos: tuple[int, ...] = ()       # per latent span: trace index of its assigned value's token, -1 none
    resume: tuple[int, ...] = ()          # per latent span: trace index where the text resumes (module docstring)
    block_frames: tuple[int, ...] = ()    # per latent span: the LINE frames it stands for (codi.frames_per_block)
    call_frames: int = 0                  # 1: the entry call's frame is latent frame 0 (codi.latent_call): `value_pos`
                                          # and `block_frames` count it first, with no value (-1)

    def value_index(self, span: int, frame: int) -> int | None:
        """Index into `value_pos` of frame `frame` of latent span `span` (its LINE frames in order), None past them."""
        if not self.block_frames:
            return span if frame == 0 else None
        if frame >= self.block_frames[span]:
            return None
        return sum(self.block_frames[:span]) + frame

    @property
    def n_spans(self) -> int:
        return len(self.spans)

    @property
    def teacher_anchors(self) -> tuple[int, ...]:
        """Positions in prompt+trace of the KD anchors, span by span: the token where each latent frame's text
        resumes (`<|action_sep|>`, or `<|frame_sep|>` in the frame unit; with kd_positions action_line, also the
        tokens of its line that follow)."""
        return tuple(len(self.prompt) + r0 - 1 + a for r0, r in zip(self.resume, self.rounds[1:]) for a in r.anchors)

    @property
    def anchor_counts(self) -> tuple[int, ...]:
        """KD anchors of each latent span."""
        return tuple(len(r.anchors) for r in self.rounds[1:])

    @property
    def n_anchors(self) -> int:
        return sum(self.anchor_counts)


def _int_list(ex: Mapping[str, Any], key: str, where: str) -> tuple[int, ...]:
    if key not in ex:
        raise ValueError(f"{where}: missing key {key!r}")
    v = ex[key]
    if isinstance(v, torch.Tensor):
        v = v.tolist()
    try:
        out = tuple(int(x) for x in v)
    except (TypeError, ValueError):
        raise ValueError(f"{where}.{key}: expected a list of token ids") from None
    if not out:
        raise ValueError(f"{where}.{key}: expected a non-empty list of token ids")
    return out


def check_example(ex: Mapping[str, Any], index: int, ids: TraceTokenIds) -> tuple[tuple[int, ...], tuple[int, ...], tuple[tuple[int, int], ...]]:
    """Validate the codi contract (docs/design/trace-format.md, "Spans"); returns (prompt, trace, spans)."""
    where = f"examples[{index}]"
    if not isinstance(ex, Mapping):
        raise ValueError(f"{where}: expected a dict with prompt_ids, trace_ids, spans; got {type(ex).__name__}")
    prompt, trace = _int_list(ex, "prompt_ids", where), _int_list(ex, "trace_ids", where)
    raw = ex.get("spans")
    if raw is None or len(raw) == 0:
        raise ValueError(f"{where}.spans: expected at least one (i, j) LINE span")
    spans: list[tuple[int, int]] = []
    prev_j = -1
    for s, span in enumerate(raw):
        w = f"{where}.spans[{s}]"
        try:
            i, j = (int(x) for x in span)
        except (TypeError, ValueError):
            raise ValueError(f"{w} = {span!r}: expected a pair (i, j)") from None
        if not 0 <= i < j < len(trace):
            raise ValueError(f"{w} = ({i}, {j}): expected 0 <= i < j < len(trace_ids) = {len(trace)}")
        if i <= prev_j:
            raise ValueError(f"{w} = ({i}, {j}): spans must be sorted and non-overlapping (previous j = {prev_j})")
        if trace[i] != ids.line_sep:
            raise ValueError(f"{w} = ({i}, {j}): trace_ids[{i}] = {trace[i]}, expected <|line_sep|> ({ids.line_sep})")
        if trace[j] != ids.action_sep:
            raise ValueError(f"{w} = ({i}, {j}): trace_ids[{j}] = {trace[j]}, expected <|action_sep|> ({ids.action_sep})")
        spans.append((i, j))
        prev_j = j
    return prompt, trace, tuple(spans)


def line_length(trace: Sequence[int], j: int, ids: TraceTokenIds) -> int:
    """Tokens from a LINE frame's `<|action_sep|>` at j up to (not including) its `<|frame_sep|>`: the
    separator and its source line (to the trace's end if no `<|frame_sep|>` follows)."""
    for q in range(j + 1, len(trace)):
        if trace[q] == ids.frame_sep:
            return q - j
    return len(trace) - j


def check_value_pos(ex: Mapping[str, Any], index: int, spans: tuple[tuple[int, int], ...]) -> tuple[int, ...]:
    """The example's `value_pos` (codi.data.values.value_positions): one int per LINE span, -1 or inside the span's
    locals (i < pos < j). ValueError naming the key."""
    where = f"examples[{index}].value_pos"
    raw = ex.get("value_pos")
    if raw is None:
        raise ValueError(f"{where}: missing (the value options need each span's value token: codi.data.values)")
    if isinstance(raw, torch.Tensor):
        raw = raw.tolist()
    try:
        pos = tuple(int(x) for x in raw)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: expected a list of ints") from None
    if len(pos) != len(spans):
        raise ValueError(f"{where}: {len(pos)} entries for {len(spans)} spans")
    for s, (p, (i, j)) in enumerate(zip(pos, spans)):
        if p != -1 and not i < p < j:
            raise ValueError(f"{where}[{s}] = {p}: expected -1 or inside span ({i}, {j})")
    return pos


def plan_example(ex: Mapping[str, Any], index: int, ids: TraceTokenIds, latent_share: float = 1.0,
                 kd_positions: Literal["action_sep", "action_line", "answer"] = "action_sep",
                 values: bool = False, latent_count: int | None = None,
                 unit: Literal["locals", "frame"] = "locals", frames_per_block: int = 1,
                 latent_call: bool = False) -> ExamplePlan:
    """Check an example and lay out its student rounds (see the module docstring): the first
    latent_frames(len(spans), latent_share) LINE frames are latent, or the first `latent_count` when given (the
    stage curriculum); KD anchors at kd_positions (CodiOptions); `values`: read and check the example's `value_pos`;
    `unit` (codi.latent_unit): what a latent block stands for. In the frame unit, a LINE frame whose
    `<|frame_sep|>` was cut off (a truncated trace) stays text, and so does every frame after it.
    `frames_per_block` (codi.frames_per_block, frame unit only): a latent span stands for up to this many consecutive
    LINE frames with nothing between them (a call or return frame ends a block); latent_share and latent_count then
    count blocks, and `value_pos` holds one entry per LINE frame of the latent blocks, in order.
    `latent_call` (codi.latent_call, frame unit only): the entry call's frame (the trace's first, `<|call_sep|>` up to
    its `<|frame_sep|>`) is a latent frame too, the first one, grouped with the LINE frames right after it like any
    other; it assigns no value (`value_pos` -1) and `call_frames` is 1. Its arguments are the prompt's call, so the
    block has nothing to compute, only positions to save."""
    if frames_per_block < 1 or (frames_per_block > 1 and unit != "frame"):
        raise ValueError(f"frames_per_block = {frames_per_block}: expected 1, or more in the frame unit")
    if unit not in ("locals", "frame"):
        raise ValueError(f"unit = {unit!r}: expected 'locals' or 'frame'")
    if latent_call and unit != "frame":
        raise ValueError(f"latent_call needs the frame unit (unit = {unit!r}): the call frame's line would be text")
    if unit == "frame" and kd_positions == "action_line":
        raise ValueError("kd_positions 'action_line' anchors KD on a frame's line, which the frame unit makes latent")
    prompt, trace, all_spans = check_example(ex, index, ids)
    value_pos = check_value_pos(ex, index, all_spans) if values else ()
    call_frames = 0
    if unit == "locals":
        all_resume = tuple(j for _, j in all_spans)
    else:
        ends = [j + line_length(trace, j, ids) for _, j in all_spans]
        whole = next((s for s, f in enumerate(ends) if f >= len(trace)), len(ends))  # frames with a <|frame_sep|>
        all_spans, all_resume, value_pos = all_spans[:whole], tuple(ends[:whole]), value_pos[:whole]
        if latent_call and trace[0] == ids.call_sep:
            j0 = next((q for q in range(1, len(trace)) if trace[q] == ids.action_sep), len(trace))
            end0 = j0 + line_length(trace, j0, ids) if j0 < len(trace) else len(trace)
            if end0 < len(trace):
                call_frames = 1
                all_spans, all_resume = ((0, j0),) + all_spans, (end0,) + all_resume
                value_pos = (-1,) + value_pos if values else value_pos
            else:  # the call frame was cut off before its <|frame_sep|> (a truncated trace): all of it stays text
                all_spans, all_resume, value_pos = (), (), ()
    all_frames: tuple[int, ...] = ()
    if frames_per_block > 1:  # group consecutive LINE frames: the next one starts right after this one's <|frame_sep|>
        blocks, s = [], 0
        while s < len(all_spans):
            e = s
            while e + 1 < len(all_spans) and e - s + 1 < frames_per_block and all_spans[e + 1][0] == all_resume[e] + 1:
                e += 1
            blocks.append((s, e))
            s = e + 1
        all_spans = tuple(all_spans[a] for a, _ in blocks)
        all_resume = tuple(all_resume[b] for _, b in blocks)
        all_frames = tuple(b - a + 1 for a, b in blocks)
    n_latent = latent_frames(len(all_spans), latent_share) if latent_count is None else min(latent_count, len(all_spans))
    spans = all_spans[:n_latent]
    block_frames = all_frames[:n_latent]
    value_pos = value_pos[:sum(block_frames) if block_frames else len(spans)]
    resume = all_resume[:n_latent]
    ls, le = ids.latent_start, ids.latent_end
    n = len(spans)
    rounds = []
    p = len(prompt)
    if n == 0:  # every frame explicit: the student reads the whole trace, CE on every trace token
        rounds.append(Round(tokens=prompt + trace, targets=tuple((p - 1 + t, trace[t]) for t in range(len(trace))),
                            anchors=(), ends_in_latent=False))
        return ExamplePlan(prompt=prompt, trace=trace, spans=(), rounds=tuple(rounds), value_pos=())
    # Round 0: the prompt's last logit predicts trace[0]; trace[t] predicts trace[t+1] up to i_1 - 1.
    i1 = spans[0][0]
    toks = prompt + trace[:i1 + 1] + (ls,)
    rounds.append(Round(tokens=toks, targets=tuple((p - 1 + t, trace[t]) for t in range(i1 + 1)),
                        anchors=(), ends_in_latent=True))
    for k in range(1, n + 1):
        j = resume[k - 1]
        last = k == n
        seg = trace[j:] if last else trace[j:spans[k][0] + 1]
        toks = (le,) + seg + (() if last else (ls,))
        # Slot q predicts seg[q] (slot 0 = LE); the seg's last token predicts nothing trained.
        targets = tuple((q, seg[q]) for q in range(len(seg)))
        # Scheduled sampling keeps seg[0] (action_sep) and, unless last, seg[-1] (next line_sep):
        # seg[q] for q in [1, end) <- argmax at seg position q-1, i.e. slot q+1 <- slot q.
        end = len(seg) if last else len(seg) - 1
        # KD anchors: slot 1 is where the text resumes (`<|action_sep|>`; `<|frame_sep|>` in the frame unit);
        # action_line adds the slots of its line's tokens; answer
        # keeps only the last round's last <|arg_sep|> (the entry exit's, whose next token is the answer).
        if kd_positions == "answer":
            args = [q for q in range(len(seg)) if seg[q] == ids.arg_sep] if last else []
            anchors = (1 + args[-1],) if args else ()
        else:
            m = 1 if kd_positions == "action_sep" else min(line_length(trace, j, ids), len(seg))
            anchors = tuple(range(1, 1 + m))
        rounds.append(Round(tokens=toks, targets=targets, anchors=anchors, ends_in_latent=not last,
                            ss_slots=(2, 1 + end) if end > 1 else (0, 0)))
    return ExamplePlan(prompt=prompt, trace=trace, spans=spans, rounds=tuple(rounds), value_pos=value_pos,
                       resume=resume, block_frames=block_frames, call_frames=call_frames if spans else 0)


def latent_frames(n_line_frames: int, share: float) -> int:
    """How many of an example's LINE frames are latent at a latent share in [0, 1]: the first
    round(share * n), halves rounded up (share 1: all of them; share 0: none)."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"latent_share = {share!r}: expected a share in [0, 1]")
    return min(n_line_frames, math.floor(share * n_line_frames + 0.5))


def latent_share(step: int, max_steps: int, curriculum_frac: float, mix_explicit_prob: float) -> float:
    """Share of LINE frames that are latent at optimizer step `step` (codi.latent_curriculum_frac,
    codi.mix_explicit_prob): a linear ramp from 0 to 1 over the first `curriculum_frac` of `max_steps`
    (0 = all latent from step 0), times 1 - mix_explicit_prob (the last frames that stay explicit). Pure:
    the model keeps no schedule state, so a resumed run gets the share an uninterrupted one would."""
    ramp = 1.0 if curriculum_frac <= 0 else min(1.0, step / max(1.0, curriculum_frac * max_steps))
    return ramp * (1.0 - mix_explicit_prob)


def ss_ramp(step: int, max_steps: int, ss_prob: float, ss_ramp_frac: float) -> float:
    """Scheduled-sampling probability at optimizer step `step`: a linear ramp from 0 to `ss_prob` over
    the first `ss_ramp_frac` of `max_steps`, then flat. Pure: the model keeps no schedule state."""
    return ss_prob * min(1.0, step / max(1.0, ss_ramp_frac * max_steps))


def value_ramp(step: int, max_steps: int, ramp_frac: float) -> float:
    """The value terms' weight factor at optimizer step `step`: a linear ramp from 0 to 1 over the first `ramp_frac`
    of `max_steps`, then 1; exactly 1 when `ramp_frac` is 0 (off), so the loss is bit for bit as without a ramp."""
    if ramp_frac <= 0:
        return 1.0
    return min(1.0, step / max(1.0, ramp_frac * max_steps))


def draw_uniform(rng: random.Random | torch.Generator) -> float:
    """One uniform draw in [0, 1) from an explicit generator (random.Random or torch.Generator)."""
    if isinstance(rng, random.Random):
        return rng.random()
    if isinstance(rng, torch.Generator):
        return float(torch.rand((), generator=rng, device=rng.device))
    raise ValueError(f"ss_rng: expected a random.Random or torch.Generator, got {type(rng).__name__}")


Unit = tuple[str, int, bool]  # (latent_unit, frames_per_block, latent_call): what a block stands for


def unit_ladder(unit: str, frames_per_block: int, latent_call: bool) -> tuple[Unit, ...]:
    """The unit curriculum's stages (codi.unit_stage_steps) up to the configured unit: the locals unit, whole frames
    one a block, then the configured unit (more frames a block, the latent call frame), each once."""
    ladder: list[Unit] = [("locals", 1, False)]
    for rung in (("frame", 1, False), (unit, frames_per_block, latent_call)):
        if rung not in ladder:
            ladder.append(rung)
    return tuple(ladder)


def unit_at(step: int, unit_stage_steps: int, ladder: Sequence[Unit]) -> tuple[int, Unit]:
    """(stage index, unit) of the unit curriculum at optimizer step `step`: stage k covers steps
    [k * unit_stage_steps, (k + 1) * unit_stage_steps), the last stage every step after. Pure: a resumed run gets the
    unit an uninterrupted one would."""
    if unit_stage_steps < 1 or not ladder:
        raise ValueError(f"unit_at: unit_stage_steps = {unit_stage_steps} and {len(ladder)} stages: expected >= 1 each")
    k = min(step // unit_stage_steps, len(ladder) - 1)
    return k, ladder[k]


def stage_of(step: int, stage_steps: int) -> int:
    """The stage curriculum's stage (1, 2, ...) at optimizer step `step` (codi.stage_steps > 0)."""
    return step // stage_steps + 1


def stage_latent_count(step: int, stage_steps: int, smoothing: float, mix_prob: float, rng: random.Random) -> int:
    """LINE frames made latent in one batch at optimizer step `step`: its stage, an earlier stage drawn uniformly
    with probability `mix_prob` (Coconut's stage mixing), plus one with probability `smoothing` (iCoT-SI's removal
    smoothing). Two draws from `rng`, always both (a pure function of the generator's state)."""
    stage = stage_of(step, stage_steps)
    mix, smooth = rng.random(), rng.random()
    if stage > 1 and mix < mix_prob:
        stage = 1 + int(mix / mix_prob * (stage - 1))  # uniform over the earlier stages 1 .. stage - 1
    return stage + (1 if smooth < smoothing else 0)
