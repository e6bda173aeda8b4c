"""Named presets of params overrides for a kind of machine (configs/profiles/<name>.yaml), e.g. one GPU.

    python -m experiments.profile list                                    # the profiles and what they are for
    python -m experiments.profile params gpu-h200 --out /tmp/gpu.yaml     # params.yaml + the preset, checked, as a file
    python -m experiments.profile params gpu-h200 --tiny --out /tmp/t.yaml  # its tiny CPU version (gpu_check.sh's dry run)
    python -m experiments.profile command gpu-h200                        # the `dvc exp run -S ...` that applies it

A profile names a rung of the task ladder (configs/ladder.yaml: the task), then `set`: dotted params keys as
`dvc exp run -S` takes them (model size, budget, batch), and `tiny`: keys applied on top of those for a CPU dry
run of the same pipeline. With DVC the preset is one experiment (`command`); without DVC (a GPU machine with
no dvc) the stages run as dvc.yaml's cmds with `python -m codi --params <the file params writes> <stage> ...`.
Every key must exist in params.yaml and the result must pass its schema, or the profile is refused, naming
the file and key.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from codi.infra.config import ConfigError, params_from_dict, read_yaml, set_dotted
from experiments.dvc_exp import exp_run_args
from experiments.ladder import load_rungs

ROOT = Path(__file__).resolve().parents[1]
PROFILES_DIR = ROOT / "configs" / "profiles"
KEYS = {"name", "doc", "rung", "set", "tiny"}


@dataclass(frozen=True)
class Profile:
    name: str
    doc: str
    rung: str
    rung_overrides: dict[str, Any]
    overrides: dict[str, Any]   # `set`
    tiny: dict[str, Any]        # the dry run's keys on top of `set`
    path: Path

    def all_overrides(self, tiny: bool = False) -> dict[str, Any]:
        """The rung's keys, then `set`, then (tiny) `tiny`: what the params file gets, in order."""
        return {**self.rung_overrides, **self.overrides, **(self.tiny if tiny else {})}


def profile_path(name_or_path: str | Path) -> Path:
    p = Path(name_or_path)
    return p if p.suffix in (".yaml", ".yml") else PROFILES_DIR / f"{name_or_path}.yaml"


def load_profile(name_or_path: str | Path, params_path: Path = ROOT / "params.yaml",
                 rungs_path: Path | None = None) -> Profile:
    """The profile `name_or_path` (a name in configs/profiles/ or a .yaml file), checked: its rung exists, every
    key of `set` and `tiny` is a params key, `set` does not repeat a key of the rung, and both the profile and its
    tiny version make a valid params file."""
    path = profile_path(name_or_path)
    if not path.is_file():
        known = sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))
        raise ConfigError(f"{path}: no such profile (known: {', '.join(known) or 'none'})")
    raw = read_yaml(path)
    if not isinstance(raw, dict) or set(raw) != KEYS:
        got = sorted(raw) if isinstance(raw, dict) else type(raw).__name__
        raise ConfigError(f"{path}: expected exactly the keys {sorted(KEYS)}, got {got}")
    for key in ("set", "tiny"):
        if not isinstance(raw[key], dict) or not all(isinstance(k, str) for k in raw[key]):
            raise ConfigError(f"{path}: {key}: expected a mapping of dotted params keys")
    if raw["name"] != path.stem:
        raise ConfigError(f"{path}: name {raw['name']!r}: expected the file's name, {path.stem!r}")
    rungs = {r.name: r for r in (load_rungs(rungs_path, params_path) if rungs_path else load_rungs(params_path=params_path))}
    if raw["rung"] not in rungs:
        raise ConfigError(f"{path}: rung {raw['rung']!r}: expected one of {sorted(rungs)} (configs/ladder.yaml)")
    rung = rungs[raw["rung"]]
    if clash := sorted(set(raw["set"]) & set(rung.overrides)):
        raise ConfigError(f"{path}: set: {clash[0]} is the rung's ({rung.name}) own key: choose another rung instead")
    profile = Profile(raw["name"], " ".join(str(raw["doc"]).split()), rung.name, dict(rung.overrides),
                      dict(raw["set"]), dict(raw["tiny"]), path)
    base = read_yaml(params_path)
    for tiny in (False, True):
        make_params(profile, base, tiny=tiny, source=f"{path}{' (tiny)' if tiny else ''}")
    return profile


def make_params(profile: Profile, base: dict[str, Any], tiny: bool = False, source: str | None = None) -> dict[str, Any]:
    """`base` (params.yaml's mapping) with the profile applied, validated against the schema."""
    source = source or str(profile.path)
    try:
        out = set_dotted(base, profile.all_overrides(tiny))
    except KeyError as e:
        raise ConfigError(f"{source}: unknown params key {e.args[0]} (not in params.yaml)") from None
    params_from_dict(out, source=source)
    return out


def dvc_command(profile: Profile, name: str | None = None) -> list[str]:
    """The `dvc exp run` that applies the profile as one named experiment."""
    return ["dvc", *exp_run_args(profile.all_overrides(), name or profile.name)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.profile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", type=Path, default=ROOT / "params.yaml", help="the params file the preset applies to")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="the profiles of configs/profiles/")
    p = sub.add_parser("params", help="write params.yaml + the preset (checked) to a file")
    p.add_argument("profile", help="a name in configs/profiles/ or a .yaml file")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tiny", action="store_true", help="the profile's tiny CPU version (its `tiny` keys on top)")
    c = sub.add_parser("command", help="print the `dvc exp run -S ...` command that applies the preset")
    c.add_argument("profile")
    c.add_argument("-n", "--name", default=None, help="experiment name (default: the profile's)")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "list":
            for path in sorted(PROFILES_DIR.glob("*.yaml")):
                prof = load_profile(path, args.base)
                print(f"{prof.name} (rung {prof.rung}): {prof.doc}")
            return 0
        prof = load_profile(args.profile, args.base)
        if args.cmd == "command":
            print(shlex.join(dvc_command(prof, args.name)))
            return 0
        params = make_params(prof, read_yaml(args.base), tiny=args.tiny)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        header = (f"# {args.base.name} + profile {prof.name}{' (tiny)' if args.tiny else ''} "
                  f"({prof.path.relative_to(ROOT) if prof.path.is_relative_to(ROOT) else prof.path}): "
                  f"written by python -m experiments.profile; do not edit\n")
        args.out.write_text(header + yaml.safe_dump(params, sort_keys=False, width=120))
        print(f"{args.out}: {args.base.name} + {prof.name}{' (tiny)' if args.tiny else ''}, "
              f"{len(prof.all_overrides(args.tiny))} keys set")
        return 0
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
