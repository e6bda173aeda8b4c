"""The built-in, seeded generator of small programs: the embedded default's main training data.

    from codi.sources.synthetic import generate, generate_programs
    samples = generate(params.extract.synthetic)      # SyntheticConfig -> list[Sample]
    programs = generate_programs(params.extract.synthetic)   # with each program's template, for statistics

Difficulty d draws from the templates of level <= d (codi.sources.synthetic_templates), or `templates` names
them. Every call is run here (trusted code, plain `exec`) under a counting tracer before it is kept, and its
repr is `expected`; a call with an integer outside `value_range` is drawn again. The same seed gives
byte-identical programs. The task ladder's rungs are sets of these knobs: docs/RESULTS.md, "Research III".

    $ python -m codi.sources.synthetic 5 2      # print 5 programs of difficulty 2 (params.yaml's other knobs)
"""

from __future__ import annotations

import hashlib
import random
import sys
from dataclasses import dataclass
from types import FrameType
from typing import Any

from codi.infra.config import ConfigError
from codi.schemas.extract import SyntheticConfig
from codi.sources.base import Sample, normalize_program
from codi.sources.synthetic_templates import TEMPLATES, Draft, Gen, Template

NAME = "synthetic"
MAX_LINES = 12
MAX_FRAMES = 50       # call + line + return events of one call; most calls need 10-35
MAX_LEN = 8           # list / dict items
MAX_STR = 12
_FILENAME = "<synthetic>"
_PROGRAM_ATTEMPTS = 200
_INPUT_DRAWS = 8      # input draws per wanted call before a program is redrawn
_PROBES = 3           # calls run per program (at least) to refuse one whose result is constant


@dataclass(frozen=True)
class SyntheticProgram:
    """One generated program with its calls and the return value of each (as a repr)."""

    index: int
    template: str
    level: int
    program: str
    entry: str
    calls: tuple[tuple[str, str], ...]  # (call, repr of the result)

    @property
    def n_lines(self) -> int:
        return self.program.count("\n")


def generate(cfg: SyntheticConfig) -> list[Sample]:
    """`cfg.n_programs * cfg.calls_per_program` samples, ids `synthetic/<i>/<k>`."""
    samples = []
    for prog in generate_programs(cfg):
        problem = f"{NAME}/{prog.index}"
        for k, (call, expected) in enumerate(prog.calls):
            samples.append(Sample(sample_id=f"{problem}/{k}", source=NAME, problem_id=problem,
                                  program=prog.program, call=call, expected=expected, difficulty=prog.level))
    return samples


def generate_programs(cfg: SyntheticConfig) -> list[SyntheticProgram]:
    """The programs of `cfg`, distinct texts, in index order."""
    templates = select_templates(cfg)
    seen: set[str] = set()
    out = []
    for i in range(cfg.n_programs):
        prog = _draw_program(i, cfg, templates, seen)
        seen.add(prog.program)
        out.append(prog)
    return out


def select_templates(cfg: SyntheticConfig) -> list[Template]:
    """The templates `cfg.templates` names (in TEMPLATES order), or every one of level <= difficulty."""
    if not cfg.templates:
        return [t for t in TEMPLATES if t.by_level and t.level <= cfg.difficulty]
    too_hard = [t.name for t in TEMPLATES if t.name in cfg.templates and t.level > cfg.difficulty]
    if too_hard:
        raise ConfigError(f"extract.synthetic.templates names {too_hard[0]!r}, a level-"
                          f"{next(t.level for t in TEMPLATES if t.name == too_hard[0])} template, above "
                          f"extract.synthetic.difficulty = {cfg.difficulty}")
    return [t for t in TEMPLATES if t.name in cfg.templates]


def _draw_program(i: int, cfg: SyntheticConfig, templates: list[Any], seen: set[str]) -> SyntheticProgram:
    for attempt in range(_PROGRAM_ATTEMPTS):
        rng = random.Random(_derive_seed(cfg.seed, i, attempt))
        template = templates[rng.randrange(len(templates))]
        draft = template.build(Gen(rng, cfg.max_int, cfg.canonical_names, tuple(cfg.operators),
                                   (cfg.chain_steps[0], cfg.chain_steps[1]), cfg.add_max))
        program = normalize_program("\n".join(draft.lines))
        if program in seen or not 3 <= program.count("\n") <= MAX_LINES:
            continue
        calls = _draw_calls(program, draft, rng, cfg.calls_per_program, (cfg.value_range[0], cfg.value_range[1]))
        if calls is not None:
            return SyntheticProgram(i, template.name, template.level, program, draft.entry, tuple(calls))
    raise RuntimeError(f"synthetic program {i} (seed {cfg.seed}): no valid program in {_PROGRAM_ATTEMPTS} "
                       f"attempts; calls_per_program = {cfg.calls_per_program} may exceed the input variety")


def _derive_seed(seed: int, i: int, attempt: int) -> int:
    # A hash, not seed + i: neighbouring seeds must not give shifted copies of the same programs.
    return int.from_bytes(hashlib.sha256(f"codi-synthetic/{seed}/{i}/{attempt}".encode()).digest()[:8], "big")


def _draw_calls(program: str, draft: Draft, rng: random.Random, wanted: int,
                value_range: tuple[int, int]) -> list[tuple[str, str]] | None:
    """`wanted` distinct valid calls, or None; a program whose results never differ is refused."""
    code = compile(program, _FILENAME, "exec")
    calls: dict[str, str] = {}
    needed = max(wanted, _PROBES)  # at least _PROBES calls to tell a constant program apart
    for _ in range(needed * _INPUT_DRAWS):
        args = [draw(rng) for draw in draft.inputs]
        call = f"{draft.entry}({', '.join(repr(a) for a in args)})"
        if call in calls:
            continue
        result = run_call(code, draft.entry, args, value_range)
        if result is not None:
            calls[call] = result
            if len(calls) == needed:
                break
    if len(calls) < needed or len(set(calls.values())) == 1:
        return None
    return list(calls.items())[:wanted]


class _Reject(Exception):
    """A call that ran too long or held a value too large to learn from."""


def run_call(code: Any, entry: str, args: list[Any], value_range: tuple[int, int]) -> str | None:
    """repr of `entry(*args)` after exec of `code`, or None when it fails the generator's limits: too many
    events, or a value too large (an integer outside `value_range`, a long list or string) in any frame."""
    namespace: dict[str, Any] = {"__name__": "__synthetic__"}
    events = 0

    def small(value: Any) -> bool:
        return _small(value, value_range)

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal events
        events += 1
        if events > MAX_FRAMES or not all(small(v) for v in frame.f_locals.values()) \
                or (event == "return" and not small(arg)):
            raise _Reject
        return local

    def global_(frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename != _FILENAME:
            return None  # builtins and library code are not traced, as in the real tracer
        return local(frame, event, arg)

    exec(code, namespace)  # noqa: S102 - our own generated code, not a dataset's
    previous = sys.gettrace()
    sys.settrace(global_)
    try:
        result = namespace[entry](*args)
    except Exception:  # noqa: BLE001 - _Reject, or a program/input pair that fails: draw again
        return None
    finally:
        sys.settrace(previous)
    if result is None or not small(result):
        return None
    return repr(result)


def _small(value: Any, value_range: tuple[int, int]) -> bool:
    if isinstance(value, bool) or value is None:
        return True
    if isinstance(value, int):
        return value_range[0] <= value <= value_range[1]
    if isinstance(value, str):
        return len(value) <= MAX_STR
    if isinstance(value, (list, tuple)):
        return len(value) <= MAX_LEN and all(_small(v, value_range) for v in value)
    if isinstance(value, dict):
        return len(value) <= MAX_LEN and all(_small(k, value_range) and _small(v, value_range)
                                             for k, v in value.items())
    return callable(value)  # a helper function bound in a frame's locals


def _main(argv: list[str]) -> None:
    """`python -m codi.sources.synthetic [N] [DIFFICULTY]`: N programs as params.yaml's generator draws them."""
    from dataclasses import replace

    from codi.infra.config import load_params

    shipped = load_params("params.yaml").extract.synthetic
    n = int(argv[0]) if argv else 5
    difficulty = int(argv[1]) if len(argv) > 1 else shipped.difficulty
    for prog in generate_programs(replace(shipped, n_programs=n, difficulty=difficulty)):
        print(f"# {prog.template} (level {prog.level})\n{prog.program}" +
              "".join(f"# {c} == {r}\n" for c, r in prog.calls))


if __name__ == "__main__":
    _main(sys.argv[1:])
