"""Greedy decoding of traces and answers: `explicit`, `latent` (CODI) and `direct` (no trace).

    from codi.evaluation.decoding import decode, iter_decode
    results = decode("explicit", sft_model, tok, prompt_ids, max_new_tokens=1024, max_frames=256)
    results = decode("latent", codi_model.model, tok, prompt_ids, projector=codi_model.projector, latent_steps=1)
    for r in iter_decode("direct", direct_model, tok, many_prompts, batch_size=16, progress=True): r.answer

Batched, with results equal to one-at-a-time decoding; `action_lines` (program_action_lines) constrains
each action to a line of the program. Latents come from codi.modeling's `latent_input`, fed one position
at a time because rows advance independently. Design: docs/design/decoding.md, "Decoding".
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Literal

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from codi.data.answers import parse_direct
from codi.modeling.fast_decoder import LeanDecoder
from codi.modeling.latent import latent_input, value_feedback
from codi.modeling.model import split_causal_lm
from codi.schemas.modes import MODES
from codi.tracing.format import Frame, TraceParseError, entry_exit, exit_kind, parse_frames_prefix
from codi.tracing.tokens import ACTION_SEP, FRAME_SEP, LINE_SEP, TraceTokenIds, token_ids

StopReason = Literal["entry_exit", "eos", "max_frames", "max_new_tokens"]
LATENT = -1  # stands for one latent position in DecodeResult.ids (never a token id)
LATENT_TEXT = "<|latent|>"  # how a latent shows in DecodeResult.text (display only, not a token)


@dataclass
class DecodeResult:
    """One decoded example. `frames` are the complete frames parsed before any error (latent LINE
    frames have `locals=None`, and in the frame unit also `source_line=None`); `answer` is the entry exit's repr,
    None when malformed."""

    mode: str
    ids: list[int]            # generated ids, LATENT for a latent position
    text: str                 # decoded ids, LATENT_TEXT for a latent
    frames: list[Frame]
    answer: str | None
    positions: int            # generated positions = len(ids): tokens + latents
    latent_blocks: int
    stop: str                 # StopReason
    error: str                # "" when well-formed
    time_s: float
    answer_kind: str | None = None  # "return" / "exception" (explicit, latent); None otherwise
    latent_norm: float | None = None    # latent: mean L2 norm of the latent input vectors
    latent_cosine: float | None = None  # latent: mean cosine similarity between its latent blocks (>= 2 blocks)
    latent_sum: torch.Tensor | None = field(default=None, repr=False)  # latent: sum of its latent inputs [H]
    latent_count: int = 0                                               # latent: how many latent inputs it fed
    latent_lines: bool = False  # latent, codi.latent_unit frame: its latent LINE frames' lines are latent too
    frames_per_block: int = 1   # latent: LINE frames a block stands for (codi.frames_per_block): one parsed frame each

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("latent_sum")
        d["frames"] = [asdict(f) for f in self.frames]
        return d


def mean_latent(results: Sequence[DecodeResult]) -> torch.Tensor:
    """The mean latent input over every latent that `results` fed: the constant of the constant-latent ablation."""
    sums = [r.latent_sum for r in results if r.latent_sum is not None]
    count = sum(r.latent_count for r in results)
    if not sums or not count:
        raise ValueError("mean_latent: the results fed no latent")
    return torch.stack(sums).sum(0) / count


@dataclass
class _Row:
    """Decoding state of one example."""

    ids: list[int] = field(default_factory=list)
    queue: list[int] = field(default_factory=list)  # forced inputs still to come: the rest of a latent block
    marker: int | None = None  # first token of the open frame
    depth: int = 0
    frames: int = 0
    latent_blocks: int = 0
    stop: str = ""
    time_s: float = 0.0
    trie: dict | None = None   # the program's lines as a token trie (constrained actions), or None
    node: dict | None = None   # inside an action: the trie node of the tokens written so far
    forced: list[dict] | None = None  # teacher-forced actions: frame k's action is the trie forced[k]
    latents: list[torch.Tensor] = field(default_factory=list)  # latent inputs fed, in order (diagnostics)


_LINE_END = -1  # trie key: a whole line ends at this node


def build_action_trie(lines: Sequence[Sequence[int]]) -> dict | None:
    """Token trie of candidate action lines ({token: child}, _LINE_END marks a complete line); None if no lines."""
    root: dict = {}
    for line in lines:
        if not line:
            continue
        node = root
        for tok in line:
            node = node.setdefault(int(tok), {})
        node[_LINE_END] = {}
    return root or None


def _action_ids(tokenizer, lines: Sequence[str]) -> list[list[int]]:
    """Each line tokenized alone, which equals its tokens in a trace: `<|action_sep|>` (a special token)
    before it starts a fresh pre-tokenization."""
    return [list(ids) for ids in tokenizer(list(lines), add_special_tokens=False)["input_ids"]] if lines else []


def program_action_lines(tokenizer, program: str) -> list[list[int]]:
    """Token ids of every line of `program` as a trace writes it after `<|action_sep|>`: the raw line
    with its "\n" (the trace format's LINE is the raw source line)."""
    return _action_ids(tokenizer, sorted({line + "\n" for line in program.splitlines() if line.strip()}))


def true_action_lines(tokenizer, frames: Sequence[Frame]) -> list[list[int]]:
    """Token ids of every frame's LINE in a true trace, in order: `forced_actions` for one prompt."""
    return _action_ids(tokenizer, [f.source_line for f in frames])


class GrowingLayer(DynamicLayer):
    """A DynamicLayer whose keys and values live in storage grown a chunk of slots at a time: a decoding step writes
    its one slot in place, where DynamicLayer concatenates (copies) the whole cache at every step and layer. `keys`
    and `values` are views of the filled slots, the same numbers DynamicLayer would hold."""

    CHUNK = 64

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._keys: torch.Tensor | None = None
        self._values: torch.Tensor | None = None
        self._length = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, end = key_states.shape[-2], self._length + key_states.shape[-2]
        if self._keys is None or end > self._keys.shape[-2]:
            grown = []
            for old, new in ((self._keys, key_states), (self._values, value_states)):
                b, h, _, d = new.shape
                store = new.new_empty(b, h, end + self.CHUNK, d)
                if old is not None and self._length:
                    store[:, :, :self._length] = old[:, :, :self._length]
                grown.append(store)
            self._keys, self._values = grown
        self._keys[:, :, self._length:end] = key_states
        self._values[:, :, self._length:end] = value_states
        self._length = end
        self.keys, self.values = self._keys[:, :, :end], self._values[:, :, :end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self._length if self.is_initialized else 0

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.get_seq_length() > 0:
            self._keys, self._values = self._keys[indices], self._values[indices]
            self.keys, self.values = self._keys[:, :, :self._length], self._values[:, :, :self._length]


def decoding_cache(model: nn.Module) -> DynamicCache:
    """The KV cache of one decoding batch: the model's own layer types (DynamicCache(config)), with every plain
    DynamicLayer a GrowingLayer (sliding-window and other special layers are kept as they are)."""
    cache = DynamicCache(config=model.config) if hasattr(model, "config") else DynamicCache()
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    if getattr(cache, "layer_class_to_replicate", None) is DynamicLayer:
        cache.layer_class_to_replicate = GrowingLayer
    return cache


class _Decoder:
    """One batch: prefill, then one model call per step until every row stops."""

    def __init__(self, mode: str, model: nn.Module, ids: TraceTokenIds, vocab_size: int, *,
                 projector: Callable[[torch.Tensor], torch.Tensor] | None, latent_steps: int,
                 max_new_tokens: int, max_frames: int, value_feedback: str = "none",
                 latent_override: torch.Tensor | None = None, frames_per_block: int = 1,
                 latent_call: bool = False):
        self.mode, self.model, self.t = mode, model, ids
        self.body, self.head, _ = split_causal_lm(model, "model")
        self.embed = model.get_input_embeddings()
        self.vocab_size = vocab_size  # ids past the tokenizer's vocabulary (padded embeddings) are never chosen
        self.projector, self.latent_steps = projector, latent_steps
        self.max_new_tokens, self.max_frames = max_new_tokens, max_frames
        self.block = [ids.latent_start] + [LATENT] * latent_steps + [ids.latent_end]
        self.value_feedback = value_feedback      # codi.value_feedback: added to each block's last latent
        self.fed_latents = frames_per_block       # ... and to the last codi.frames_per_block latents (one per frame)
        self.latent_override = latent_override    # [H]: every latent input replaced by it (the ablation)
        self.latent_call = latent_call            # codi.latent_call: the entry call frame's block follows its <|call_sep|>

    def _advance(self, row: _Row, token: int | None) -> None:
        """Append the next item: the model's greedy `token`, or (None) the next forced latent-block item."""
        if token is None:
            row.ids.append(row.queue.pop(0))
        else:
            row.ids.append(token)
            t = self.t
            if token == t.eos:
                row.stop = "eos"
                return
            if self.mode != "direct":
                if row.node is not None:  # inside a constrained action: follow the trie
                    row.node = row.node.get(token)
                    if row.node is None or _LINE_END in row.node:  # a whole line written: free again
                        row.node = None
                elif token == t.action_sep and row.forced is not None and row.frames < len(row.forced):
                    row.node = row.forced[row.frames]
                elif token == t.action_sep and row.trie is not None:
                    row.node = row.trie
                if row.marker is None:
                    row.marker = token
                if token == t.frame_sep:
                    row.frames += 1
                    if row.marker == t.call_sep:
                        row.depth += 1
                    elif row.marker == t.return_sep:  # an exception frame is an event, not an exit
                        row.depth -= 1
                        if row.depth == 0:  # the entry call's exit frame is complete
                            row.stop = "entry_exit"
                            return
                    row.marker = None
                    if row.frames >= self.max_frames:
                        row.stop = "max_frames"
                        return
                if self.mode == "latent" and (token == t.line_sep or (
                        self.latent_call and token == t.call_sep and len(row.ids) == 1)):  # the trace's first frame
                    row.queue = list(self.block)
                    row.latent_blocks += 1
        if len(row.ids) >= self.max_new_tokens:
            row.stop = "max_new_tokens"

    def run(self, prompts: Sequence[Sequence[int]],
            action_lines: Sequence[Sequence[Sequence[int]]] | None = None,
            forced_actions: Sequence[Sequence[Sequence[int]]] | None = None) -> list[_Row]:
        dev = self.embed.weight.device
        dtype = self.embed.weight.dtype
        n = len(prompts)
        rows = [_Row() for _ in prompts]
        if action_lines is not None and self.mode != "direct":
            for row, lines in zip(rows, action_lines):
                row.trie = build_action_trie(lines)
        if forced_actions is not None and self.mode != "direct":
            for row, frames in zip(rows, forced_actions):
                row.forced = [build_action_trie([line]) for line in frames]
        width = max(len(p) for p in prompts)
        tokens = torch.full((n, width), self.t.pad, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for b, p in enumerate(prompts):  # left padding: every row's last prompt token is at column -1
            tokens[b, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
            mask[b, width - len(p):] = 1
        tokens, mask = tokens.to(dev), mask.to(dev)
        positions = (mask.cumsum(1) - 1).clamp(min=0)  # (n, width)
        next_pos = mask.sum(1)  # (n,) position of each row's next input
        cache = decoding_cache(self.model)
        with torch.no_grad():  # its transposed weights, once a batch, outside any graph
            lean = LeanDecoder.of(self.body)
        forward = lean if lean is not None else self.body  # the same outputs, fewer operations a step

        t0 = time.perf_counter()
        out = forward(inputs_embeds=self.embed(tokens), attention_mask=mask, position_ids=positions,
                        cache=cache, use_cache=True)
        hidden = out.last_hidden_state[:, -1]  # (n, H), post-final-norm
        live = list(range(n))  # original indices of the rows still in the batch, in batch order
        need = list(range(n))
        while True:
            # Rows with nothing forced queued take the model's greedy choice.
            choice: dict[int, int] = {}
            if need:
                logits = self.head(hidden[need])[:, :self.vocab_size]  # (len(need), V)
                # Rows inside a constrained action: only tokens that continue one of the program's lines. One
                # masked_fill for all of them (the kept logits are untouched, so the argmax is the per-row one's).
                cells = [(j, tok) for j, k in enumerate(need) if (node := rows[live[k]].node) is not None
                         for tok in node if tok != _LINE_END]
                if cells:
                    constrained = sorted({j for j, _ in cells})
                    blocked = torch.zeros(logits.shape, dtype=torch.bool)
                    blocked[constrained] = True
                    r, c = zip(*cells)
                    blocked[list(r), list(c)] = False
                    logits = logits.masked_fill(blocked.to(dev), float("-inf"))
                choice = dict(zip(need, logits.argmax(-1).tolist()))
            for k, b in enumerate(live):
                self._advance(rows[b], choice.get(k))
            elapsed = time.perf_counter() - t0
            for b in live:  # this step's (or the prefill's) time, split over the rows it fed
                rows[b].time_s += elapsed / len(live)
            keep = [k for k, b in enumerate(live) if not rows[b].stop]
            if not keep:
                break
            t0 = time.perf_counter()
            if len(keep) < len(live):
                sel = torch.tensor(keep, device=dev)
                cache.batch_select_indices(sel)
                mask, hidden, next_pos = mask[sel], hidden[sel], next_pos[sel]
                live = [live[k] for k in keep]
            # Next inputs (A, 1, H): the embedding of each row's last item, or a latent.
            last = [rows[b].ids[-1] for b in live]
            emb = self.embed(torch.tensor([max(i, 0) for i in last], device=dev)[:, None])
            lat = [k for k, i in enumerate(last) if i == LATENT]
            if lat:
                if self.projector is None:
                    raise ValueError("latent decoding needs a projector")
                emb = emb.clone()
                x = latent_input(self.projector, hidden[lat][:, None]).to(dtype)  # (L, 1, H)
                if self.value_feedback != "none":  # the block's last latents: latent_end and at most m - 1 latents follow
                    last_latent = torch.tensor([len(rows[live[k]].queue) <= self.fed_latents for k in lat], device=dev)
                    fb = value_feedback(self.head, self.embed.weight, hidden[lat], self.value_feedback).to(dtype)
                    x = x + torch.where(last_latent[:, None], fb, torch.zeros((), dtype=dtype, device=dev))[:, None]
                if self.latent_override is not None:
                    x = self.latent_override.to(device=dev, dtype=dtype).expand_as(x)
                emb[lat] = x
                for k in lat:
                    rows[live[k]].latents.append(emb[k, 0].detach().float().cpu())
            mask = torch.cat([mask, mask.new_ones((len(live), 1))], dim=1)
            out = forward(inputs_embeds=emb, attention_mask=mask, position_ids=next_pos[:, None],
                            cache=cache, use_cache=True)
            hidden = out.last_hidden_state[:, -1]
            next_pos = next_pos + 1
            need = [k for k, b in enumerate(live) if not rows[b].queue]
        return rows


# ------------------------------------------------------------------------------------ parsing
def _decode_text(tokenizer, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _split_frames(ids: list[int], frame_sep: int) -> list[list[int]]:
    """Token chunks, one per frame; the last chunk is what follows the last `<|frame_sep|>`."""
    chunks: list[list[int]] = [[]]
    for i in ids:
        chunks[-1].append(i)
        if i == frame_sep:
            chunks.append([])
    return chunks


def _one_frame(text: str, index: int) -> Frame:
    """Parse one frame's text (it ends in `<|frame_sep|>`); errors name frame `index`."""
    try:
        frames, rest = parse_frames_prefix(text)
    except TraceParseError as e:
        raise TraceParseError(f"frame {index}: {str(e).removeprefix('frame 0: ')}") from None
    except RecursionError:  # json.loads of absurdly nested locals or value
        raise TraceParseError(f"frame {index}: JSON nested too deep: {text[:80]!r}") from None
    if len(frames) != 1 or rest:  # a separator spelled out of ordinary tokens
        raise TraceParseError(f"frame {index}: separator text inside the frame: {text[:80]!r}")
    return frames[0]


def _latent_frame(chunk: list[int], index: int, t: TraceTokenIds, tokenizer, block_len: int,
                  latent_unit: str = "locals", latent_call: bool = False) -> Frame:
    """Parse a LINE frame whose locals are a latent block: line_sep, block, action_sep, line, frame_sep; in the
    frame unit, whose locals and line are: line_sep, block, frame_sep (`chunk` ends with the frame's frame_sep).
    With `latent_call` (frame unit), frame 0 may be the entry call's: call_sep, block, frame_sep."""
    starts = [k for k, i in enumerate(chunk) if i == t.latent_start]
    call = latent_call and index == 0 and chunk[0] == t.call_sep
    if (chunk[0] != t.line_sep and not call) or starts != [1] or chunk.count(LATENT) != block_len - 2:
        raise TraceParseError(f"frame {index}: a latent block outside a LINE frame's start"
                              + (" (or the entry call frame's)" if latent_call else ""))
    after = chunk[1 + block_len:]
    if latent_unit == "frame":
        if after != [t.frame_sep]:
            raise TraceParseError(f"frame {index}: latent block followed by "
                                  f"{_decode_text(tokenizer, after[:1])!r}, not {FRAME_SEP}")
        # the line is latent: no text to compare
        return Frame("call" if call else "line", None, locals=None)  # type: ignore[arg-type]
    if not after or after[0] != t.action_sep:
        got = repr(_decode_text(tokenizer, after[:1])) if after else "nothing"
        raise TraceParseError(f"frame {index}: latent block followed by {got}, not {ACTION_SEP}")
    # Any JSON object stands in for the locals so that the rest is checked by the one grammar.
    frame = _one_frame(LINE_SEP + "{}" + _decode_text(tokenizer, after), index)
    return Frame("line", frame.source_line, locals=None)


def parse_generation(mode: str, ids: list[int], tokenizer, t: TraceTokenIds, stop: str,
                     latent_steps: int = 0, latent_unit: str = "locals", latent_call: bool = False
                     ) -> tuple[str, list[Frame], str | None, str | None, str]:
    """Generated ids -> (text, frames, answer, answer_kind, error). Never raises on bad output.

    Errors, first one wins: a frame that does not parse (strict: locals a JSON object of strings,
    VALUE a JSON string), a latent block not followed by `<|action_sep|>` (frame unit: `<|frame_sep|>`) or not at a LINE frame's
    start, no entry exit frame (the stop reason says which cap ended it), or (direct) a malformed answer."""
    pieces, run = [], []
    for i in ids:  # text: runs of tokens decoded at once, a marker per latent
        if i == LATENT:
            pieces.append(_decode_text(tokenizer, run) + LATENT_TEXT)
            run = []
        else:
            run.append(i)
    text = "".join(pieces) + _decode_text(tokenizer, run)
    body = ids[:-1] if ids and ids[-1] == t.eos else ids
    if mode == "direct":
        if stop != "eos":
            return text, [], None, None, f"no eos before {stop}"
        parsed = parse_direct(_decode_text(tokenizer, body))
        return text, [], parsed.answer, None, parsed.error
    chunks = _split_frames(body, t.frame_sep)
    frames: list[Frame] = []
    block_len = latent_steps + 2
    for index, chunk in enumerate(chunks[:-1]):
        try:
            if mode == "latent" and t.latent_start in chunk:
                frames.append(_latent_frame(chunk, index, t, tokenizer, block_len, latent_unit, latent_call))
            else:
                frames.append(_one_frame(_decode_text(tokenizer, chunk), index))
        except TraceParseError as e:
            return text, frames, None, None, f"malformed: {e}"
    exit_frame = entry_exit(frames)
    if exit_frame is None:
        open_chunk = chunks[-1]
        if mode == "latent" and t.latent_start in open_chunk and len(open_chunk) > block_len + 1:
            try:  # a violation inside the open last frame says more than "no exit"
                _latent_frame(open_chunk + [t.frame_sep], len(frames), t, tokenizer, block_len, latent_unit,
                              latent_call)
            except TraceParseError as e:
                if "followed by" in str(e):
                    return text, frames, None, None, f"malformed: {e}"
        return text, frames, None, None, f"no entry return frame (stopped by {stop})"
    return text, frames, exit_frame.value_repr(), exit_kind(frames, exit_frame), ""


# ----------------------------------------------------------------------------------------- API
def latent_statistics(latents: Sequence[torch.Tensor], latent_steps: int) -> tuple[float | None, float | None]:
    """(mean L2 norm of the latent inputs, mean pairwise cosine similarity between the latent blocks) of one
    decoded example; a block's vector is the mean of its `latent_steps` latents. The cosine is SIM-CoT's
    collapse signature (blocks that all hold one vector); None with fewer than two blocks."""
    if not latents or latent_steps < 1:
        return None, None
    x = torch.stack(list(latents))  # [blocks * steps, H]
    norm = float(x.norm(dim=-1).mean())
    blocks = x[:len(x) // latent_steps * latent_steps].view(-1, latent_steps, x.shape[-1]).mean(1)
    if len(blocks) < 2:
        return norm, None
    unit = torch.nn.functional.normalize(blocks, dim=-1)
    sim = unit @ unit.T
    off = ~torch.eye(len(blocks), dtype=torch.bool)
    return norm, float(sim[off].mean())


def _check(mode: str, projector, latent_steps: int, max_new_tokens: int, max_frames: int,
           latent_unit: str = "locals") -> None:
    if mode not in MODES:
        raise ValueError(f"decoding mode {mode!r}: expected one of {MODES}")
    if latent_unit not in ("locals", "frame"):
        raise ValueError(f"latent_unit = {latent_unit!r}: expected 'locals' or 'frame' (codi.latent_unit)")
    if mode == "latent" and projector is None:
        raise ValueError("latent decoding needs a projector (the codi model's thought projector)")
    if latent_steps < 0 or max_new_tokens < 1 or max_frames < 1:
        raise ValueError(f"latent_steps = {latent_steps}, max_new_tokens = {max_new_tokens}, max_frames = "
                         f"{max_frames}: expected latent_steps >= 0 and caps >= 1")


def decode(mode: str, model: nn.Module, tokenizer, prompts: Sequence[Sequence[int]], *,
           projector: Callable[[torch.Tensor], torch.Tensor] | None = None, latent_steps: int = 1,
           max_new_tokens: int = 1024, max_frames: int = 256,
           ids: TraceTokenIds | None = None,
           action_lines: Sequence[Sequence[Sequence[int]]] | None = None,
           forced_actions: Sequence[Sequence[Sequence[int]]] | None = None,
           value_feedback: str = "none", latent_override: torch.Tensor | None = None,
           latent_unit: str = "locals", frames_per_block: int = 1, latent_call: bool = False) -> list[DecodeResult]:
    """Decode one batch of prompts (token id lists) greedily; results in prompt order.

    `action_lines`: per prompt, its program's lines as token ids (`program_action_lines`): actions
    are decoded constrained to them (explicit, latent; docs/design/decoding.md, "Decoding"). None = unconstrained.
    `forced_actions`: per prompt, the true trace's LINE of every frame as token ids: frame k's action is
    teacher-forced to the k-th (a diagnostic that separates lost state from a wrong line); frames past
    the truth's fall back to `action_lines`.
    `value_feedback`: the codi model's codi.value_feedback (none | soft | hard). `latent_override` [H]: every latent
    input is this one vector (the constant-latent ablation: what the latents carry is what this loses).
    `latent_unit`: the codi model's codi.latent_unit: in the frame unit a latent block is a LINE frame's locals and
    line, so `<|frame_sep|>` follows it (the decoder forces the block alike; parsing and scoring differ);
    `frames_per_block` (codi.frames_per_block): the LINE frames a block stands for, the value feedback going to its last
    that many latents; `latent_call` (codi.latent_call, frame unit): the trace's first `<|call_sep|>` opens a block too."""
    if frames_per_block < 1 or (frames_per_block > 1 and (latent_unit != "frame" or latent_steps <= frames_per_block)):
        raise ValueError(f"frames_per_block = {frames_per_block}: expected 1, or more in the frame unit with "
                         f"latent_steps above it (latent_unit {latent_unit!r}, latent_steps {latent_steps})")
    _check(mode, projector, latent_steps, max_new_tokens, max_frames, latent_unit)
    if latent_call and latent_unit != "frame":
        raise ValueError(f"latent_call needs latent_unit 'frame' (got {latent_unit!r}; codi.latent_call)")
    if not prompts:
        return []
    for name, per_prompt in (("action_lines", action_lines), ("forced_actions", forced_actions)):
        if per_prompt is not None and len(per_prompt) != len(prompts):
            raise ValueError(f"{name}: {len(per_prompt)} entries for {len(prompts)} prompts")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt: every prompt must hold at least one token")
    t = ids or token_ids(tokenizer)
    modules = [m for m in (model, projector) if isinstance(m, nn.Module)]
    training = [m.training for m in modules]
    for m in modules:  # greedy and deterministic: no dropout; restored after
        m.eval()
    try:
        with torch.inference_mode():
            rows = _Decoder(mode, model, t, len(tokenizer), projector=projector, latent_steps=latent_steps,
                            max_new_tokens=max_new_tokens, max_frames=max_frames, value_feedback=value_feedback,
                            latent_override=latent_override, frames_per_block=frames_per_block,
                            latent_call=latent_call and mode == "latent").run(prompts, action_lines, forced_actions)
    finally:
        for m, was in zip(modules, training):
            m.train(was)
    results = []
    for row in rows:
        text, frames, answer, kind, error = parse_generation(mode, row.ids, tokenizer, t, row.stop, latent_steps,
                                                             latent_unit, latent_call and mode == "latent")
        norm, cosine = latent_statistics(row.latents, latent_steps)
        results.append(DecodeResult(mode=mode, ids=row.ids, text=text, frames=frames, answer=answer,
                                    positions=len(row.ids), latent_blocks=row.latent_blocks, stop=row.stop,
                                    error=error, time_s=row.time_s, answer_kind=kind, latent_norm=norm,
                                    latent_cosine=cosine, latent_count=len(row.latents),
                                    latent_sum=torch.stack(row.latents).sum(0) if row.latents else None,
                                    latent_lines=mode == "latent" and latent_unit == "frame",
                                    frames_per_block=frames_per_block if mode == "latent" else 1))
    return results


def iter_decode(mode: str, model: nn.Module, tokenizer, prompts: Sequence[Sequence[int]], *,
                batch_size: int = 16, progress: bool | str = False, **kwargs) -> Iterator[DecodeResult]:
    """Decode many prompts in consecutive batches of `batch_size`, yielding results in prompt order.

    `kwargs` are `decode`'s (projector, latent_steps, max_new_tokens, max_frames, ids); `action_lines`
    (one entry per prompt) is split into the same batches. `progress` shows a tqdm bar over batches (a string:
    the bar's label)."""
    if batch_size < 1:
        raise ValueError(f"batch_size = {batch_size}: expected >= 1")
    _check(mode, kwargs.get("projector"), kwargs.get("latent_steps", 1),
           kwargs.get("max_new_tokens", 1024), kwargs.get("max_frames", 256), kwargs.get("latent_unit", "locals"))
    starts = range(0, len(prompts), batch_size)
    if progress:
        from tqdm.auto import tqdm
        starts = tqdm(starts, desc=progress if isinstance(progress, str) else f"decode {mode}", unit="batch")
    per_prompt = {k: kwargs.pop(k, None) for k in ("action_lines", "forced_actions")}
    for name, v in per_prompt.items():
        if v is not None and len(v) != len(prompts):
            raise ValueError(f"{name}: {len(v)} entries for {len(prompts)} prompts")
    for s in starts:
        chunk = {k: None if v is None else v[s:s + batch_size] for k, v in per_prompt.items()}
        yield from decode(mode, model, tokenizer, prompts[s:s + batch_size], **chunk, **kwargs)
