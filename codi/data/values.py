"""The value each LINE frame's locals carry from the line before it: where it sits in the tokens, and its kind.

    slots = assigned_values(trace_text, trace_ids, spans, tokenizer)   # one AssignedValue | None per LINE span
    slots[k].pos       # index into trace_ids of the value's first token (inside span k's locals)
    slots[k].kind      # "copy" (equals an operand of the line: `b = a`, `b = max(b, 6)`) | "computed" (`b = b + 2`)
    value_positions(slots)   # [pos or -1]: what the codi stage adds to each example as `value_pos`

LINE frame k shows the locals before its own line runs, so the value that the previous line assigned is the
one thing in it that the latent block standing for it must compute. Research IV's levers supervise it (a value CE
through the tied head, KD at the teacher's token before it: codi.modeling) and the evaluate stage's probe asks
whether a latent block holds it (codi.evaluation.probe). A span gets None where the previous line assigns no single name
(`def`, `if`, `return`, a tuple target), where the previous frame is another scope's, where the value is written
".." (diff encoding), or where the tokens do not spell the trace text (then every span of the example is None).
"""

from __future__ import annotations

import ast
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from codi.tracing.format import UNCHANGED, Frame, parse_trace, render_frame

ValueKind = Literal["copy", "computed"]
VALUE_KINDS: tuple[str, ...] = ("copy", "computed")


@dataclass(frozen=True)
class AssignedValue:
    """The value a LINE frame's locals hold for the name the previous line assigned."""

    name: str
    repr: str
    pos: int          # trace_ids index of the token holding the value's first character
    kind: ValueKind   # copy: equal to an operand of the assigning line (a name it reads or a constant)


def assigned_name(line: str) -> tuple[str, ast.expr | None] | None:
    """(name, right-hand side) of a line that binds exactly one plain name (`b = ...`, `b += ...`, `b: int = ...`,
    `for b in ...:`); None otherwise. The right-hand side is None for a for loop (its value comes from iteration)."""
    text = line.strip()
    if not text:
        return None
    try:
        tree = ast.parse(text + (" pass" if text.endswith(":") else ""))
    except SyntaxError:
        return None
    if len(tree.body) != 1:
        return None
    node = tree.body[0]
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
        return node.targets[0].id, node.value
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)) and isinstance(node.target, ast.Name) and node.value is not None:
        return node.target.id, node.value
    if isinstance(node, ast.For) and isinstance(node.target, ast.Name):
        return node.target.id, None
    return None


def operand_reprs(expr: ast.expr | None, before: dict[str, str]) -> set[str]:
    """The reprs a right-hand side reads: each name's value before the line (from `before`) and each constant."""
    if expr is None:
        return set()
    out: set[str] = set()
    for node in ast.walk(expr):
        if isinstance(node, ast.Name) and node.id in before and before[node.id] != UNCHANGED:
            out.add(before[node.id])
        elif isinstance(node, ast.Constant):
            out.add(repr(node.value))
    return out


def value_offset(locals_text: str, name: str) -> int | None:
    """Character offset, inside a LOCALS JSON object written by encode_locals, of the first character of
    `name`'s repr (after its opening quote); None when the text is not in that form or lacks the name."""
    try:
        d = json.loads(locals_text)
    except ValueError:
        return None
    if not isinstance(d, dict) or name not in d or json.dumps(d, ensure_ascii=False) != locals_text:
        return None
    head = "{"
    for k, v in d.items():
        if k == name:
            return len(head) + len(json.dumps(k, ensure_ascii=False)) + len(": \"")
        head += f"{json.dumps(k, ensure_ascii=False)}: {json.dumps(v, ensure_ascii=False)}, "
    return None


class TokenPieces:
    """Each token id's text, decoded once (a vocabulary of a few hundred to 150k ids, read many times)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._pieces: dict[int, str] = {}

    def __call__(self, tid: int) -> str:
        piece = self._pieces.get(tid)
        if piece is None:
            piece = self._pieces[tid] = self.tokenizer.decode([tid])
        return piece


def token_starts(trace_ids: Sequence[int], tokenizer, text: str) -> list[int] | None:
    """Character offset of each token of `trace_ids` in `text` (their decoded concatenation, with a trailing EOS
    allowed); None when the tokens decoded one by one do not spell `text` (a multi-byte character split over tokens).
    `tokenizer`: a tokenizer or its TokenPieces."""
    pieces = tokenizer if isinstance(tokenizer, TokenPieces) else TokenPieces(tokenizer)
    starts, pos = [], 0
    for tid in trace_ids:
        if pos >= len(text):
            break
        piece = pieces(int(tid))
        if not text.startswith(piece, pos) or not piece:
            return None
        starts.append(pos)
        pos += len(piece)
    return starts if pos == len(text) else None


def assigned_values(trace_text: str, trace_ids: Sequence[int], spans: Sequence[tuple[int, int]], tokenizer,
                    frames: list[Frame] | None = None) -> list[AssignedValue | None]:
    """One entry per LINE span (see the module docstring). ValueError when the spans and the trace's LINE frames
    do not correspond one to one (a cache that breaks the span contract)."""
    frames = parse_trace(trace_text) if frames is None else frames
    line_idx = [f for f, fr in enumerate(frames) if fr.kind == "line"]
    if len(line_idx) != len(spans):
        raise ValueError(f"{len(spans)} spans for {len(line_idx)} LINE frames in the trace text")
    starts = token_starts(trace_ids, tokenizer, trace_text)
    if starts is None:
        return [None] * len(spans)
    # Character offset where each frame's LOCALS begin (after its marker token's text).
    offsets, pos = [], 0
    for fr in frames:
        offsets.append(pos)
        pos += len(render_frame(fr))
    out: list[AssignedValue | None] = []
    for (i, j), f in zip(spans, line_idx):
        if starts[i] != offsets[f]:
            raise ValueError(f"span ({i}, {j}): its <|line_sep|> token is not where LINE frame {f} starts in the text")
        out.append(_one(frames, f, starts, i, j))
    return out


def _one(frames: list[Frame], f: int, starts: list[int], i: int, j: int) -> AssignedValue | None:
    prev = frames[f - 1] if f > 0 else None
    if prev is None or prev.kind not in ("call", "line"):
        return None  # after a return or an exception: the locals continue another frame's story
    bound = assigned_name(prev.source_line)
    if bound is None:
        return None
    name, rhs = bound
    now, before = frames[f].locals_dict(), prev.locals_dict()
    if name not in now or now[name] == UNCHANGED:
        return None
    off = value_offset(frames[f].locals or "", name)
    if off is None:
        return None
    # The frame's text starts with its marker (<|line_sep|>, token i); its locals follow at token i + 1.
    char = starts[i + 1] + off
    pos = max(t for t in range(i + 1, j) if starts[t] <= char)
    kind: ValueKind = "copy" if now[name] in operand_reprs(rhs, before) else "computed"
    return AssignedValue(name=name, repr=now[name], pos=pos, kind=kind)


def value_positions(slots: Sequence[AssignedValue | None]) -> list[int]:
    """Each span's value token index into trace_ids, -1 where it has none (the codi contract's `value_pos`)."""
    return [-1 if s is None else s.pos for s in slots]


class WithValues:
    """A cache split (codi.data.cache.CacheDataset) whose examples also carry `value_pos`, computed once for the split:
    what the codi stage trains on when a value option is on. Keeps `lengths` and `column` for the trainer."""

    def __init__(self, ds, tokenizer):
        pieces = TokenPieces(tokenizer)
        self.ds = ds
        texts = ds.column("trace_text")
        self.slots: list[list[AssignedValue | None]] = []
        for k in range(len(ds)):
            ex = ds[k]
            try:
                self.slots.append(assigned_values(texts[k], ex["trace_ids"], ex["spans"], pieces))
            except ValueError as e:
                raise ValueError(f"{getattr(ds, 'path', 'dataset')}: example {k} ({ex.get('sample_id')}): {e}") from None

    def __len__(self) -> int:
        return len(self.ds)

    @property
    def lengths(self) -> list[int]:
        return self.ds.lengths

    def column(self, name: str) -> list:
        return self.ds.column(name)

    def __getitem__(self, k: int) -> dict:
        return self.ds[k] | {"value_pos": value_positions(self.slots[k])}

    def coverage(self) -> dict[str, int]:
        """How many LINE spans carry a value, by kind, and how many carry none."""
        kinds = [s.kind if s is not None else "none" for ex in self.slots for s in ex]
        return {kind: kinds.count(kind) for kind in (*VALUE_KINDS, "none")}
